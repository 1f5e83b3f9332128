"""The exact planner's starting plan: the best of the heuristic and two local searches.

The SlackSwap heuristic is fast but greedy. The LP relaxation with integral decisions
(lpbound.py, ``integral=True``) chooses decisions against the whole step's memory and copy-lane
capacity at once, but in aggregate: its plan may wait on a D2H backlog or top the budget where a
whole tensor, not a fraction of one, is still on the device. The local search (local_search.py)
repairs that with the step model's exact rules. A second relaxation with 2% slower copy lanes gives
decisions with headroom for that, a second start. On a large graph of repeated
blocks, where none of that gets far, the plan of a coarse copy with fewer blocks, stretched back,
comes first (coarse_start, repeats.py). The best plan is the MILP's hint and the floor
of what the exact planner returns; the integral relaxation's bound tightens the proof.
formulations/milp.md, "Solving", steps 1-2.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ...check.simulate import SimResult, simulate_decisions
from ...core.graph import ActivationGraph
from ...core.plan import KEEP, OVERHEAD_TARGET, RECOMPUTE, SWAP, UNSAVED
from ..base import Problem
from ..limits import (
    COARSE_MAX_OPS,
    COARSE_MIN_BLOCKS,
    COARSE_MIN_OPS,
    COARSE_OPS_PER_S,
    COARSE_RATIO,
    DEFAULT_TIME_LIMIT_S,
    HEURISTIC_BUNDLE_S_PER_POSITION,
    HEURISTIC_MAIN_POLISH_S,
    HEURISTIC_POLISH_S,
    HEURISTIC_UNFIT_POLISH_S,
    Clock,
    WorkLimits,
)

log = logging.getLogger("slackswap")


@dataclass
class WarmStart:
    """A plan (decisions and the default schedule it was simulated with) and where it came from."""

    codes: np.ndarray
    free: dict[int, int]
    issue: dict[int, int]
    rebuild: dict[int, int]
    sim: SimResult
    source: str
    heuristic_codes: np.ndarray
    heuristic_sim: SimResult
    bound_s: float | None = None  # the integral relaxation's bound on the step time, if solved
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def step_time_s(self) -> float:
        return self.sim.step_time_s if self.sim.fits else float("inf")

    @property
    def hint(self):
        return self.codes, self.free, self.issue, self.rebuild


def warm_from(
    problem: Problem,
    codes: np.ndarray,
    sim: SimResult,
    source: str,
    heuristic_codes,
    heuristic_sim,
    bound_s=None,
) -> WarmStart:
    """A warm start from decisions and their simulation (whose expansion holds the default
    schedule, yielding to the budget, that the plan was simulated with)."""
    g, exp = problem.graph, sim.expansion
    free = {int(t): int(exp.d2h_free[t]) for t in g.saved if codes[t] == SWAP}
    issue = {int(t): int(exp.h2d_issue[t]) for t in g.saved if codes[t] == SWAP}
    rebuild = {int(t): int(exp.materialize_at[t]) for t in g.saved if codes[t] == RECOMPUTE}
    return WarmStart(
        codes, free, issue, rebuild, sim, source, heuristic_codes, heuristic_sim, bound_s
    )


def _restricted(problem: Problem, kinds: tuple[str, ...]) -> np.ndarray | None:
    """The problem's mask further restricted to ``kinds``, or None if nothing would be left
    to some tensor."""
    from ...core.errors import PlanError
    from ...core.restrict import decision_mask

    try:
        mask = decision_mask(problem.graph, kinds)
    except PlanError:
        return None
    if problem.mask is not None:
        mask = mask & problem.mask
        if not mask[problem.graph.saved].any(axis=1).all():
            return None
    return mask


def _only_plan(graph: ActivationGraph, mask: np.ndarray) -> np.ndarray | None:
    """The decisions where ``mask`` leaves each saved tensor one (offload-only on a device that
    may not swap: keep everything), else None. The heuristic would search for this one plan:
    where nothing fits, at length (its polish from a plan over the budget)."""
    saved = graph.saved
    if not (mask[saved].sum(axis=1) == 1).all():
        return None
    codes = np.full(len(graph.tensors), UNSAVED, dtype=np.int8)
    codes[saved] = mask[saved].argmax(axis=1)
    return codes


def better(a: SimResult, b: SimResult) -> bool:
    """a is a better plan than b: it fits where b does not, or it is faster."""
    if a.fits != b.fits:
        return a.fits
    return a.step_time_s < b.step_time_s


def integral_codes(problem: Problem, relaxation) -> np.ndarray:
    """Each tensor's largest fraction in a relaxation's answer, as its decision."""
    g = problem.graph
    codes = np.full(len(g.tensors), -1, dtype=np.int8)
    for t in g.saved:
        name = g.tensors[int(t)].name
        values = (relaxation.keep[name], relaxation.swap[name], relaxation.recompute[name])
        codes[t] = (KEEP, SWAP, RECOMPUTE)[int(np.argmax(values))]
    return codes


def heuristic_start(
    problem: Problem, deadline: float | None = None
) -> tuple[np.ndarray, SimResult]:
    """The heuristic's plan as solve(solver="heuristic") makes it (its polish bounded by work,
    at most 20,000 simulated positions, and its bundled pricing) whenever the time left covers
    them, and its simulation. The exact planner makes it first, before its LP bound, so that a
    short time limit on a loaded machine still returns at least this plan."""
    from ..heuristic import SlackSwapHeuristic

    g, hw, budget = problem.graph, problem.hardware, problem.budget_bytes
    left_now = float("inf") if deadline is None else deadline - time.perf_counter()
    main_polish = left_now > HEURISTIC_MAIN_POLISH_S
    # without the polish, the bundled pricing alone unless the time left would not cover it:
    # then the published rules alone, so the limit holds
    bundle = main_polish or left_now > HEURISTIC_BUNDLE_S_PER_POSITION * g.n_positions
    codes = (
        SlackSwapHeuristic()
        .solve(
            problem,
            polish=main_polish,
            bundle_reruns=bundle,
            unfit_polish=left_now > HEURISTIC_UNFIT_POLISH_S,
        )
        .codes
    )
    return codes, simulate_decisions(g, codes, hw, budget)


def coarse_start(
    problem: Problem,
    solve_coarse: Callable[[Problem, float], Any],
    limit_s: float,
    notes: dict[str, Any],
    clocked: bool = False,
) -> np.ndarray | None:
    """A large graph of repeated blocks (repeats.py): the plan of the same step with fewer
    blocks, solved by ``solve_coarse`` (a Solution) within ``limit_s``, stretched back and
    repaired to the budget; None where the graph is small or has no long repeat
    (formulations/milp.md, "Repeated blocks"). ``clocked``: the clock, not the time limit alone,
    set ``limit_s`` (noted, like a clock-stopped phase of the coarse solve itself)."""
    from ...core.budget import keep_all_peak
    from ...core.restrict import first_forbidden
    from ..heuristic import fit_to_budget
    from ..repeats import coarsen, consistent, find_repeats

    g, hw, budget = problem.graph, problem.hardware, problem.budget_bytes
    if g.n_ops < COARSE_MIN_OPS:
        return None
    began = time.perf_counter()
    repeats = find_repeats(g)
    if repeats is None:
        notes["coarse"] = {"status": "no repeated blocks"}
        return None
    blocks = min(
        int(min(COARSE_OPS_PER_S * limit_s, COARSE_MAX_OPS)) // repeats.period,
        repeats.count // COARSE_RATIO,
    )
    if blocks < COARSE_MIN_BLOCKS:
        notes["coarse"] = {"status": "too few repeated blocks", "of": repeats.count}
        return None
    coarse = coarsen(g, repeats, blocks)
    if coarse is None:
        notes["coarse"] = {"status": "a reference could not be carried over"}
        return None
    cg = coarse.graph
    if cg.n_ops > 2 * COARSE_MAX_OPS:  # the repeats are a small part of the graph
        notes["coarse"] = {"status": "coarse graph too large", "ops": cg.n_ops}
        return None
    # memory scales with the blocks kept: the coarse budget is the same share of its keep-all peak
    coarse_budget = int(budget * keep_all_peak(cg, hw) // keep_all_peak(g, hw))
    mask = None
    if problem.mask is not None:
        index = g.tensor_index
        mask = problem.mask[[index[t.name] for t in cg.tensors]]
    try:
        solution = solve_coarse(Problem(cg, hw, coarse_budget, mask), limit_s)
    except ValueError as exc:  # the coarse start is optional: the original is still planned
        log.warning("coarse start for graph %r failed: %s", g.name, exc)
        notes["coarse"] = {"status": f"failed: {exc}"}
        return None
    codes = consistent(g, coarse.stretch(solution.codes), problem.mask)
    fits = fit_to_budget(g, hw, budget, codes, problem.mask)
    note: dict[str, Any] = {
        "blocks": blocks,
        "of": repeats.count,
        "period": repeats.period,
        "coarse_budget": coarse_budget,
        "fits": fits,
        "wall_s": time.perf_counter() - began,
        "clock_stopped": clocked or bool(solution.info.extra.get("clock_stopped")),
    }
    notes["coarse"] = note
    if not fits or first_forbidden(g, codes, problem.mask) is not None:
        note["status"] = "not used"
        return None
    note["status"] = "used"
    return codes


class Background:
    """One call in a thread that the caller may stop (a CP-SAT search, which releases the GIL)."""

    def __init__(self) -> None:
        self.solver: Any = None
        self.value: Any = None
        self.error: str | None = None
        self.taken = False
        self._stopped = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self, call: Callable[[Callable[[Any], None]], Any]) -> None:
        def on_start(solver) -> None:
            with self._lock:
                self.solver = solver
                if self._stopped:
                    solver.parameters.max_time_in_seconds = 0.0

        def run() -> None:
            try:
                self.value = call(on_start)
            except Exception as exc:  # noqa: BLE001 - reported as a failed start, not raised
                self.error = f"{type(exc).__name__}: {exc}"

        self._thread = threading.Thread(target=run, name="slackswap-departure-bound", daemon=True)
        self._thread.start()

    def result(self) -> Any:
        """Its value (None if it raised), waiting for it."""
        self.taken = True
        if self._thread is not None:
            self._thread.join()
        return self.value

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self.solver is not None:
                self.solver.stop_search()
        if self._thread is not None:
            self._thread.join()


def warm_start(
    problem: Problem,
    polish: bool = True,
    bound_s: float | None = None,
    gap: float = OVERHEAD_TARGET,
    *,
    work: WorkLimits | None = None,
    clock: Clock | None = None,
    lp=None,
    heuristic: tuple[np.ndarray, SimResult] | None = None,
    solve_coarse: Callable[[Problem, float, float], Any] | None = None,
    departure: bool = True,
) -> WarmStart:
    """The heuristic's plan, improved (``polish``) by local search from the decisions of the
    integral relaxation, of its looser form, of it with 2% slower lanes, and of the heuristic,
    whichever simulates fastest. Each further start is tried only while the plan is not yet
    within ``gap`` of its overhead of the best known bound (``bound_s`` or the relaxation's).

    ``work`` (limits.py; default: the exact planner's default) limits each phase: each relaxation
    stops once proven within RELAXATION_GAP of the step or after its branch-and-bound nodes, the
    local searches after their simulated positions in all, the departure bound after its CP-SAT
    deterministic time (it runs beside the integral relaxations and is taken after them: a
    bound where single copies are long against the compute, and its decisions a start). A large
    graph of repeated blocks starts from the plan of a coarse copy (``solve_coarse(problem,
    time limit, work)``; coarse_start) first. ``clock`` is only a cap: what would start after it
    is skipped and named; with ``work.anytime`` the phases share the time left instead."""
    from ..heuristic import SlackSwapHeuristic
    from .start_search import StartSearch

    g, hw, budget = problem.graph, problem.hardware, problem.budget_bytes
    work = WorkLimits.for_work(DEFAULT_TIME_LIMIT_S) if work is None else work
    clock = Clock(None) if clock is None else clock
    anytime = work.anytime
    # the heuristic's plan (heuristic_start: the very plan of solve(solver="heuristic"), in
    # anytime mode whenever the time left covers it); the restricted problems' runs below polish
    # (anytime: only with more time left); the searches below go further anyway
    h_codes, h_sim = (
        heuristic
        if heuristic is not None
        else heuristic_start(problem, clock.deadline if anytime else None)
    )
    left_now = clock.left() if anytime else float("inf")
    heuristic_polish = left_now > HEURISTIC_POLISH_S
    # their bundled pricing (a second run of the rules) too, unless (anytime) the time left
    # would not cover it: then the published rules alone, so the limit holds
    bundle = left_now > HEURISTIC_BUNDLE_S_PER_POSITION * g.n_positions
    best = warm_from(problem, h_codes, h_sim, "heuristic", h_codes, h_sim)
    # more decisions must never give a worse plan: the heuristic's plans of the restricted
    # problems (recompute-only, offload-only) are starts too, at the cost of two heuristic runs
    for label, kinds in (
        ("recompute-only heuristic", ("keep", "recompute")),
        ("offload-only heuristic", ("keep", "swap")),
    ):
        mask = _restricted(problem, kinds)
        if mask is None or (problem.mask is not None and np.array_equal(mask, problem.mask)):
            # nothing left to some tensor, or the problem itself (keep and recompute on a CPU):
            # the heuristic's plan above is that run's
            continue
        if clock.passed():  # a cap: the phase is skipped, and named
            clock.stop(label.replace(" ", "_").replace("-", "_"))
            continue
        codes = _only_plan(g, mask)
        if codes is None:
            codes = (
                SlackSwapHeuristic()
                .solve(replace(problem, mask=mask), polish=heuristic_polish, bundle_reruns=bundle)
                .codes
            )
        sim = simulate_decisions(g, codes, hw, budget)
        if better(sim, best.sim):
            best = warm_from(problem, codes, sim, label, h_codes, h_sim)
    search = StartSearch(
        problem,
        best,
        bound_s=bound_s,
        gap=gap,
        work=work,
        clock=clock,
        solve_coarse=solve_coarse,
        departure=departure,
    )
    if not polish or search.proven():
        return best
    return search.run()
