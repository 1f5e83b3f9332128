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
    kept_back: list[int] = []
    if keepable[moved].all():
        # the budget holds the keep-all peak: keep-all is the minimal plan and the fastest
        all_kept = np.where(codes == UNSAVED, UNSAVED, KEEP).astype(codes.dtype)
        none = np.full(len(codes), -1, dtype=np.int64)
        whole = expand_positions(graph, all_kept, none, none.copy(), none.copy(), hw, None)
        whole_sim = run_timeline(graph, whole, hw, budget)
        if whole_sim.fits and whole_sim.step_time_s <= sim.step_time_s * (1 + SAME_STEP):
            return Minimal(all_kept, whole, whole_sim, tuple(int(t) for t in moved))
    memory = exp.memory()
    while True:
        changed = False
        for unit in _units(graph, exp.codes, keepable):
            if not _may_fit(graph, exp, memory, unit, budget):
                continue
            trial = exp.codes.copy()
            trial[list(unit)] = KEEP
            td2h, th2d, trec = d2h.copy(), h2d.copy(), rec.copy()
            for t in unit:
                td2h[t] = th2d[t] = trec[t] = -1
            texp = expand_positions(graph, trial, td2h, th2d, trec, hw, None)
            tsim = run_timeline(graph, texp, hw, budget)
            if tsim.fits and tsim.step_time_s <= sim.step_time_s * (1 + SAME_STEP):
                exp, sim, d2h, h2d, rec = texp, tsim, td2h, th2d, trec
                memory = exp.memory()
                kept_back.extend(unit)
                changed = True
        if not changed:
            break
    if not kept_back:
        return None
    return Minimal(exp.codes, exp, sim, tuple(kept_back))


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


def _may_fit(
    graph: ActivationGraph, exp: Expansion, memory: np.ndarray, unit: tuple[int, ...], budget: int
) -> bool:
    """A necessary condition, from memory alone: at every forward and backward point where a
    tensor of ``unit`` is off the device but would be held if kept, the memory there plus its
    bytes stays within the budget (the other tensors' lives are unchanged at those points; only
    rerun points, which a demotion may remove, are left out)."""
    main = exp.point_kind != 1
    for t in unit:
        mine = np.flatnonzero(exp.iv_tensor == t)
        if len(mine) == 0:
            continue
        held = np.zeros(exp.n_points, dtype=bool)
        for i in mine:
            if not exp.iv_transient[i]:
                held[exp.iv_start[i] : exp.iv_end[i] + 1] = True
        first, last = int(exp.iv_start[mine].min()), int(exp.iv_end[mine].max())
        gap = np.zeros(exp.n_points, dtype=bool)
        gap[first : last + 1] = True
        gap &= ~held & main
        if gap.any() and int(memory[gap].max()) + int(graph.tensor_bytes[t]) > budget:
            return False
    return True
