"""A later step of a plan that rebuilds nothing, run with hooks alone (formulations/step-model.md,
"Hook positions"): no dispatch mode, only the saved-tensor hooks, the model's forward hook and
the backward call's wrapper.

Everything such a step does is known once its checked step is: which save is which tensor, where
each swapped tensor leaves the device, where each prefetch is issued. ``HookedProgram`` lays that
out once per checked step and plan as flat tables, so that a save the plan does not act on costs
a counter and a comparison, and a save or unpack it acts on a few lookups; ``HookedStep`` owns
the state of one step and runs it. It is a ``Step``'s equal for the context (``Run``): the same
``kind``, ``active``, ``finished``, ``log`` and ``end_forward``.
"""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..core.errors import PlanError
from .checked_step import next_node
from .host_copies import HostCopies
from .positions import RunLog
from .step import HOOKED, StepContext, modified_in_place, unchanged_since_saved

if TYPE_CHECKING:
    from .checked_step import CheckedStep
    from .positions import PlanPositions

_sequence_nr = torch._C._autograd._get_sequence_nr
_NEVER = 1 << 62  # a position no step reaches


@dataclass(frozen=True)
class HookedProgram:
    """A checked step and a plan, as a step of hooks alone reads them per save and per unpack.

    ``entries[k]`` is save k: its position (an int) when the plan does not act on it, else
    (position, name, node offset, maker, decision, d2h_free or None, node op). ``issues``: the
    prefetch positions in order, each with the tensors issued there.

    What ``HookedStep.pack`` leaves in autograd's graph for a save it acts on is a plain tuple
    (the cheapest object to make, and one autograd never saves itself): (step, name, node op,
    version when saved, the tensor) for a kept tensor, (step, name, node op, version, None,
    a weak reference, (dtype, storage offset, size, stride)) for a moved one; for any other
    save, (the tensor, its version when saved) (``step.held_as_saved``: with hooks on, autograd
    checks no saved tensor's version, so the unpack does)."""

    checked: CheckedStep
    entries: tuple[Any, ...]
    issues: tuple[tuple[int, tuple[str, ...]], ...]
    n_ops: int
    swap_bytes: dict[str, int]  # the storage bytes of each swapped tensor, as checked
    kit_key: tuple[tuple[str, int], ...] = ()  # swap_bytes' items (HostPool.take_kit)

    @classmethod
    def of(
        cls, checked: CheckedStep, decisions: Mapping[str, str], positions: PlanPositions
    ) -> HookedProgram:
        entries: list[Any] = []
        swap_bytes: dict[str, int] = {}
        for s in checked.saves:
            if not s.handled or s.name is None:
                entries.append(s.position)
                continue
            decision = decisions[s.name]
            free = positions.release_after.get(s.name) if decision == "swap" else None
            if decision == "swap":
                swap_bytes.setdefault(s.name, s.nbytes)
            entries.append((s.position, s.name, s.node_offset, s.maker, decision, free, s.node_op))
        issues = tuple((q, positions.issue_at[q]) for q in positions.issue_order)
        return cls(
            checked, tuple(entries), issues, positions.n_ops, swap_bytes, tuple(swap_bytes.items())
        )


class HookedStep:
    """One step of hooks alone (module docstring). Its state: the saves packed so far, the
    position it is at, the swapped tensors held until their d2h_free (a heap by that position),
    the prefetches issued, the handles each tensor has left, its host copies and its log."""

    kind = HOOKED

    def __init__(self, ctx: StepContext, program: HookedProgram):
        self.ctx = ctx
        self.program = program
        self.entries = program.entries
        self.n_entries = len(program.entries)
        self.last = 2 * program.n_ops - 1  # the backward of op i is at last - i
        self.base = next_node()  # the sequence number of the step's first autograd node
        self.pack_index = 0
        self.position = -1
        self.handles_left: dict[str, int] = {}
        self.host = HostCopies(ctx)
        self.host.borrow_ahead(program.kit_key, program.swap_bytes)
        self.device_copy: dict[str, torch.UntypedStorage] = {}
        self.holding: dict[str, torch.Tensor] = {}
        self.release_heap: list[tuple[int, str]] = []
        self.issue_cursor = 0
        issues = program.issues
        self.next_issue = issues[0][0] if issues else _NEVER
        # the first position at whose start something is due (a release or a prefetch): the
        # step acts on reaching a position at or after it
        self.next_due = self.next_issue
        self.empties: dict[torch.dtype, torch.Tensor] = {}  # (what an unpacked view is made from)
        self.log = RunLog()
        self.active = False
        self.finished = False  # the model's forward returned (it did not raise)

    # ------------------------------------------------------------ forward
    def pack(self, t: torch.Tensor) -> Any:
        """A tensor autograd saves: the checked step's k-th save. One the plan acts on is
        checked to be the same save (same saving node, same maker: ``CheckedStep.save_hooked``
        names what differs) and wrapped; any other is held as it is, with its version."""
        k = self.pack_index
        self.pack_index = k + 1
        if k >= self.n_entries:
            return (t, t._version)  # (more saves than the checked step made: none acted on)
        entry = self.entries[k]
        if entry.__class__ is int:
            if entry + 1 >= self.next_due:
                self.reach(entry + 1)
            return (t, t._version)  # (held_as_saved, inlined: a call costs more than it)
        position, name, node_offset, maker, decision, free, node_op = entry
        base = self.base
        node = t.grad_fn
        if (
            _sequence_nr() - 1 - base != node_offset
            or (node is None) != (maker is None)
            or (node is not None and (node._sequence_nr() - base, t.output_nr) != maker)  # type: ignore[union-attr]
        ):
            self.program.checked.save_hooked(k, t, base)  # (raises, naming the save)
        self.position = position
        if decision == "keep":
            out: tuple[Any, ...] = (self, name, node_op, t._version, t)
        else:
            self.handles_left[name] = self.handles_left.get(name, 0) + 1
            out = (
                self,
                name,
                node_op,
                t._version,
                None,
                weakref.ref(t),
                (t.dtype, t.storage_offset(), t.shape, t.stride()),
            )
            if decision == "swap" and name not in self.host:
                self.host.offload(name, t, position, self.log)
                if free is not None:
                    self.holding[name] = t
                    heapq.heappush(self.release_heap, (free, name))
                    if free + 1 < self.next_due:
                        self.next_due = free + 1
        if position + 1 >= self.next_due:
            self.reach(position + 1)
        return out

    def reach(self, p: int) -> None:
        """The step is at the start of position ``p``: the swapped tensors whose d2h_free is
        before it leave the device (once their offload is done), and the prefetches issued at
        or before it that are not yet issued go out."""
        heap = self.release_heap
        if heap and heap[0][0] < p:
            holding, host, log = self.holding, self.host, self.log
            while heap and heap[0][0] < p:
                _, name = heapq.heappop(heap)
                if holding.pop(name, None) is not None:
                    host.release_source(name)
                    log.events.append(("release", name, p - 1))
        if self.next_issue <= p:
            issues, i = self.program.issues, self.issue_cursor
            host, device_copy, left = self.host, self.device_copy, self.handles_left
            while i < len(issues) and issues[i][0] <= p:
                for name in issues[i][1]:
                    if name in host and name not in device_copy and left.get(name, 0) > 0:
                        device_copy[name] = host.prefetch(name, p, self.log)
                i += 1
            self.issue_cursor = i
            self.next_issue = issues[i][0] if i < len(issues) else _NEVER
        self.next_due = min(heap[0][0] + 1, self.next_issue) if heap else self.next_issue

    def end_forward(self, backward: bool) -> None:
        """The forward is over (``backward``: the backward is being called, the start of
        position n): what the plan frees by the forward's end goes; at the backward's start,
        what it prefetches there is issued."""
        n = self.program.n_ops
        heap = self.release_heap
        if heap and heap[0][0] <= n - 1:
            issue, self.next_issue = self.next_issue, _NEVER  # (releases only)
            self.reach(n)
            self.next_issue = issue
            self.next_due = min(heap[0][0] + 1, issue) if heap else issue
        if backward and self.finished:
            self.at_backward(n)

    # ------------------------------------------------------------ backward
    def at_backward(self, q: int) -> None:
        """The backward reached position ``q``: what the plan does at or before it is done."""
        if q > self.position:
            self.position = q
            if q >= self.next_due:
                self.reach(q)

    def unpack(self, packed: Any) -> torch.Tensor:
        """The unpack hook (saved tensors keep the hooks they were packed under): what ``pack``
        wrapped comes back here by the node that saved it, whose position is its own; the step
        moves there, and a swapped tensor's prefetched copy is waited for (or, when none was
        issued, fetched now)."""
        if len(packed) == 2:
            return unchanged_since_saved(packed)  # (a save the plan does not act on)
        op = packed[2]
        if op is not None:
            q = self.last - op
            if q > self.position:
                self.position = q
                if q >= self.next_due:
                    self.reach(q)
        name = packed[1]
        tensor = packed[4]
        if tensor is not None:  # kept
            if tensor._version != packed[3]:
                raise modified_in_place(name)
            return tensor
        ref = packed[5]()
        if ref is not None and ref._version != packed[3]:
            raise modified_in_place(name)
        storage = self.device_copy.get(name)
        if storage is None:
            storage = self.fetch_now(name)
        else:
            self.host.wait(name, self.position, self.log)  # (the first use waits; others pass)
        dtype, offset, size, stride = packed[6]
        empty = self.empties.get(dtype)
        if empty is None:
            empty = self.empties[dtype] = torch.empty(0, dtype=dtype, device=self.ctx.device)
        tensor = empty.new().set_(storage, offset, size, stride)
        left = self.handles_left[name] - 1
        self.handles_left[name] = left
        if left <= 0:
            del self.device_copy[name]
        return tensor

    def fetch_now(self, name: str) -> torch.UntypedStorage:
        """A swapped tensor read before its prefetch was issued: fetched and waited for now."""
        if name not in self.host:
            raise PlanError(
                f"apply: tensor {name!r} is read in backward but this step neither kept nor "
                "offloaded it: the step departs from its checked step"
            )
        storage = self.host.prefetch(name, self.position, self.log)
        self.device_copy[name] = storage
        self.host.wait(name, self.position, self.log)
        return storage
