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


class InputValues:
    """The real values of what a fake step computes from its inputs alone, so that it reads a
    value where the real step reads one and takes the same branch.

    A model's own code branches on values its inputs decide (transformers' masks: skip the causal
    mask when the attention mask is all ones, find packed sequences in the positions) and gives
    up reading them from a fake tensor (``is_tracing``), taking the general branch a real step
    skips. Every op whose tensor arguments all have real values (the user's inputs, or tensors
    made from them and from constants) is also run on those values, off the dispatch stack, when
    its result is small (``limit`` elements); reading a scalar from a fake tensor that has a value
    (``aten._local_scalar_dense``) returns the real one. Parameters have no value, so nothing
    computed from the weights is ever run for real.
    """

    def __init__(self, limit: int = 1 << 22):
        self.limit = limit
        self._real: dict[int, tuple[Any, torch.Tensor]] = {}

    def add(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        import weakref

        self._real[id(fake)] = (weakref.ref(fake), real)

    def value_of(self, t: Any) -> torch.Tensor | None:
        entry = self._real.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        return entry[1]

    def has_value(self, t: Any) -> bool:
        return self.value_of(t) is not None

    def inputs(self, fakes, reals) -> None:
        """Pair the fake inputs with the user's real ones (a tensor, a tuple, list or dict)."""
        if isinstance(fakes, torch.Tensor) and isinstance(reals, torch.Tensor):
            # a copy: an in-place op the step runs on its input must not write the user's tensor
            self.add(fakes, reals.detach().to("cpu", copy=True))
        elif isinstance(fakes, (tuple, list)):
            for f, r in zip(fakes, reals, strict=False):
                self.inputs(f, r)
        elif isinstance(fakes, dict):
            for key, f in fakes.items():
                self.inputs(f, reals.get(key))

    def call(self, func, args, kwargs):
        """``func`` on the fakes, and on the real values where every tensor argument has one."""
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._python_dispatch import _disable_current_modes
        from torch.utils._pytree import tree_flatten, tree_map

        if func is torch.ops.aten._local_scalar_dense.default:
            real = self.value_of(args[0])
            if real is not None:
                with _disable_current_modes():
                    return real.item()
        out = func(*args, **kwargs)
        if torch.Tag.nondeterministic_seeded in func.tags:
            return out  # never draw from the user's generators for a value
        flat, _ = tree_flatten((args, kwargs))
        fakes = [t for t in flat if isinstance(t, FakeTensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not all(self.has_value(t) for t in fakes):
            for t in fakes:  # a value written by an op that cannot be run for real is stale
                if any(t is o for o in outs):
                    self._real.pop(id(t), None)
            return out
        if not outs or sum(t.numel() for t in outs) > self.limit:
            return out

        def real(x):
            if isinstance(x, FakeTensor):
                return self.value_of(x)
            return torch.device("cpu") if isinstance(x, torch.device) else x

        with _disable_current_modes(), torch.no_grad():
            real_args, real_kwargs = tree_map(real, (args, kwargs))
            try:
                real_out = func(*real_args, **real_kwargs)
            except Exception:  # what the CPU cannot run for real just has no value
                return out
        for f, r in zip(outs, tree_flatten(real_out)[0], strict=False):
            if isinstance(r, torch.Tensor) and isinstance(f, FakeTensor) and f.shape == r.shape:
                self.add(f, r)
        return out


@contextlib.contextmanager
def values_read(values: InputValues):
    """transformers' ``is_tracing(tensor)`` says a fake tensor with a real value is not traced,
    so the model reads the value as a real step does (module docstring of InputValues)."""
    import sys

    patched = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers") or module is None:
            continue
        original = getattr(module, "__dict__", {}).get("is_tracing")
        if not callable(original) or getattr(original, "__module__", "") != (
            "transformers.utils.import_utils"
        ):
            continue

        def is_tracing(tensor=None, _original=original):
            if tensor is not None and values.has_value(tensor):
                return _original(None)
            return _original(tensor)

        vars(module)["is_tracing"] = is_tracing
        patched.append((module, original))
    try:
        yield
    finally:
        for module, original in patched:
            vars(module)["is_tracing"] = original
