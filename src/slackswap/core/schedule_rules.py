"""The rules a schedule's positions follow (formulations/step-model.md, "Decisions" and "Hook
positions"): a swapped tensor leaves after its last forward reader and is prefetched after it
has left, by its first use; every position is one where an executor that runs only saved-tensor
and autograd-node hooks can act. ``HookPositions`` gives the nearest of those to any position, as
the step model's default schedule and the exact planner's candidates take them."""

from __future__ import annotations

import numpy as np

from .errors import PlanError
from .graph import ActivationGraph
from .plan import RECOMPUTE, SWAP


def position_label(graph: ActivationGraph, position: int) -> str:
    """A position in words: the forward or backward of the op there."""
    n = graph.n_ops
    if position < n:
        return f"forward of op {graph.ops[position].name!r}"
    return f"backward of op {graph.ops[2 * n - 1 - position].name!r}"


class HookPositions:
    """Where a plan may act on a graph (formulations/step-model.md, "Hook positions"): the
    positions at whose start a hook runs (prefetches and rebuilds), and the positions after which
    one runs (frees), with the nearest of each in either direction. On an analytic graph every
    position is one and nothing moves."""

    def __init__(self, graph: ActivationGraph):
        self.everywhere = graph.hooked_everywhere
        self.starts = np.flatnonzero(graph.hook_positions).astype(np.int64)
        self.frees = self.starts[self.starts >= 1] - 1

    @staticmethod
    def _later(allowed: np.ndarray, x: np.ndarray) -> np.ndarray:
        i = np.searchsorted(allowed, x, side="left")
        return np.where(i < allowed.size, allowed[np.minimum(i, allowed.size - 1)], x)

    @staticmethod
    def _earlier(allowed: np.ndarray, x: np.ndarray) -> np.ndarray:
        i = np.searchsorted(allowed, x, side="right") - 1
        return np.where(i >= 0, allowed[np.maximum(i, 0)], x)

    def free_later(self, x: np.ndarray) -> np.ndarray:
        """The first position at or after ``x`` that a tensor may leave after (``x`` itself when
        there is none)."""
        return x if self.everywhere else self._later(self.frees, x)

    def free_earlier(self, x: np.ndarray) -> np.ndarray:
        return x if self.everywhere else self._earlier(self.frees, x)

    def start_later(self, x: np.ndarray) -> np.ndarray:
        """The first position at or after ``x`` where a prefetch or rebuild may start."""
        return x if self.everywhere else self._later(self.starts, x)

    def start_earlier(self, x: np.ndarray) -> np.ndarray:
        return x if self.everywhere else self._earlier(self.starts, x)


def check_hook_positions(
    graph: ActivationGraph,
    codes: np.ndarray,
    d2h: np.ndarray,
    h2d: np.ndarray,
    rec: np.ndarray,
) -> None:
    """Every position of the schedule is one where the executor can act (PlanError names the
    first that is not)."""
    if graph.hooked_everywhere:
        return
    at = graph.hook_positions
    S = graph.n_positions
    for field, arr, code, shift in (
        ("d2h_free", d2h, SWAP, 1),
        ("h2d_issue", h2d, SWAP, 0),
        ("recompute_at", rec, RECOMPUTE, 0),
    ):
        for t in np.flatnonzero((codes == code) & (arr >= 0)).tolist():
            k = int(arr[t]) + shift
            if k < S and not at[k]:
                what = "leave the device after" if shift else "act at"
                raise PlanError(
                    f"schedule: {field}[{graph.tensors[t].name!r}] = {int(arr[t])}: the executor "
                    f"cannot {what} position {int(arr[t])} "
                    f"({position_label(graph, int(arr[t]))}), where no hook runs"
                    + (" after it" if shift else "")
                    + ' (formulations/step-model.md, "Hook positions")'
                )


def check_swap_schedule(
    graph: ActivationGraph,
    codes: np.ndarray,
    first_need: np.ndarray,
    d2h: np.ndarray,
    h2d: np.ndarray,
) -> None:
    """A swapped tensor leaves after its last forward reader, is prefetched after it has left
    and no later than its first use (PlanError names the first that does not)."""
    last_fwd = graph.last_forward_use
    for t in np.flatnonzero(codes == SWAP):
        name = graph.tensors[t].name
        if d2h[t] < last_fwd[t]:
            raise PlanError(
                f"schedule: d2h_free[{name!r}] = {d2h[t]} is before its last forward "
                f"reader at position {last_fwd[t]}"
            )
        if h2d[t] <= d2h[t]:
            raise PlanError(
                f"schedule: h2d_issue[{name!r}] = {h2d[t]} is not after its d2h_free "
                f"position {d2h[t]}"
            )
        if h2d[t] > first_need[t]:
            raise PlanError(
                f"schedule: h2d_issue[{name!r}] = {h2d[t]} is after its first use at "
                f"position {first_need[t]} ({position_label(graph, int(first_need[t]))})"
            )


def enough_to_cover(
    where: np.ndarray,
    candidate: np.ndarray,
    rank: np.ndarray,
    tensors: np.ndarray,
    graph: ActivationGraph,
    excess: np.ndarray,
    reach: np.ndarray,
) -> np.ndarray:
    """Of the candidates to move at each position ``where`` (a default free moved earlier, a
    prefetch later, to yield to the budget), the first in ``rank`` order whose bytes together
    reach the largest excess between ``where`` and the candidates' ``reach`` (the positions a
    move relieves; all of them where they do not): moving more would only stall."""
    chosen = np.zeros(candidate.shape, dtype=bool)
    nbytes = graph.tensor_bytes
    for q in np.unique(where[candidate]):
        at = np.flatnonzero(candidate & (where == q))
        at = at[np.lexsort((tensors[at], rank[at]))]
        covered = np.cumsum(nbytes[tensors[at]])
        # the positions between q and the farthest candidate's reach (a free's old position
        # after q, a prefetch's old issue before it)
        lo, hi = min(int(q), int(reach[at].min())), max(int(q), int(reach[at].max()))
        need = int(excess[lo : hi + 1].max())
        # the first k whose bytes reach it (k counts the one that reaches it)
        k = int(np.searchsorted(covered, need, side="left")) + 1
        chosen[at[:k]] = True
    return chosen
