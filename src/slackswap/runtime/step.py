"""One training step under a plan: the object that owns a step's state. The saved-tensor hooks,
the tracers and the backward's node hooks call its methods; nothing else touches its fields.

A step is one of three kinds:
- ``traced``: the first of a context at new input shapes (and every step without the graph):
  each op is named by the profiler's tracer, the plan is checked against what the model saves,
  and what later steps are named by is recorded (runtime/checked_step.py);
- ``skimmed``: a later step with a dispatch mode that counts positions and records the recipes
  a plan that rebuilds needs (step_tracers.SkimTracer);
- ``hooked``: a later step of a plan that rebuilds nothing, run with no dispatch mode at all: it
  acts at its saves and at the nodes that unpack them, which are where the plan acts
  (formulations/step-model.md, "Hook positions"). Its own class owns it
  (runtime/hooked_step.py); this one owns the other two kinds.
"""

from __future__ import annotations

import contextlib
import heapq
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..core.errors import PlanError
from .checked_step import CheckedStep, Save, maker_of, next_node
from .host_copies import HostCopies
from .positions import RunLog
from .rebuild import View
from .rebuilds import Rebuilder
from .step_hooks import AtPosition
from .trace import LiveStorages, ModulePaths, Tracer, storage_key

if TYPE_CHECKING:
    from ..core.graph import ActivationGraph
    from ..core.plan import Plan
    from .lanes import CpuLanes, CudaLanes
    from .pool import HostPool
    from .positions import PlanPositions
    from .stats import RunStats

TRACED, SKIMMED, HOOKED = "traced", "skimmed", "hooked"
_NO_MODE = contextlib.nullcontext()


def modified_in_place(name: str) -> RuntimeError:
    """The error for a saved tensor written in place between its save and its backward use."""
    return RuntimeError(
        f"tensor {name!r} saved for backward was modified in place after it was saved; "
        "gradients would be wrong (use an out-of-place op)"
    )


def held_as_saved(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What a pack hook leaves for a save the plan does not act on: the tensor and its version.
    With saved-tensor hooks on, autograd no longer checks a saved tensor's version at its use
    (it does without them), so ``unchanged_since_saved`` does, as plain training would."""
    return (t, t._version)


def unchanged_since_saved(held: tuple[torch.Tensor, int]) -> torch.Tensor:
    """The tensor of ``held_as_saved``, refused when it was written in place since its save."""
    t = held[0]
    if t._version != held[1]:
        raise RuntimeError(
            f"a tensor saved for backward ({tuple(t.shape)}, {t.dtype}) was modified in place "
            f"after it was saved (version {held[1]} when saved, {t._version} at its use); "
            "gradients would be wrong, and plain training refuses it too (use an out-of-place "
            "op)"
        )
    return t


def outside_modes() -> Any:
    """The executor's own work (copies, rebuilds) runs outside any dispatch mode: the tracer's
    is for the model's ops. A step with no mode (hooked) pays nothing for it."""
    if torch._C._len_torch_dispatch_stack():
        return _disable_current_modes()
    return _NO_MODE


@dataclass(frozen=True)
class StepContext:
    """What every step of a context shares: the plan, its graph and positions, the copy lanes,
    the host pool, the device, the storages the context tracks, and the entry's statistics."""

    plan: Plan
    graph: ActivationGraph | None
    positions: PlanPositions | None
    lanes: CpuLanes | CudaLanes
    pool: HostPool
    device: torch.device
    device_index: int  # -1 on the CPU
    live: LiveStorages
    stats: RunStats
    prefetch_ahead: int
    recipe_ops: frozenset[int] | None  # ops whose recipes a rebuild may run (None: all)
    planned_bytes: dict[str, int]
    smaller_inputs: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


class Handle:
    """What a packed tensor leaves in autograd's graph: its name and decision, how it views its
    storage, its version when saved, and what holds it (the tensor, or a weak reference)."""

    __slots__ = ("name", "kind", "view", "version", "step", "tensor", "ref", "node_op")

    def __init__(self, name: str, kind: str, t: torch.Tensor, step: Step, node_op: int | None):
        self.name = name
        self.kind = kind
        self.view = View.of(t) if kind != "keep" else None  # (a kept one is held as it is)
        self.version = t._version
        self.step = step
        self.tensor: torch.Tensor | None = t if kind == "keep" else None
        self.ref: Any = None if kind == "keep" else weakref.ref(t)
        self.node_op = node_op


class ReleaseAfter:
    """A backward node's post-hook: the storages its unpacks released (kept for a rebuild within
    the node) are let go once it has run."""

    def __init__(self, step: Step):
        self.step = weakref.ref(step)

    def __call__(self, grad_inputs: Any, grad_outputs: Any) -> None:
        step = self.step()
        if step is not None:
            step.node_done()


class Step:
    """One step's state (module docstring): what it packed and how, where it is, what it did."""

    def __init__(
        self,
        ctx: StepContext,
        kind: str,
        checked: CheckedStep | None = None,
        paths: ModulePaths | None = None,
    ):
        self.ctx = ctx
        self.kind = kind
        self.checked = checked  # what a skimmed step is named by
        self.paths = paths
        self.tracer: Tracer | None = None
        self.base = next_node()  # the sequence number of the step's first autograd node
        self.handles_left: dict[str, int] = defaultdict(int)
        self.host = HostCopies(ctx)
        self.device_copy: dict[str, torch.UntypedStorage] = {}
        self.dirty: set[str] = set()
        self.packed: set[str] = set()
        self.kept: dict[str, torch.UntypedStorage] = {}
        # storages released by their last reader, held until the backward node that read them
        # is done: a rebuild in that node may read them too (a tensor lives through its last
        # use's position)
        self.lingering: dict[str, torch.UntypedStorage] = {}
        self.node: Any = None  # the autograd node unpacking now
        self.verified: set[str] = set()
        # positions (runtime/positions.py): the op the forward runs next, the position the step
        # is at, swapped tensors held until their d2h_free (a heap by that position), prefetches
        # in flight
        self.next_op = 0
        self.position = -1
        self.holding: dict[str, torch.Tensor] = {}
        self.release_heap: list[tuple[int, str]] = []
        self.seq_to_op: dict[int, int] = {}
        self.pending_hooks: list[tuple[int, list[Any]]] = []
        self.issue_cursor = 0
        self.event_cursor = 0  # the plan's event positions (PlanPositions.event_starts) passed
        self.pack_index = 0
        # in a traced step of a context that names later steps: every save, and the recipes'
        # skeletons (op -> Skeleton)
        self.saves: list[Save] | None = None
        self.skeletons: dict[int, Any] | None = None
        self.active = False
        self.checked_plan = False
        self.finished = False  # the model's forward returned (it did not raise)
        self.log = RunLog()
        self.rebuilder = Rebuilder(self)

    # ------------------------------------------------------------ where the step is
    def begin_op(self) -> int:
        """A forward op is about to run (a tracer's dispatch): the step moves to its position and
        does what the plan does before it; returns the position."""
        op = self.next_op
        self.next_op = op + 1
        self.position = op
        positions = self.ctx.positions
        if positions is not None:
            if self.release_heap:
                self.release_due(op - 1)
            if self.pending_hooks:
                self.hook_nodes()
            if (
                self.issue_cursor < len(positions.issue_order)
                and positions.issue_order[self.issue_cursor] <= op
            ):
                self.issue_due(op)
            self.seq_to_op.setdefault(next_node() - 1, op)
        return op

    def release_due(self, after: int) -> None:
        """Hand back the device memory of every swapped tensor whose d2h_free is at or before
        position ``after``, once its offload is done (the compute stream waits on it)."""
        heap = self.release_heap
        while heap and heap[0][0] <= after:
            _, name = heapq.heappop(heap)
            if self.holding.pop(name, None) is not None:
                self.host.release_source(name)
                self.log.add("release", name, after)

    def hook_nodes(self) -> None:
        """The backward nodes of the ops whose positions have events: a pre-hook there moves
        the step to that position (the node exists once the op's autograd wrapper returns)."""
        positions = self.ctx.positions
        assert positions is not None
        for op, refs in self.pending_hooks:
            for ref in refs:
                t = ref()
                node = None if t is None else t.grad_fn
                if node is not None:
                    node.register_prehook(AtPosition(self, positions.backward_position(op)))
                    break
        self.pending_hooks.clear()

    def issue_due(self, q: int) -> None:
        """Issue the prefetches the plan issues at or before position ``q`` (in forward or
        backward) and that are not yet issued."""
        positions = self.ctx.positions
        assert positions is not None
        order = positions.issue_order
        while self.issue_cursor < len(order) and order[self.issue_cursor] <= q:
            for name in positions.issue_at[order[self.issue_cursor]]:
                if (
                    name in self.host
                    and name not in self.device_copy
                    and self.handles_left.get(name, 0) > 0
                ):
                    self.device_copy[name] = self.bring_back(name)
            self.issue_cursor += 1

    def at_backward(self, q: int) -> None:
        """The backward pass reached position ``q``: release, prefetch and rebuild what the plan
        does at or before it and has not yet done."""
        if q <= self.position:
            return
        self.position = q
        positions = self.ctx.positions
        assert positions is not None
        starts, k = positions.event_starts, self.event_cursor
        if k >= len(starts) or starts[k] > q:
            return  # nothing the plan does is due
        while k < len(starts) and starts[k] <= q:
            k += 1
        self.event_cursor = k
        if self.release_heap:
            self.release_due(q - 1)
        with outside_modes():
            self.issue_due(q)
            # a rebuild runs at its position when the backward reaches it; where that node does
            # not run (its output is off the loss's path), at the tensor's first use if any
            for name in positions.rebuild_at.get(q, ()):
                if (
                    name in self.packed
                    and name not in self.device_copy
                    and self.handles_left.get(name, 0) > 0
                ):
                    self.materialize(name)

    def end_forward(self, backward: bool) -> None:
        """The forward is over (``backward``: the backward is being called, the start of
        position n): what the plan frees by the forward's end goes, what it prefetches at the
        backward's start is issued."""
        positions = self.ctx.positions
        if positions is not None:
            n = positions.n_ops
            if self.release_heap:
                self.release_due(min(self.next_op - 1, n - 1))
            if self.pending_hooks:
                self.hook_nodes()
            if backward and self.finished:
                self.at_backward(n)

    # ------------------------------------------------------------ saves
    def pack(self, t: torch.Tensor) -> Any:
        """A tensor autograd saves: named as the step's kind names it, then kept, offloaded or
        dropped as the plan says; returns what autograd holds (a Handle, or for a tensor the
        graph does not name, ``held_as_saved``)."""
        k = self.pack_index
        self.pack_index = k + 1
        node_op = None
        if self.kind == SKIMMED:
            assert self.checked is not None and self.paths is not None
            save = self.checked.save_at(k, self.position, self.paths.current, t, self.base)
            name, node_op = save.name, save.node_op
        else:
            assert self.tracer is not None
            name = self.tracer.tensor_name(t)
            if self.saves is not None:
                assert self.paths is not None
                self.saves.append(
                    Save(
                        self.position,
                        name,
                        self.paths.current,
                        next_node() - 1 - self.base,
                        maker_of(t, self.base),
                        int(t.untyped_storage().nbytes()),
                    )
                )
        if name is None:
            return held_as_saved(t)
        return self.save(name, t, node_op)

    def save(self, name: str, t: torch.Tensor, node_op: int | None) -> Handle:
        """Save graph tensor ``name`` as the plan decides."""
        ctx = self.ctx
        decision = ctx.plan.decisions.get(name)
        if decision is None:
            raise PlanError(
                f"tensor {name!r} (shape {tuple(t.shape)}, {t.dtype}) is saved by this "
                f"model but is not in plan for graph {ctx.plan.graph_name!r}: the plan "
                "was made for another model or input shape"
            )
        if name not in self.verified:
            self.check_tensor(name, t)
            self.verified.add(name)
        self.packed.add(name)
        self.handles_left[name] += 1
        handle = Handle(name, decision, t, self, node_op)
        if decision == "keep":
            self.kept[name] = t.untyped_storage()
        elif decision == "swap" and name not in self.host:
            # the copy is the executor's, not the model's: keep it out of the trace
            with outside_modes():
                self.host.offload(name, t, self.position, self.log)
            positions = ctx.positions
            if positions is not None and name in positions.release_after:
                # the device memory goes back where the plan frees it (d2h_free), after the
                # offload: held until then
                self.holding[name] = t
                heapq.heappush(self.release_heap, (positions.release_after[name], name))
        return handle

    def check_tensor(self, name: str, t: torch.Tensor) -> None:
        """The tensor the model saves is the one the plan was made for: same dtype and bytes
        (and shape, where the graph recorded it). Names alone coincide across widths and batch
        sizes of one architecture."""
        ctx = self.ctx
        nbytes = t.untyped_storage().nbytes()
        graph = ctx.graph
        shape = None
        if graph is not None and name in graph.tensor_index:
            rec = graph.tensors[graph.tensor_index[name]]
            dtype = rec.extra.get("dtype")
            if dtype is not None and dtype != str(t.dtype).replace("torch.", ""):
                raise PlanError(f"tensor {name!r} is {t.dtype} here but {dtype} in the graph")
            planned: int | None = int(rec.bytes)
            shape = rec.extra.get("shape")
        else:
            planned = ctx.planned_bytes.get(name)
        if (
            planned is not None
            and planned != nbytes
            and not (ctx.smaller_inputs and nbytes <= planned)
        ):
            seen = f"shape {tuple(t.shape)}, {nbytes} bytes"
            was = f"{planned} bytes" + (f", shape {tuple(shape)}" if shape is not None else "")
            raise PlanError(
                f"tensor {name!r} is {seen} here but the plan was made for {was}: "
                "the plan is for another input shape or model size; profile and plan "
                "this one"
            )

    def unpack(self, handle: Handle) -> torch.Tensor:
        """A saved tensor's backward use: its storage as the plan brings it back, checked
        unchanged since it was saved."""
        name = handle.name
        if not self.checked_plan:
            self.checked_plan = True
        node = torch._C._current_autograd_node()
        positions = self.ctx.positions
        if node is not self.node:
            self.node = node
            self.lingering.clear()
            if node is not None:
                # what this node read last goes when it is done, not at the next node that
                # reads a planned tensor (nodes between would hold it past its position)
                node.register_hook(ReleaseAfter(self))
                if positions is not None:
                    op = self.seq_to_op.get(node._sequence_nr())
                    if op is not None:
                        self.at_backward(positions.backward_position(op))
        ref = handle.ref() if handle.ref is not None else None
        if (
            name in self.dirty
            or (ref is not None and ref._version != handle.version)
            or (handle.tensor is not None and handle.tensor._version != handle.version)
        ):
            raise modified_in_place(name)
        if handle.tensor is not None:
            out = handle.tensor
        else:
            storage = self.materialize(name)
            assert handle.view is not None
            out = handle.view.on(storage, self.ctx.device)
            self.track(out)
        self.handles_left[name] -= 1
        if self.handles_left[name] <= 0:
            for table in (self.device_copy, self.kept):
                left = table.pop(name, None)
                if left is not None:
                    self.lingering[name] = left
        if positions is None:
            self.prefetch_ahead_of(name)
        return out

    def node_done(self) -> None:
        self.lingering.clear()

    def track(self, t: torch.Tensor, key: Any = None, nbytes: int | None = None) -> None:
        """Count a device storage as resident while any tensor object we know of uses it."""
        ctx = self.ctx
        if t.get_device() != ctx.device_index:
            return
        if nbytes is None:
            nbytes = t.untyped_storage().nbytes()
        ctx.live.add(t, key or storage_key(t), nbytes)
        ctx.stats.peak_activation_bytes = max(ctx.stats.peak_activation_bytes, ctx.live.peak)

    # ------------------------------------------------------------ swaps
    def prefetch_ahead_of(self, name: str) -> None:
        """Without the graph (no positions): the next ``prefetch_ahead`` swapped tensors in
        reverse order of offload are issued once ``name`` is read."""
        for nxt in self.host.ahead_of(name, self.ctx.prefetch_ahead):
            if nxt not in self.device_copy and self.handles_left.get(nxt, 0) > 0:
                self.device_copy[nxt] = self.bring_back(nxt)

    def bring_back(self, name: str) -> torch.UntypedStorage:
        """Issue the tensor's prefetch on the H2D lane (its first use waits for it)."""
        return self.host.prefetch(name, self.position, self.log)

    def first_use(self, name: str) -> None:
        """A prefetched tensor is read: compute waits for its copy here, and only here."""
        self.host.wait(name, self.position, self.log)

    def materialize(self, name: str) -> torch.UntypedStorage:
        """A saved tensor's storage on the device: a fetched copy or a rebuilt one, shared by
        all its readers until the last has run."""
        cached = self.device_copy.get(name)
        if cached is not None:
            self.first_use(name)
            return cached
        if self.ctx.plan.decisions.get(name) == "swap" and name in self.host:
            storage = self.bring_back(name)
            self.device_copy[name] = storage
            self.first_use(name)
            return storage
        self.log.add("rebuild", name, self.position)
        storage = self.rebuilder.rebuild(name)
        self.device_copy[name] = storage
        return storage

    def resident(self, name: str) -> torch.UntypedStorage | None:
        """The storage of a saved tensor on the device now (a fetched or rebuilt copy, a kept
        one, or one its last reader released within this node), or None."""
        found = self.device_copy.get(name)
        if found is None:
            found = self.kept.get(name)
        if found is None:
            found = self.lingering.get(name)
        return found

    def brought_back(self, name: str) -> bool:
        """Whether the plan brings ``name`` back (swapped or recomputed and saved here)."""
        return name in self.packed and self.ctx.plan.decisions.get(name) != "keep"
