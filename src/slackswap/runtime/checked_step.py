"""What a context's checked step leaves to its later steps of the same input shapes: every save in
order (where the step was, which tensor, which autograd node saved it and which made it), the
recipes' skeletons, and whether later steps may run with hooks alone (formulations/step-model.md,
"Hook positions").

A later step names the k-th save by the checked step's k-th, after checking that it is the same
save: the node saving it has the same place in the step's sequence of autograd nodes, and the
tensor was made by the same node (same place, same output). A branch on the data that keeps
every op and shape but saves another tensor (``y = h * g`` with ``h`` one of two earlier tensors
chosen by the data) changes the maker, and is refused by name: never run on the wrong tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from ..core.errors import PlanError

if TYPE_CHECKING:
    from .positions import PlanPositions
    from .step_tracers import Skeleton

_DEPARTS = (
    "the model's forward depends on its data; run it under ss.planned (which profiles such "
    "steps again) or without a plan"
)


def next_node() -> int:
    """The sequence number the next autograd node made on this thread will take."""
    return int(torch._C._autograd._get_sequence_nr())


def maker_of(t: torch.Tensor, base: int) -> tuple[int, int] | None:
    """Which node of the step made ``t`` (its sequence number less the step's first) and which
    of that node's outputs it is; None for a tensor with no history (a parameter, a mask)."""
    node = t.grad_fn
    if node is None:
        return None
    return (int(node._sequence_nr()) - base, int(t.output_nr))


@dataclass(frozen=True)
class Save:
    """One save of the checked step."""

    position: int  # the position the step was at: the last op dispatched before the save
    name: str | None  # the graph tensor saved; None: a parameter, an input, a constant
    module: str  # the module path it ran under
    node_offset: int  # the saving node's sequence number, less the step's first
    maker: tuple[int, int] | None  # maker_of the tensor saved
    nbytes: int
    node_op: int | None = None  # the op whose autograd node saved it (its backward reads it)
    # a step of hooks alone wraps it (a plan's tensor that is moved, or whose unpack is where
    # the plan acts); else autograd holds it as it is
    handled: bool = True


@dataclass(frozen=True)
class CheckedStep:
    """The checked step of one input signature, as later steps are named by it."""

    signature: tuple
    saves: tuple[Save, ...]
    skeletons: dict[int, Skeleton] | None  # op -> its recipes' skeleton (a plan that rebuilds)
    hooked: bool  # later steps may run with hooks alone
    why_not_hooked: str = ""

    @cached_property
    def rows(self) -> tuple[tuple[Any, ...], ...]:
        """Each save as the plain tuple a hooked step reads per save: (position, name, node
        offset, maker, node op, handled)."""
        return tuple(
            (s.position, s.name, s.node_offset, s.maker, s.node_op, s.handled) for s in self.saves
        )

    def save_at(self, k: int, position: int, module: str, t: torch.Tensor, base: int) -> Save:
        """The k-th save of a skimmed step, which counts positions and module paths: the
        checked step's k-th, made at the same op of the same module, and the same save
        (``save_hooked``'s test; PlanError otherwise)."""
        saves = self.saves
        if k >= len(saves) or saves[k].position != position or saves[k].module != module:
            where = f"op {position} of module {module!r}"
            was = (
                f"at op {saves[k].position} of module {saves[k].module!r}"
                if k < len(saves)
                else "no more tensors"
            )
            raise PlanError(
                f"apply: save {k} of this step comes at {where}, where the checked step of the "
                f"same input shapes saved {was}: {_DEPARTS}"
            )
        return self.save_hooked(k, t, base)

    def save_hooked(self, k: int, t: torch.Tensor, base: int) -> Save:
        """The k-th save of a step run with hooks alone: the checked step's k-th, saved by the
        node at the same place of the step and made by the same node (PlanError otherwise)."""
        saves = self.saves
        if k >= len(saves):
            raise PlanError(
                f"apply: this step saves a tensor ({tuple(t.shape)}, {t.dtype}) after the "
                f"{len(saves)} the checked step of the same input shapes saved: {_DEPARTS}"
            )
        save = saves[k]
        node = next_node() - 1 - base
        if node != save.node_offset or maker_of(t, base) != save.maker:
            what = repr(save.name) if save.name is not None else "a parameter or input"
            raise PlanError(
                f"apply: save {k} of this step ({tuple(t.shape)}, {t.dtype}) is not the "
                f"tensor the checked step of the same input shapes saved there ({what}, at op "
                f"{save.position}): another tensor, or another op, took its place; {_DEPARTS}"
            )
        return save


def hook_coverage(saves: list[Save], positions: PlanPositions, n_ops: int) -> str:
    """Why a plan's positions are not all where a step of hooks alone acts ("" when they are):
    after a save (forward), where a node unpacks what it saved (backward), at either pass's
    start."""
    starts = {0, n_ops} | {s.position + 1 for s in saves}
    starts |= {2 * n_ops - 1 - s.node_op for s in saves if s.node_op is not None and s.name}
    needed: dict[int, str] = {}
    for name, free in positions.release_after.items():
        needed.setdefault(free + 1, f"the release of {name!r} after position {free}")
    for q, names in positions.issue_at.items():
        needed.setdefault(q, f"the prefetch of {names[0]!r} at position {q}")
    for q, names in positions.rebuild_at.items():
        needed.setdefault(q, f"the rebuild of {names[0]!r} at position {q}")
    for q in sorted(needed):
        if q < 2 * n_ops and q not in starts:
            return f"{needed[q]}: no hook runs there in this step"
    return ""


def event_starts(positions: PlanPositions) -> set[int]:
    """The positions at whose start the plan does something: a release (after the one before),
    a prefetch, a rebuild."""
    starts = {free + 1 for free in positions.release_after.values()}
    return starts | set(positions.issue_at) | set(positions.rebuild_at)


def mark_handled(
    saves: list[Save], decisions: Mapping[str, str], positions: PlanPositions, n_ops: int
) -> list[Save]:
    """Each save with whether a step of hooks alone wraps it (``Save.handled``)."""
    starts = event_starts(positions)

    def where(s: Save) -> int | None:
        return None if s.node_op is None else 2 * n_ops - 1 - s.node_op

    # the backward positions a moved tensor's unpack reaches anyway
    reached = {where(s) for s in saves if s.name is not None and decisions.get(s.name) != "keep"}
    out = []
    for s in saves:
        q = where(s)
        moved = s.name is not None and decisions.get(s.name) != "keep"
        # a kept tensor is wrapped only to reach a position where the plan acts that no moved
        # tensor's unpack reaches: the first such save of that node
        needed = s.name is not None and q is not None and q in starts and q not in reached
        if needed:
            reached.add(q)
        out.append(
            Save(
                s.position,
                s.name,
                s.module,
                s.node_offset,
                s.maker,
                s.nbytes,
                s.node_op,
                moved or needed,
            )
        )
    return out


def resolve_node_ops(saves: list[Save], seq_to_op: dict[int, int], base: int) -> list[Save]:
    """Each save with the op whose autograd node saved it (by the node's sequence number)."""
    out = []
    for s in saves:
        op = seq_to_op.get(s.node_offset + base)
        out.append(
            Save(s.position, s.name, s.module, s.node_offset, s.maker, s.nbytes, op)
            if op is not None
            else s
        )
    return out
