"""Hugging Face models from their configs, built on the ``meta`` device (no weights in memory),
with a training batch and loss: what ``slackswap fit`` profiles fake.

Families: ``gpt2`` (GPT2LMHeadModel), ``bert`` (BertForMaskedLM), ``llama`` (LlamaForCausalLM) and
``mistral`` (MistralForCausalLM). A config starts from the family's ``transformers`` defaults
(GPT-2 small, BERT-base, a Llama-7B and a Mistral-7B shape) and takes the user's overrides; the
loss is the model's own (``labels=input_ids``), as the Trainer computes it.
"""

from __future__ import annotations

from typing import Any

FAMILIES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "bert": ("BertConfig", "BertForMaskedLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}
DTYPES = ("float32", "bfloat16", "float16")


def hf_config(family: str, overrides: dict[str, Any] | None = None):
    """The family's config with ``overrides`` (unknown keys are refused by name)."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; one of {', '.join(FAMILIES)}")
    config_cls = getattr(transformers, FAMILIES[family][0])
    config = config_cls()
    for key, value in (overrides or {}).items():
        if not hasattr(config, key):
            raise ValueError(f"{config_cls.__name__} has no field {key!r}")
        setattr(config, key, value)
    return config


def meta_model(
    family: str,
    overrides: dict[str, Any] | None = None,
    dtype: str = "bfloat16",
    attention: str = "sdpa",
):
    """(model in training mode on the meta device, its config)."""
    import torch
    import transformers

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    config = hf_config(family, overrides)
    config._attn_implementation = attention
    with torch.device("meta"):
        model = getattr(transformers, FAMILIES[family][1])(config)
    return model.to(getattr(torch, dtype)).train(), config


def training_batch(config, seq: int, batch: int):
    """(inputs, loss_fn): token ids of ``batch x seq`` with themselves as labels, the model's own
    loss. The ids are real and tiny (a fake profile turns them into fakes)."""
    import torch

    for name, value in (("seq", seq), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and seq > limit:
        raise ValueError(
            f"seq {seq} is longer than the config's {limit} positions "
            "(set max_position_embeddings / n_positions in --hf-config)"
        )
    ids = torch.zeros((batch, seq), dtype=torch.long)
    return {"input_ids": ids, "labels": ids}, (lambda out: out.loss)
