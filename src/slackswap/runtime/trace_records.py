"""What a traced step records: its ops (OpRecord), the tensors they made and autograd saved
(TensorRecord), both together (StepTrace); the GPU's clock (GpuClock); and the module path each
op runs under (ModulePaths).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


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
    mutates: bool = False  # writes into an argument: not to be run twice
    unit: str = ""  # the FSDP2 unit it runs in
    param_unit: str = ""  # the FSDP2 unit whose parameters it reads ("" none)
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
    # activation gradients alive while each autograd node runs (its incoming and outgoing ones
    # and those waiting for later nodes), by sequence nr, and the nodes' order of execution
    backward_grad_bytes: dict[int, int] = field(default_factory=dict)
    backward_order: list[int] = field(default_factory=list)
    # memory a node's backward formula allocates and frees before it returns (above what is
    # alive when it returns: BackwardTransients), by sequence nr
    backward_transient_bytes: dict[int, int] = field(default_factory=dict)
    # parameter gradients each autograd node sends to AccumulateGrad (bytes, by sequence nr)
    param_grad_bytes: dict[int, int] = field(default_factory=dict)
    # parameter gradients that earlier nodes made and that wait in their AccumulateGrad's buffer
    # while each node runs (a parameter read by several ops, as tied embeddings are: its
    # gradient is added to ``.grad`` only once every reader's backward has run), by sequence nr
    param_grad_waiting_bytes: dict[int, int] = field(default_factory=dict)
    # activation gradients alive when each node's backward begins (waiting for it and for later
    # nodes): what a rebuild triggered there holds beside its own tensors, by sequence nr
    backward_entry_grad_bytes: dict[int, int] = field(default_factory=dict)
    # index of the last op run while the model still held each storage (released in forward)
    released_after: dict[str, int] = field(default_factory=dict)
    # the ops after which a saved-tensor hook ran, before the next op (every save counted,
    # parameters' too): where an executor of hooks alone can act in forward (Op.hook_after)
    pack_after: set[int] = field(default_factory=set)


class GpuClock:
    """Op times on the GPU's own timeline, from CUDA events around each op: no host
    synchronisation per op, which adds launch and sync latency to every op (a profile of GPT-2
    medium on an H200 read a step 1.6x longer than it runs). Gaps between ops are left out: under
    the tracer the host is slower than in training and the stream idles waiting for it (counting
    those gaps read the step 2.8x longer)."""

    def __init__(self) -> None:
        self.events: list = []
        self.spans: list[tuple[int, int, Any, Any]] = []  # (start, end, record, key)
        self.mark()

    def mark(self) -> int:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)
        return len(self.events) - 1

    @property
    def last(self) -> int:
        return len(self.events) - 1

    def resolve(self, trace: StepTrace) -> None:
        """Wait for the step, then write every recorded span's seconds into the trace."""
        torch.cuda.synchronize()
        for start, end, record, key in self.spans:
            seconds = self.events[start].elapsed_time(self.events[end]) / 1e3
            if key is None:
                record.forward_s = seconds
            else:
                trace.backward_s[key] = trace.backward_s.get(key, 0.0) + seconds


class ModulePaths:
    """Keeps the path of the module whose forward is running, and whether a DDP wrapper is in
    its prelude (its own work before the module it wraps runs)."""

    def __init__(self, model: torch.nn.Module, hook_root: bool = True):
        self.stack: list[str] = []
        self._inner_ran: list[bool] = []  # per stack entry: a submodule's forward has begun
        self.handles = []
        self.ddp_paths = {
            name or "model"
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.parallel.DistributedDataParallel)
        }
        for name, module in model.named_modules():
            if not name and not hook_root:
                continue  # the caller enters and leaves the root (reset, leave_root)
            self.handles.append(module.register_forward_pre_hook(self._enter(name or "model")))
            # always_call: the path is popped even when the module's forward raises
            self.handles.append(module.register_forward_hook(self._leave(), always_call=True))

    def _enter(self, name):
        def hook(module, args):
            if self._inner_ran:
                self._inner_ran[-1] = True
            self.stack.append(name)
            self._inner_ran.append(False)

        return hook

    def _leave(self):
        def hook(module, args, output):
            if self.stack:
                self.stack.pop()
                self._inner_ran.pop()

        return hook

    def reset(self, name: str = "model") -> None:
        """A new step starts at the root: whatever an interrupted step left on the stack goes."""
        self.stack[:] = [name]
        self._inner_ran[:] = [False]

    def leave_root(self) -> None:
        """The root module's forward is over (its caller's hook): the loss runs outside it."""
        self.stack.clear()
        self._inner_ran.clear()

    @property
    def in_ddp_prelude(self) -> bool:
        """Whether a DistributedDataParallel wrapper runs its own work now, before the module it
        wraps: its buffer broadcast (flattened into a buffer that gloo's or NCCL's worker thread
        may hold a moment after the broadcast returns, so it dies at no fixed op) and its bucket
        rebuild. That is the wrapper's traffic on buffers and parameters, not the model's."""
        return (
            bool(self.ddp_paths)
            and bool(self.stack)
            and self.stack[-1] in self.ddp_paths
            and not self._inner_ran[-1]
        )

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else "step"

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
