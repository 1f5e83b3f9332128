"""The executor's saved-tensor hooks (a part of its Run): each tensor autograd saves is named
as the profiler named it and packed as the plan says (kept, offloaded to host memory, or
dropped to be rebuilt), and unpacked for its backward use, checked unchanged."""

from __future__ import annotations

import heapq
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..core.errors import PlanError
from .rebuild import View

if TYPE_CHECKING:
    from .executor import _Step


@dataclass
class Handle:
    """What a packed tensor leaves in autograd's graph: its name and decision, how it views its
    storage, its version when saved, and what holds it (the tensor, or a weak reference)."""

    name: str
    kind: str
    view: View
    version: int
    step: Any = None
    tensor: torch.Tensor | None = None
    ref: Any = None


class ReleaseAfter:
    """A backward node's post-hook: the storages its unpacks released (``lingering``, kept for
    a rebuild within the node) are let go once it has run."""

    def __init__(self, step: _Step):
        self.step = weakref.ref(step)

    def __call__(self, grad_inputs, grad_outputs) -> None:
        step = self.step()
        if step is not None:
            step.lingering.clear()


class SavedTensorHooks:
    """pack and unpack of torch.autograd.graph.saved_tensors_hooks, as the plan says."""

    def _pack(self, t: torch.Tensor):
        step = self._step
        if step is None or step.tracer is None:
            return t
        if step.skim:
            name = self._skimmed_name(step)
        else:
            name = step.tracer.tensor_name(t)
            if step.pack_log is not None:
                step.pack_log.append((step.position, name, self._paths.current))
        if name is None:
            return t
        decision = self.plan.decisions.get(name)
        if decision is None:
            raise PlanError(
                f"tensor {name!r} (shape {tuple(t.shape)}, {t.dtype}) is saved by this "
                f"model but is not in plan for graph {self.plan.graph_name!r}: the plan "
                "was made for another model or input shape"
            )
        if name not in step.verified:
            self._check_tensor(name, t)
            step.verified.add(name)
        step.packed.add(name)
        step.seen.add(name)
        step.handles_left[name] += 1
        handle = Handle(name, decision, View.of(t), t._version, step)
        if decision == "keep":
            handle.tensor = t
            step.kept[name] = t.untyped_storage()
        elif decision == "swap":
            handle.ref = weakref.ref(t)
            if name not in step.host:
                step.swap_order.append(name)
                # the copy is the executor's, not the model's: keep it out of the trace
                with _disable_current_modes():
                    self._offload(step, name, t)
                positions = self._positions
                if positions is not None and name in positions.release_after:
                    # the device memory goes back where the plan frees it (d2h_free), after the
                    # offload: held until then
                    step.holding[name] = t
                    heapq.heappush(step.release_heap, (positions.release_after[name], name))
        else:
            handle.ref = weakref.ref(t)
        return handle

    def _skimmed_name(self, step: _Step) -> str | None:
        """The name of the k-th tensor saved in a skimmed step: the k-th of the checked step,
        saved at the same op (an op sequence that left the checked one is refused by name)."""
        k = step.pack_index
        step.pack_index = k + 1
        order = self._pack_order
        if k >= len(order) or order[k][0] != step.position or order[k][2] != self._paths.current:
            where = f"op {step.position} of module {self._paths.current!r}"
            raise PlanError(
                f"apply: save {k} of this step comes at {where}, where the checked step of the "
                f"same input shapes saved "
                + (
                    f"at op {order[k][0]} of module {order[k][2]!r}"
                    if k < len(order)
                    else "no more tensors"
                )
                + ": the model's forward depends on its data; run it under ss.planned (which "
                "profiles such steps again) or without a plan"
            )
        return order[k][1]

    def _check_tensor(self, name: str, t: torch.Tensor) -> None:
        """The tensor the model saves is the one the plan was made for: same dtype and bytes
        (and shape, where the graph recorded it). Names alone coincide across widths and batch
        sizes of one architecture."""
        nbytes = t.untyped_storage().nbytes()
        graph = self.graph
        if graph is not None and name in graph.tensor_index:
            rec = graph.tensors[graph.tensor_index[name]]
            dtype = rec.extra.get("dtype")
            if dtype is not None and dtype != str(t.dtype).replace("torch.", ""):
                raise PlanError(f"tensor {name!r} is {t.dtype} here but {dtype} in the graph")
            planned = int(rec.bytes)
            shape = rec.extra.get("shape")
        else:
            planned = self._planned_bytes.get(name)
            shape = None
        if (
            planned is not None
            and planned != nbytes
            and not (self._smaller_inputs and nbytes <= planned)
        ):
            seen = f"shape {tuple(t.shape)}, {nbytes} bytes"
            was = f"{planned} bytes" + (f", shape {tuple(shape)}" if shape is not None else "")
            raise PlanError(
                f"tensor {name!r} is {seen} here but the plan was made for {was}: "
                "the plan is for another input shape or model size; profile and plan "
                "this one"
            )

    def _unpack(self, handle):
        if not isinstance(handle, Handle):
            return handle
        step = handle.step
        name = handle.name
        if not step.checked:
            step.checked = True
            self._check_plan(step)
        node = torch._C._current_autograd_node()
        if node is not step.node:
            step.node = node
            step.lingering.clear()
            if node is not None:
                # what this node read last goes when it is done, not at the next node that
                # reads a planned tensor (nodes between would hold it past its position)
                node.register_hook(ReleaseAfter(step))
            if self._positions is not None and node is not None:
                op = step.seq_to_op.get(node._sequence_nr())
                if op is not None:
                    self._at_backward(step, self._positions.backward_position(op))
        if (
            name in step.dirty
            or (
                handle.ref is not None
                and handle.ref() is not None
                and handle.ref()._version != handle.version
            )
            or (handle.tensor is not None and handle.tensor._version != handle.version)
        ):
            raise RuntimeError(
                f"tensor {name!r} saved for backward was modified in place after it "
                "was saved; gradients would be wrong (use an out-of-place op)"
            )
        if handle.kind == "keep":
            out = handle.tensor
        else:
            storage = self._materialize(step, name)
            out = handle.view.on(storage, self.device)
            self._track(out)
        step.handles_left[name] -= 1
        if step.handles_left[name] <= 0:
            for table in (step.device_copy, step.kept):
                storage = table.pop(name, None)
                if storage is not None:
                    step.lingering[name] = storage
        self._prefetch(step, name)
        return out
