"""Nothing moved or rebuilt that the budget does not need (formulations/step-model.md, "Minimal
plans").

In the step model a copy hidden behind compute is free, so a planner may swap a tensor that could
stay: an optimum at a budget above the keep-all peak can swap hundreds of tensors. On a device
no copy is free (a launch, host work, PCIe shared with the other direction, pinned memory), so
every plan that leaves a planner is made minimal: where the budget holds the keep-all peak the
plan keeps everything, and otherwise no single decision (an RNG group's recomputes together) can
be turned back to keep while the plan still fits at the same or a lower simulated step. Largest
tensors are tried first, so ties go to fewer bytes moved. The other tensors' positions stay as
the planner scheduled them, so the step can only get shorter and a proof stays a proof.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..check.simulate import SimResult, run_timeline
from ..core.graph import ActivationGraph
from ..core.hardware import Hardware
from ..core.plan import KEEP, RECOMPUTE, SWAP, UNSAVED
from ..core.stepmodel import Expansion, expand_positions

# a demotion may not lengthen the step; this relative slack only absorbs float summation order
SAME_STEP = 1e-12


@dataclass(frozen=True)
class Minimal:
    """The minimal plan's decisions, its expansion (complete schedule) and its simulation."""

    codes: np.ndarray
    expansion: Expansion
    simulation: SimResult
    kept_back: tuple[int, ...]  # tensors turned back to keep, in the order they were


def keep_what_fits(
    graph: ActivationGraph,
    hw: Hardware,
    budget: int,
    exp: Expansion,
    sim: SimResult,
    keepable: np.ndarray | None = None,
) -> Minimal | None:
    """The plan of ``exp`` (simulated as ``sim``) with every tensor kept that can be; None when
    nothing changes or the plan does not fit (a plan over budget is not made to look minimal).
    ``keepable``: per tensor, whether keep is allowed (the planner's restriction)."""
    codes = np.asarray(exp.codes)
    moved = np.flatnonzero((codes == SWAP) | (codes == RECOMPUTE))
    if not sim.fits or len(moved) == 0:
        return None
    if keepable is None:
        keepable = np.ones(len(codes), dtype=bool)
    d2h, h2d, rec = _positions(exp)
    if keepable[moved].all():
        # the budget holds the keep-all peak: keep-all is the minimal plan and the fastest
        all_kept = np.where(codes == UNSAVED, UNSAVED, KEEP).astype(codes.dtype)
        none = np.full(len(codes), -1, dtype=np.int64)
        whole = expand_positions(graph, all_kept, none, none.copy(), none.copy(), hw, None)
        whole_sim = run_timeline(graph, whole, hw, budget)
        if whole_sim.fits and whole_sim.step_time_s <= sim.step_time_s * (1 + SAME_STEP):
            return Minimal(all_kept, whole, whole_sim, tuple(int(t) for t in moved))
    state = _Demotions(graph, hw, budget, exp, sim, d2h, h2d, rec)
    while True:
        taken = 0
        remaining = _units(graph, state.exp.codes, keepable)
        while remaining:
            batch, remaining = state.batch(remaining)
            taken += state.take(batch)
        if not taken:
            break
    if not state.kept_back:
        return None
    return Minimal(state.exp.codes, state.exp, state.sim, tuple(state.kept_back))


class _Demotions:
    """The plan being made minimal: its expansion, simulation and positions, and the moves back
    to keep taken so far. Moves are tried in batches (a batch is simulated once; one that does
    not fit or lengthens the step is halved until its parts do, down to single moves), so a plan
    that turns many tensors back to keep costs a few simulations, not one per tensor; a pass
    with nothing taken has tried every move alone, so the result is the same kind of minimal."""

    def __init__(self, graph, hw, budget, exp, sim, d2h, h2d, rec) -> None:
        self.graph, self.hw, self.budget = graph, hw, budget
        self.kept_back: list[int] = []
        self._set(exp, sim, d2h, h2d, rec)

    def _set(self, exp: Expansion, sim: SimResult, d2h, h2d, rec) -> None:
        self.exp, self.sim, self.d2h, self.h2d, self.rec = exp, sim, d2h, h2d, rec
        self.memory = exp.memory()
        self.gaps = _GapIndex(exp)
        # rerun points left out of the memory test (a demotion may remove them)
        self.peaks = _RangeMax(np.where(self.gaps.main, self.memory, np.iinfo(np.int64).min // 2))

    def batch(
        self, units: list[tuple[int, ...]]
    ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """The next batch, in order: each unit that may fit on top of the ones before it (from
        memory alone: module docstring); units that may fit alone but not with the batch are left
        for the next; units that cannot fit alone are dropped for this pass."""
        nbytes = self.graph.tensor_bytes
        # the memory with the batch's units kept, rerun points left out
        combined = self.peaks.levels[0].copy()
        batch: list[tuple[int, ...]] = []
        rest: list[tuple[int, ...]] = []
        for unit in units:
            stretches = [(self.gaps.stretches(t), int(nbytes[t])) for t in unit]
            # alone: a range maximum per stretch (most units stop here)
            if not all(self.peaks.fits(st, size, self.budget) for st, size in stretches):
                continue
            if batch and not all(
                int(combined[a : b + 1].max()) + size <= self.budget
                for st, size in stretches
                for a, b in st
            ):
                rest.append(unit)
                continue
            batch.append(unit)
            for st, size in stretches:
                for a, b in st:
                    combined[a : b + 1] += size
        return batch, rest

    def take(self, batch: list[tuple[int, ...]]) -> int:
        """Turn the batch back to keep if the plan still fits at the same or a lower step, else
        its halves in turn (with the moves already taken); returns how many units were taken."""
        if not batch:
            return 0
        tensors = [t for unit in batch for t in unit]
        trial = self.exp.codes.copy()
        trial[tensors] = KEEP
        d2h, h2d, rec = self.d2h.copy(), self.h2d.copy(), self.rec.copy()
        d2h[tensors] = h2d[tensors] = rec[tensors] = -1
        exp = expand_positions(self.graph, trial, d2h, h2d, rec, self.hw, None)
        sim = run_timeline(self.graph, exp, self.hw, self.budget)
        if sim.fits and sim.step_time_s <= self.sim.step_time_s * (1 + SAME_STEP):
            self._set(exp, sim, d2h, h2d, rec)
            self.kept_back.extend(tensors)
            return len(batch)
        if len(batch) == 1:
            return 0
        half = len(batch) // 2
        return self.take(batch[:half]) + self.take(batch[half:])


class _GapIndex:
    """Per tensor, the forward and backward points where it is off the device but would be held
    if kept (its intervals found once per expansion, not by a scan per tensor)."""

    def __init__(self, exp: Expansion) -> None:
        self.exp = exp
        self.order = np.argsort(exp.iv_tensor, kind="stable")
        self.sorted_tensor = exp.iv_tensor[self.order]
        self.main = exp.point_kind != 1

    def stretches(self, t: int) -> list[tuple[int, int]]:
        """The gap as inclusive (first, last) point ranges: from the tensor's first point to its
        last, less the points where it is held (rerun points included; the memory test leaves
        them out)."""
        exp = self.exp
        lo, hi = np.searchsorted(self.sorted_tensor, [t, t + 1])
        mine = self.order[lo:hi]
        if len(mine) == 0:
            return []
        first, last = int(exp.iv_start[mine].min()), int(exp.iv_end[mine].max())
        held = sorted(
            (int(exp.iv_start[i]), int(exp.iv_end[i])) for i in mine if not exp.iv_transient[i]
        )
        out, at = [], first
        for start, end in held:
            if start > at:
                out.append((at, start - 1))
            at = max(at, end + 1)
        if at <= last:
            out.append((at, last))
        return out


class _RangeMax:
    """The largest value over any range of an array in constant time (a sparse table: the
    maximum of every power-of-two run), built once per expansion."""

    def __init__(self, values: np.ndarray) -> None:
        self.levels = [values]
        span = 1
        while 2 * span <= len(values):
            prev = self.levels[-1]
            self.levels.append(np.maximum(prev[:-span], prev[span:]))
            span *= 2

    def most(self, first: int, last: int) -> int:
        k = (last - first + 1).bit_length() - 1
        level = self.levels[k]
        return int(max(level[first], level[last - (1 << k) + 1]))

    def fits(self, stretches: list[tuple[int, int]], size: int, budget: int) -> bool:
        """``size`` more bytes over these ranges stay within ``budget``."""
        return all(self.most(a, b) + size <= budget for a, b in stretches)


def _positions(exp: Expansion) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The plan's own positions as the arrays ``expand_positions`` takes (-1: none)."""
    codes = exp.codes
    swap, rec = codes == SWAP, codes == RECOMPUTE
    return (
        np.where(swap, exp.d2h_free, -1).astype(np.int64),
        np.where(swap, exp.h2d_issue, -1).astype(np.int64),
        np.where(rec, exp.materialize_at, -1).astype(np.int64),
    )


def _units(
    graph: ActivationGraph, codes: np.ndarray, keepable: np.ndarray
) -> list[tuple[int, ...]]:
    """What can turn back to keep, as one move each: a swap alone, a recompute with its RNG
    group (recomputed all together or not at all); largest first, fewer bytes moved on ties."""
    units: dict[tuple[int, ...], int] = {}
    nbytes = graph.tensor_bytes
    for t in np.flatnonzero((codes == SWAP) | (codes == RECOMPUTE)):
        unit = tuple(graph.group_of(int(t))) if codes[t] == RECOMPUTE else (int(t),)
        unit = tuple(u for u in unit if codes[u] == RECOMPUTE) if codes[t] == RECOMPUTE else unit
        if keepable[list(unit)].all():
            units[unit] = int(sum(int(nbytes[u]) for u in unit))
    return sorted(units, key=lambda u: (-units[u], u))
