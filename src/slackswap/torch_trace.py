"""Tracing a torch training step at aten-op granularity, with names that survive across steps.

Shared by the profiler (which builds an ActivationGraph from it) and the executor (which finds the
plan's tensors again in later steps). A tensor is named by the module that produced it and its
position among that module's outputs in the step ("encoder.layers.0.linear1#2"); views and
in-place results keep the name of their base storage. torch is imported here only.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

RANDOM_OPS = ("dropout", "bernoulli", "rand", "normal", "multinomial", "randperm", "uniform")


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


@dataclass
class OpRecord:
    name: str
    aten: str
    module: str
    inputs: list[str]
    outputs: list[str]
    seq: int
    forward_s: float
    random: bool
    inplace: bool
    writes: list[str] = field(default_factory=list)
    func: Any = None
    args: Any = None
    kwargs: Any = None


@dataclass
class TensorRecord:
    name: str
    bytes: int
    shape: tuple[int, ...]
    dtype: str
    producer: int


@dataclass
class StepTrace:
    ops: list[OpRecord] = field(default_factory=list)
    tensors: dict[str, TensorRecord] = field(default_factory=dict)
    saved: list[tuple[int, str]] = field(default_factory=list)  # (autograd sequence nr, tensor)
    backward_s: dict[int, float] = field(default_factory=dict)  # by autograd sequence nr


class ModulePaths:
    """Keeps the path of the module whose forward is running."""

    def __init__(self, model: torch.nn.Module):
        self.stack: list[str] = []
        self.handles = []
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._enter(name or "model")))
            self.handles.append(module.register_forward_hook(self._leave()))

    def _enter(self, name):
        def hook(module, args):
            self.stack.append(name)
        return hook

    def _leave(self):
        def hook(module, args, output):
            if self.stack:
                self.stack.pop()
        return hook

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else "step"

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class Tracer(TorchDispatchMode):
    """Records every aten op of a forward pass and which storages it reads and writes."""

    def __init__(self, model: torch.nn.Module, paths: ModulePaths, keep_calls: bool = False,
                 sync=None):
        super().__init__()
        self.paths = paths
        self.trace = StepTrace()
        self.keep_calls = keep_calls
        self.sync = sync
        self.external = {storage_key(p) for p in model.parameters()}
        self.external |= {storage_key(b) for b in model.buffers()}
        self.by_storage: dict[tuple[str, int], str] = {}
        self.counters: dict[str, int] = defaultdict(int)
        self.op_counters: dict[str, int] = defaultdict(int)

    def tensor_name(self, t: torch.Tensor) -> str | None:
        key = storage_key(t)
        if key in self.external:
            return None
        return self.by_storage.get(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._current_autograd_node() is not None:
            return func(*args, **kwargs)  # backward ops are not part of the forward trace
        flat_in, _ = tree_flatten((args, kwargs))
        in_tensors = [a for a in flat_in if isinstance(a, torch.Tensor)]
        in_keys = {storage_key(t) for t in in_tensors}
        inputs = []
        for t in in_tensors:
            name = self.tensor_name(t)
            if name is not None and name not in inputs:
                inputs.append(name)
        seq = torch._C._autograd._get_sequence_nr() - 1
        if self.sync:
            self.sync()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if self.sync:
            self.sync()
        elapsed = time.perf_counter() - start
        aten = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        module = self.paths.current
        outputs = []
        writes = []
        inplace = aten.endswith("_") or "out" in kwargs
        flat_out, _ = tree_flatten(out)
        for t in flat_out:
            if not isinstance(t, torch.Tensor):
                continue
            key = storage_key(t)
            if key in in_keys:
                # a view or an in-place result: same storage, same tensor
                if inplace and self.by_storage.get(key) is not None:
                    writes.append(self.by_storage[key])
                continue
            name = f"{module}#{self.counters[module]}"
            self.counters[module] += 1
            self.by_storage[key] = name
            self.trace.tensors[name] = TensorRecord(
                name=name, bytes=int(t.untyped_storage().nbytes()), shape=tuple(t.shape),
                dtype=str(t.dtype).replace("torch.", ""), producer=len(self.trace.ops))
            outputs.append(name)
        op_name = f"{module}/{aten}#{self.op_counters[module]}"
        self.op_counters[module] += 1
        self.trace.ops.append(OpRecord(
            name=op_name, aten=str(func), module=module, inputs=inputs, outputs=outputs, seq=seq,
            forward_s=elapsed, random=any(r in aten for r in RANDOM_OPS), inplace=inplace,
            writes=writes,
            func=func if self.keep_calls else None,
            args=args if self.keep_calls else None, kwargs=kwargs if self.keep_calls else None))
        return out


def time_backward(loss: torch.Tensor, trace: StepTrace, sync=None) -> None:
    """Backward time of every autograd node, by its sequence number (pre- and post-hooks)."""
    seen = set()
    stack = [loss.grad_fn]
    handles = []
    starts: dict[int, float] = {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        seq = node._sequence_nr()

        def pre(grad_outputs, seq=seq):
            if sync:
                sync()
            starts[seq] = time.perf_counter()

        def post(grad_inputs, grad_outputs, seq=seq):
            if sync:
                sync()
            if seq in starts:
                trace.backward_s[seq] = trace.backward_s.get(seq, 0.0) + time.perf_counter() - starts[seq]

        handles.append(node.register_prehook(pre))
        handles.append(node.register_hook(post))
        stack.extend(n for n, _ in node.next_functions)
    try:
        loss.backward()
    finally:
        for h in handles:
            h.remove()
