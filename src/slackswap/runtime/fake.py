"""One training step under torch's FakeTensorMode: shapes, dtypes and autograd without memory.

``profile(fake=True)`` traces the step with the same tracer and the same graph builder as a real
profile, so ops, tensor names, bytes, ``saved_for``, ``alive_until``, workspaces and RNG groups
are the ones a real step of the same model on that device gives; only the times differ (the
cost model's, runtime/costmodel.py). The model may be real or built on the ``meta`` device
(``with torch.device("meta"): model = LlamaForCausalLM(config)``): its parameters and buffers are
swapped for fake tensors for the step and put back after it, so the user's model comes out as it
went in.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def _fake_of(mode, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor of ``t``'s shape, dtype and strides on ``device`` (meta tensors carry no
    data; real ones are not copied)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if t.is_meta:
        return FakeTensor(mode, t, device)
    with torch.no_grad():
        return FakeTensor(mode, t.to("meta"), device)


@contextlib.contextmanager
def fake_model(model: torch.nn.Module, mode, device: torch.device):
    """The model with fake parameters and buffers for the block; its own are put back after."""
    swapped: list[tuple[Any, str, str, Any]] = []
    fakes: dict[int, Any] = {}  # tied weights stay tied
    try:
        for module in model.modules():
            for table_name in ("_parameters", "_buffers"):
                table = getattr(module, table_name)
                for key, value in list(table.items()):
                    if value is None:
                        continue
                    fake = fakes.get(id(value))
                    if fake is None:
                        fake = _fake_of(mode, value.detach(), device)
                        if table_name == "_parameters":
                            fake = torch.nn.Parameter(fake, requires_grad=value.requires_grad)
                        fakes[id(value)] = fake
                    swapped.append((table, key, table_name, value))
                    table[key] = fake
        yield model
    finally:
        for table, key, _, value in reversed(swapped):
            table[key] = value


def fake_inputs(inputs, mode, device: torch.device):
    """The inputs as fake tensors on ``device`` (a tensor, a tuple or a dict of them)."""
    if isinstance(inputs, torch.Tensor):
        return _fake_of(mode, inputs, device)
    if isinstance(inputs, tuple):
        return tuple(fake_inputs(x, mode, device) for x in inputs)
    if isinstance(inputs, list):
        return [fake_inputs(x, mode, device) for x in inputs]
    if isinstance(inputs, dict):
        return {k: fake_inputs(v, mode, device) for k, v in inputs.items()}
    return inputs


def fake_device(model: torch.nn.Module, inputs, device) -> torch.device:
    """The device the step is faked on: ``device`` if given, else the model's (a ``meta``
    model's step is faked on the CPU, whose kernels this machine has)."""
    if device is not None:
        return torch.device(device)
    here = next((p.device for p in model.parameters()), torch.device("cpu"))
    return torch.device("cpu") if here.type == "meta" else here


@contextlib.contextmanager
def fused_attention():
    """``scaled_dot_product_attention`` as a GPU runs it in training: one fused flash kernel,
    dropout included, saving its output and a log-sum-exp row (no s x s tensor). The CPU's own
    choice falls back to the unfused math (s x s scores and probabilities saved) when dropout is
    on, which a GPU step never does; faked for a GPU, the step takes the fused kernel (its CPU
    variant, whose saved tensors and FLOPs are the GPU kernel's). A call the fused kernel does
    not take (grouped-query heads left to the kernel) runs as it would."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def fused(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        if query.dim() != 4 or key.shape[-3] != query.shape[-3]:
            return original(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
        return out

    F.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
