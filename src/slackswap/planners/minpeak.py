"""The smallest budget a plan fits, with the decisions a problem allows (formulations/milp.md,
"The smallest budget").

Where every saved tensor may be offloaded (or has one decision only, keep), the minimum has a
closed form (core/budget.py, ``offload_floor``): each tensor offloaded right after its last
forward reader and back just before its first backward reader, waiting on the copies as long as
it takes; keeping or rebuilding a tensor never needs less. Where some tensor may be kept or
recomputed but not offloaded (keep and recompute only, a CPU device, pins), that floor is only a
lower bound: recomputing everything rebuilds chains at once in backward, so the smallest budget is
a choice of what to keep. It is found by

0. where the most offloaded plan (each tensor swapped where it may be, else recomputed where it
   may be, else kept) fits the floor on the step model's default schedule, the floor is the
   minimum, proven; else
1. a bisection over budgets with the heuristic (a plan it finds fits: an upper bound), then a
   descent below it: the full heuristic (polish and local search) at fractions of the best peak,
   restarting from each better plan (the heuristic's fit is not monotone in the budget), then
2. on graphs of at most MIN_PEAK_CELLS positions x saved tensors, the exact planner's model over
   every schedule position with the budget a variable to minimise (CP-SAT, one worker, a fixed
   deterministic time): where CP-SAT proves its optimum, the minimum is exact up to the byte
   rounding of the model (``proven``).

The result always carries a plan that fits its ``budget_bytes``: a plan exists there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..core.budget import keep_all_peak, offload_floor
from ..core.graph import ActivationGraph
from ..core.hardware import Hardware
from ..core.plan import KEEP, RECOMPUTE, SWAP, Schedule
from ..core.stepmodel import expand
from .base import Problem
from .limits import (
    BISECTION_STEPS,
    DESCENT_FRACTIONS,
    DESCENT_ROUNDS,
    MIN_PEAK_CELLS,
    MIN_PEAK_DTIME,
    MIN_PEAK_NONZEROS,
    Clock,
)


@dataclass(frozen=True)
class MinPeak:
    """The smallest budget found and a plan that fits it.

    budget_bytes: a plan fits this budget (``codes`` with ``schedule``, None: the step model's
    default schedule at this budget). lower_bytes: no plan fits less. proven: the two agree."""

    budget_bytes: int
    lower_bytes: int
    proven: bool
    method: str  # "offload floor", "heuristic", "exact"
    codes: np.ndarray
    schedule: Schedule | None
    wall_s: float
    clock_stopped: bool = False  # a deadline cut the search: a smaller budget may fit


def free_choice(graph: ActivationGraph, mask: np.ndarray | None) -> np.ndarray:
    """Saved tensors that may be kept or recomputed but not offloaded: where the closed form
    is only a bound."""
    if mask is None:
        return np.zeros(0, dtype=np.int64)
    saved = graph.saved
    return saved[~mask[saved, SWAP] & mask[saved, RECOMPUTE] & mask[saved, KEEP]]


def most_offloaded(graph: ActivationGraph, mask: np.ndarray | None) -> np.ndarray:
    codes = np.where(graph.is_saved, SWAP, -1).astype(np.int8)
    if mask is not None:
        for t in graph.saved:
            codes[t] = SWAP if mask[t, SWAP] else RECOMPUTE if mask[t, RECOMPUTE] else KEEP
    return codes


def plan_peak(
    graph: ActivationGraph,
    hw: Hardware,
    codes: np.ndarray,
    schedule: Schedule | None,
    budget: int | None = None,
) -> int:
    """The peak of a plan on the step model (its schedule, or the default one yielding to
    ``budget``)."""
    return int(expand(graph, codes, schedule, hw, budget_bytes=budget).memory().max())


def min_peak(
    graph: ActivationGraph,
    hw: Hardware,
    mask: np.ndarray | None = None,
    exact: bool = True,
    time_limit_s: float = 60.0,
    deadline: float | None = None,
) -> MinPeak:
    """The smallest budget a plan with the decisions ``mask`` allows fits (module docstring).
    ``exact=False`` stops after the bisection. ``time_limit_s`` is a hard cap on each exact
    model's clock; its work is MIN_PEAK_DTIME. ``deadline`` (a ``time.perf_counter()`` time) is
    a hard cap on the whole search, for a caller under a time limit of its own (``solve()``):
    where it stops a phase, the smallest budget found so far stands, ``clock_stopped``."""
    began = time.perf_counter()
    clock = Clock(deadline)
    floor = offload_floor(graph, hw, mask)
    if not free_choice(graph, mask).size and not _forced_recompute(graph, mask):
        return MinPeak(
            floor,
            floor,
            True,
            "offload floor",
            most_offloaded(graph, mask),
            None,
            time.perf_counter() - began,
        )
    offloaded = most_offloaded(graph, mask)
    if plan_peak(graph, hw, offloaded, None, floor) <= floor:
        # the most offloaded plan fits the floor on the step model's default schedule there: a
        # plan exists at the lower bound
        return MinPeak(
            floor, floor, True, "offload floor", offloaded, None, time.perf_counter() - began
        )
    codes, peak = _bisect(graph, hw, mask, floor, clock)
    bisected = MinPeak(peak, floor, peak <= floor, "heuristic", codes, None, 0.0)
    best = _descend(graph, hw, mask, floor, bisected, clock)
    if (
        exact
        and best.budget_bytes > floor
        and graph.n_positions * len(graph.saved) <= MIN_PEAK_CELLS
    ):
        # plans from the model whose rebuilds run where one is due (a restriction: the same
        # work searches further), the bound from the model over every position
        def exact_run(start: MinPeak, every_rebuild: bool) -> MinPeak | None:
            """One exact model, its clock capped by what is left of the deadline."""
            cap = min(time_limit_s, max(0.0, clock.left()))
            return _exact(graph, hw, mask, floor, start, cap, every_rebuild=every_rebuild)

        found = exact_run(best, every_rebuild=False)
        if (found is None or not found.proven) and not clock.passed():
            # the model's search within its work goes where its hint leads it: a second start,
            # the descent whose local search makes single moves only, leads it elsewhere, and
            # the smaller minimum and the larger bound of the two stand (UNet recompute-only:
            # 3.15 GB from the first, 2.89 GB from the second)
            other = _descend(graph, hw, mask, floor, bisected, clock, exchanges=False)
            if not np.array_equal(other.codes, best.codes) and not clock.passed():
                found = _better(
                    found,
                    exact_run(other, every_rebuild=False),
                )
        if found is not None:
            best = _better(found, best) or best
        if not best.proven and not clock.passed():
            bounded = exact_run(best, every_rebuild=True)
            best = _better(bounded, best) or best
    return MinPeak(
        best.budget_bytes,
        best.lower_bytes,
        best.proven,
        best.method,
        best.codes,
        best.schedule,
        time.perf_counter() - began,
        clock.passed(),  # a phase skipped, or the last one's clock cut at the deadline
    )


def _forced_recompute(graph: ActivationGraph, mask: np.ndarray | None) -> bool:
    """Some tensor must be recomputed (its rebuild's transients are not in the closed form)."""
    if mask is None:
        return False
    saved = graph.saved
    return bool((mask[saved, RECOMPUTE] & ~mask[saved, SWAP] & ~mask[saved, KEEP]).any())


def _bisect(
    graph: ActivationGraph, hw: Hardware, mask, floor: int, clock: Clock
) -> tuple[np.ndarray, int]:
    """The heuristic's plans between the floor and the keep-all peak: the smallest peak of a
    plan that fits its budget, and the plan."""
    from .heuristic import SlackSwapHeuristic

    heuristic = SlackSwapHeuristic()

    def attempt(budget: int) -> tuple[np.ndarray, int] | None:
        codes = heuristic.solve(Problem(graph, hw, budget, mask), unfit_polish=False).codes
        peak = plan_peak(graph, hw, codes, None, budget)
        return (codes, peak) if peak <= budget else None

    hi = max(floor, keep_all_peak(graph, hw))
    best = attempt(hi)
    if best is None:  # the allowed decisions do not fit even the keep-all peak: search above
        codes = most_offloaded(graph, mask)
        peak = plan_peak(graph, hw, codes, None)
        best = (codes, peak)
    lo = floor
    hi = best[1]
    for _ in range(BISECTION_STEPS):
        if hi - lo <= max(1, hi // 1000) or clock.passed():
            break
        mid = (lo + hi) // 2
        found = attempt(mid)
        if found is None:
            lo = mid  # the heuristic found none: not a proof, the exact model may
        else:
            best = found
            hi = found[1]
    return best


def _better(a: MinPeak | None, b: MinPeak | None) -> MinPeak | None:
    """The smaller of two minima found (the first where they are equal), with the larger of
    their lower bounds (both hold)."""
    if a is None or b is None:
        return a if b is None else b
    lower = max(a.lower_bytes, b.lower_bytes)
    best = a if a.budget_bytes <= b.budget_bytes else b
    return MinPeak(
        best.budget_bytes,
        lower,
        best.budget_bytes <= lower,
        best.method,
        best.codes,
        best.schedule,
        0.0,
    )


def _descend(
    graph: ActivationGraph,
    hw: Hardware,
    mask,
    floor: int,
    best: MinPeak,
    clock: Clock,
    exchanges: bool = True,
) -> MinPeak:
    """Below ``best``: the full heuristic (its polish, its local search: with its exchanges
    or single moves only) at DESCENT_FRACTIONS of the best peak so far, restarting from each
    plan with a lower peak, for DESCENT_ROUNDS."""
    from .heuristic import SlackSwapHeuristic

    heuristic = SlackSwapHeuristic()
    for _ in range(DESCENT_ROUNDS):
        improved = False
        for fraction in DESCENT_FRACTIONS:
            budget = int(best.budget_bytes * fraction)
            if budget < floor or clock.passed():
                break
            found = heuristic.solve(Problem(graph, hw, budget, mask), exchanges=exchanges)
            exp = expand(graph, found.codes, found.schedule, hw, budget_bytes=budget)
            peak = int(exp.memory().max())
            if peak <= budget:
                # every position fixed: the plan fits its peak whatever budget it is closed at
                schedule = exp.schedule(graph)
                best = MinPeak(peak, floor, peak <= floor, "heuristic", found.codes, schedule, 0.0)
                improved = True
                break
        if not improved:
            break
    return best


def _exact(
    graph: ActivationGraph,
    hw: Hardware,
    mask,
    floor: int,
    start: MinPeak,
    time_limit_s: float,
    every_rebuild: bool = True,
) -> MinPeak | None:
    """The exact planner's model over every position with the budget a variable: minimise it.
    ``every_rebuild=False``: rebuilds only where one is due (a restriction), whose plans fit
    but whose bound proves nothing (the start's lower bound stands)."""
    from ortools.sat.python import cp_model

    from .exact.cpsat import build_model
    from .exact.decode import decode
    from .exact.formulate import formulate
    from .exact.hint import complete_hint
    from .interrupts import solve_cpsat

    if time_limit_s <= 0:
        return None
    began = time.perf_counter()
    f = formulate(
        graph,
        hw,
        start.budget_bytes,
        full=True,
        cuts=False,
        mask=mask,
        every_rebuild=every_rebuild,
        earliest=False,  # the budget is the objective: the starts are free
    )
    m = f.model
    if m.size()["nonzeros"] > MIN_PEAK_NONZEROS:
        return None
    sc = f.scaling
    budget_u = sc.budget_of(start.budget_bytes)
    # the budget becomes a variable: every memory row's right-hand side is its cap less the
    # budget (memory_budget, memory_budget_rerun of milp.md)
    hint = {}
    exp = expand(graph, start.codes, start.schedule, hw, budget_bytes=start.budget_bytes)
    free = {int(t): int(exp.d2h_free[t]) for t in graph.saved if start.codes[t] == SWAP}
    issue = {int(t): int(exp.h2d_issue[t]) for t in graph.saved if start.codes[t] == SWAP}
    rebuild = {
        int(t): int(exp.materialize_at[t]) for t in graph.saved if start.codes[t] == RECOMPUTE
    }
    hint = complete_hint(f, start.codes, free, issue, rebuild)
    b = m.var("budget", 0, budget_u)
    for c in m.constraints:
        if c.name.startswith("memory_budget"):
            c.terms.append((b, -1))
            assert c.hi is not None  # every memory row has an upper bound
            c.hi = c.hi - budget_u
    m.objective = [(b, 1)]
    m.objective_offset = 0
    model, x = build_model(f)
    if hint:
        for v, val in hint.items():
            model.add_hint(x[v], val)
        model.add_hint(x[b], budget_u)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_deterministic_time = MIN_PEAK_DTIME
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s - (time.perf_counter() - began))
    status = solve_cpsat(solver, model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    # the model's sizes are exact multiples of its byte unit or rounded down (a relaxation):
    # its bound in units, times the unit, is no more than any plan's peak; its plan's own peak
    # is what the step model says
    lower = max(floor, int(np.ceil(solver.best_objective_bound - 1e-9)) * sc.byte_unit)
    if not every_rebuild:
        lower = max(floor, start.lower_bytes)  # a restriction's bound is no proof
    codes, schedule = decode(f, lambda v: solver.value(x[v]))
    peak = plan_peak(graph, hw, codes, schedule)
    # proven only where the peak meets the bound exactly: with sizes rounded to a coarse unit
    # (1e12-byte tensors) a unit's difference is no proof
    if peak >= start.budget_bytes:
        lower = max(lower, start.lower_bytes)
        return MinPeak(
            start.budget_bytes,
            lower,
            start.budget_bytes <= lower,
            start.method,
            start.codes,
            start.schedule,
            0.0,
        )
    proven = peak <= lower
    return MinPeak(peak, lower, proven, "exact", codes, schedule, 0.0)
