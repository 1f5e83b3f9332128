"""Hugging Face models from their configs, built on the ``meta`` device (no weights in memory),
with a training batch and loss: what ``slackswap fit`` profiles fake.

A model is named three ways (:func:`hf_config`): a ``model_type`` transformers knows (``gpt2``,
``bert``, ``llama``, ``mistral``, ``qwen2``, ``gemma2``, ``phi3``, ``gpt_neox``, ...: the
family's defaults), a ``config.json`` file or a folder holding one, or a model id whose
``config.json`` is in the local Hugging Face cache (never fetched). Overrides go to the config's
constructor with the rest of its fields, as ``from_pretrained`` builds it, so derived fields
follow them (``head_dim`` from ``hidden_size`` and the heads, ``num_key_value_heads`` from
``num_attention_heads``, ``rope_theta`` into ``rope_parameters``). The model is the family's causal
LM, or its masked LM for encoders (BERT, RoBERTa); the loss is the model's own
(``labels=input_ids``), as the Trainer computes it.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

# the families the documentation names; any model_type transformers knows is taken
FAMILIES = ("gpt2", "bert", "llama", "mistral", "qwen2", "gemma2", "phi3", "gpt_neox")
DTYPES = ("float32", "bfloat16", "float16")
# keys a config.json may hold that the constructor reads under another name
LEGACY_KEYS = {"rope_theta", "rope_scaling", "torch_dtype"}


class ModelSpecError(ValueError):
    """A model name, config file or override that cannot make a config: one line saying why."""


def _config_file(model: str) -> Path | None:
    """The config.json ``model`` names: the file, a folder's, or a cached model id's."""
    path = Path(model).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return path / "config.json"
        raise ModelSpecError(f"{model}: the folder holds no config.json")
    if "/" in model and not path.exists():
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json")
        if isinstance(found, str):
            return Path(found)
        raise ModelSpecError(
            f"{model}: not a file or folder, and no config.json for this model id in the local "
            "Hugging Face cache (slackswap reads the cache only; download it with "
            f"`huggingface-cli download {model} config.json`)"
        )
    return None


def _known_fields(config_cls) -> set[str]:
    fields = set(inspect.signature(config_cls.__init__).parameters) - {"self", "kwargs"}
    fields |= set(vars(config_cls()).keys()) | set(getattr(config_cls, "attribute_map", {}))
    return fields | LEGACY_KEYS


def hf_config(model: str, overrides: dict[str, Any] | None = None):
    """The transformers config ``model`` names (module docstring), with ``overrides`` passed to
    its constructor. An override the config class has no field for is refused by name.

    Args:
        model: a model_type (``llama``), a config.json or its folder, or a cached model id.
        overrides: config fields over the family's defaults or the file's values.

    Returns:
        A ``transformers.PretrainedConfig``.

    Raises:
        ModelSpecError: an unknown family, a missing file or id, an unknown field.
    """
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    overrides = dict(overrides or {})
    source = _config_file(model)
    if source is not None:
        try:
            fields = json.loads(source.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelSpecError(f"{source}: not a readable config.json ({exc})") from None
        if not isinstance(fields, dict) or "model_type" not in fields:
            raise ModelSpecError(f"{source}: a config.json names its model_type; this one does not")
        model_type = fields.pop("model_type")
    else:
        model_type, fields = model, {}
    if model_type not in CONFIG_MAPPING:
        raise ModelSpecError(
            f"unknown model {model!r}: not a file, a folder with a config.json, a cached model id "
            f"or a model_type transformers knows (such as {', '.join(FAMILIES)})"
        )
    config_cls = CONFIG_MAPPING[model_type]
    unknown = sorted(set(overrides) - _known_fields(config_cls))
    if unknown:
        raise ModelSpecError(f"{config_cls.__name__} has no field {', '.join(map(repr, unknown))}")
    try:
        return AutoConfig.for_model(model_type, **{**fields, **overrides})
    except (TypeError, ValueError) as exc:
        raise ModelSpecError(f"{config_cls.__name__}: {exc}") from None


def model_class(config):
    """The class trained from ``config``: its masked LM for an encoder (not ``is_decoder``) that
    has one, else its causal LM."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kind = config.model_type
    masked = MODEL_FOR_MASKED_LM_MAPPING_NAMES.get(kind)
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind)
    name = masked if masked and (not causal or not getattr(config, "is_decoder", False)) else causal
    if name is None:
        raise ModelSpecError(
            f"{kind}: transformers has no causal or masked language model for this model_type"
        )
    return getattr(transformers, name)


def meta_model(
    model: str,
    overrides: dict[str, Any] | None = None,
    dtype: str = "bfloat16",
    attention: str = "sdpa",
):
    """(model in training mode on the meta device, its config): parameters in ``dtype``, every
    field of the config as :func:`hf_config` gives it. Attention runs as ``attention`` says where
    the class supports it, else as transformers runs that class (Gemma-2's logit soft-capping
    has no SDPA path: eager, saving its s x s probabilities).

    Args:
        model: as :func:`hf_config` takes it.
        overrides: config fields, as :func:`hf_config` takes them.
        dtype: the parameters' dtype (float32, bfloat16, float16).
        attention: transformers' attention implementation where the class has it.

    Returns:
        (the model on the meta device in training mode, its config).
    """
    import torch

    if dtype not in DTYPES:
        raise ModelSpecError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    config = hf_config(model, overrides)
    cls = model_class(config)
    if attention == "sdpa" and not getattr(cls, "_supports_sdpa", False):
        attention = "eager"
    config._attn_implementation = attention
    with torch.device("meta"):
        built = cls(config)
    return built.to(getattr(torch, dtype)).train(), config


def training_batch(config, seq: int, batch: int):
    """Token ids of ``batch x seq`` with themselves as labels, and the model's own loss. The ids
    are real and tiny (a fake profile turns them into fakes, reading their values where the
    real step reads them).

    Args:
        config: the model's config (its positions bound ``seq``).
        seq: tokens per sequence.
        batch: sequences per step.

    Returns:
        (inputs for the model, loss_fn of its output).
    """
    import torch

    for name, value in (("seq", seq), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelSpecError(f"{name} must be a positive integer, got {value!r}")
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and seq > limit:
        field = "n_positions" if hasattr(config, "n_positions") else "max_position_embeddings"
        raise ModelSpecError(
            f"seq {seq} is longer than the config's {limit} positions (set {field} in --hf-config)"
        )
    ids = torch.zeros((batch, seq), dtype=torch.long)
    return {"input_ids": ids, "labels": ids}, (lambda out: out.loss)
