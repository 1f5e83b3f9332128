"""The exact planner's solve strategy, as named phases over one :class:`SolveState`
(formulations/milp.md, "Solving"), apart from the backends that solve its models.

1. ``begin``: the clock, the work limits, the heuristic's plan and the LP bound.
2. ``warm``: the warm start (warmstart.py: the heuristic improved by local search from the
   integral relaxation's decisions) and the valid bounds so far.
3. ``shortcut``: the warm start when nothing needs searching (proven by the bound, a model the
   MILP does not cover or cannot build, no time).
4. ``build``: the MILP (formulate.py), hinted with the warm start; ``whole`` or ``lp-guided``.
5. ``search_whole`` / ``search_lp_guided``: the backend on the model; LP-guided, tensors the LP
   decides integrally are fixed (their schedule positions stay free) in up to two rounds.
6. ``prove``: the proof round, the model over every schedule position on small graphs.
7. ``finish``: the best plan found, or the warm start's (``fallback``), under the status that is
   true of it. The proof is the best valid bound: the LP's, the integral relaxation's, the
   MILP's own for a model over every position.

The returned plan is never worse than the warm start (so never worse than the heuristic's).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ...check.simulate import run_timeline
from ...core.plan import (
    OVERHEAD_TARGET,
    STEP_FLOOR,
    SolveInfo,
    proof_tolerance_s,
)
from ...core.status import Status
from ...core.stepmodel import expand
from .. import limits  # IPM_FROM_POSITIONS read at each call, as lpbuilder reads it
from ..base import Problem, Solution
from ..limits import (
    ANYTIME_FORMULATE_S_PER_POSITION,
    ANYTIME_LP_S_PER_POSITION,
    ANYTIME_LP_SHARE,
    CLOSE_S_PER_POSITION,
    DEFAULT_TIME_LIMIT_S,
    LP_GUIDED_MIN_FREE,
    MIN_SEARCH_S,
    WHOLE_MODEL_BINARIES,
    Clock,
    WorkLimits,
)
from .formulate import formulate
from .formulation import Formulation
from .lp_fixings import free_tensors, lp_fixings
from .proof_round import prove

if TYPE_CHECKING:
    from .driver import ExactBackend

log = logging.getLogger("slackswap")


@dataclass(frozen=True)
class SearchSettings:
    """The exact planner's keywords (``ss.solve(..., solver="cpsat", **these)``)."""

    time_limit_s: float | None = None
    seed: int = 0
    workers: int = 2
    warm_start: bool = True
    full: bool | None = None
    strategy: str = "auto"
    polish: bool = True
    coarse: bool = True
    departure: bool = True
    anytime: bool = False
    work_s: float | None = None
    options: dict[str, Any] = field(default_factory=dict)  # passed on to the backend

    # the backend's own options, passed on in ``options``
    BACKEND_OPTIONS: ClassVar[frozenset[str]] = frozenset({"gap", "log", "linearization_level"})

    @classmethod
    def names(cls) -> frozenset[str]:
        """Every keyword the exact planners take besides the time limit: solve() refuses any
        other by name."""
        own = {f.name for f in fields(cls)} - {"time_limit_s", "options"}
        return frozenset(own) | cls.BACKEND_OPTIONS

    @classmethod
    def of(cls, time_limit_s: float | None, options: dict[str, Any]) -> SearchSettings:
        """The settings of a solve's keywords: the search's own as fields, the rest (the
        backend's) in ``options``."""
        unknown = set(options) - cls.names()
        if unknown:
            raise TypeError(f"exact planner: unknown options {sorted(unknown)}")
        own = {k: v for k, v in options.items() if k not in cls.BACKEND_OPTIONS}
        passed = {k: v for k, v in options.items() if k in cls.BACKEND_OPTIONS}
        return cls(time_limit_s=time_limit_s, options=passed, **own)


@dataclass
class Incumbent:
    """The best plan the backend found: its simulated step time, decisions and schedule, and the
    model's objective in seconds (rounded up per op and copy: milp.md, "Scaling")."""

    step_time_s: float
    codes: Any
    schedule: Any
    objective_s: float


@dataclass
class SolveState:
    """What the phases share: the problem, the clock and work limits, the bounds so far, the
    warm start, the model and the best plan found."""

    backend: ExactBackend
    problem: Problem
    settings: SearchSettings
    start: float
    deadline: float
    clock: Clock
    work: WorkLimits
    gap_target: float  # where the search stops: within this of a valid bound's overhead
    options: dict[str, Any]  # the backend's, completed phase by phase
    heuristic: Any = None  # the heuristic's plan, the warm start's first start
    lp: Any = None
    ws: Any = None
    bound_s: float | None = None
    warm_time: float = float("inf")
    base_extra: dict[str, Any] = field(default_factory=dict)
    info_extra: dict[str, Any] = field(default_factory=dict)
    model: Formulation | None = None
    strategy: str = "auto"
    best: Incumbent | None = None
    status: Status = Status.TIMEOUT
    rounds_skipped: str = ""  # why the MILP's rounds were not run (decided by size and work)

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def within(self, step: float, bound: float | None, target: float = OVERHEAD_TARGET) -> bool:
        """Whether ``step`` is proven within ``target`` of the overhead over ``bound`` (the
        status says "optimal" only at the proof target: core/plan.py)."""
        return (
            bound is not None
            and np.isfinite(step)
            and step - bound
            <= proof_tolerance_s(step, self.problem.graph.ideal_step_time_s, target)
        )

    def consider(self, value, objective_units, form: Formulation) -> float | None:
        """A backend's answer, decoded and simulated: kept when it fits and beats the best so far.
        Returns its simulated step time when it fits (the simulator decides, not the model)."""
        from .decode import decode

        g, hw = self.problem.graph, self.problem.hardware
        try:
            codes, schedule = decode(form, value)
            sim = run_timeline(g, expand(g, codes, schedule, hw), hw, self.problem.budget_bytes)
        except ValueError:
            return None  # an inconsistent solver answer is no solution
        if sim.fits and (self.best is None or sim.step_time_s < self.best.step_time_s):
            self.best = Incumbent(sim.step_time_s, codes, schedule, form.seconds(objective_units))
        return sim.step_time_s if sim.fits else None

    def run_backend(
        self, remaining: float, form: Formulation, fixed=None, options=None
    ) -> tuple[Status, Any, Any, Any]:
        """The backend on ``form``; notes when the clock, not its work limit, stopped it.
        Returns (status, value, objective, bound)."""
        s = self.settings
        began = time.perf_counter()
        answer = self.backend.run(
            form, remaining, s.seed, s.workers, options or self.options, fixed=fixed
        )
        status = answer.status
        stopped = self.clock.stopped
        if (
            status not in (Status.OPTIMAL, Status.INFEASIBLE)
            and time.perf_counter() - began >= 0.95 * remaining
        ):
            stopped.append(f"{self.backend.name}_round_{len(stopped) + 1}")
        elif status is Status.TIMEOUT:
            # its work limit ended the search, not the clock: "timeout" would say the time
            # limit stopped it (a longer limit, not the same one again, may do better)
            status = Status.FEASIBLE
        return status, answer.value, answer.objective, answer.bound


def lp_decides_the_plan(state: SolveState) -> bool:
    """Whether the first LP-guided round would leave at most LP_GUIDED_MIN_FREE of the tensors
    free: both rounds would search next to nothing beside the warm start."""
    f, lp = state.model, state.lp
    if f is None or lp is None or lp.status != Status.OPTIMAL or not state.settings.warm_start:
        return False
    return free_tensors(f, lp, state.ws.codes) <= LP_GUIDED_MIN_FREE * len(f.keep)


def search(backend: ExactBackend, problem: Problem, settings: SearchSettings) -> Solution:
    """The phases in order; the first that returns a plan ends the search."""
    state = begin(backend, problem, settings)
    warm(state)
    early = shortcut(state)
    if early is not None:
        return early
    build(state)
    if state.rounds_skipped:
        state.status = Status.FEASIBLE  # the work, not the clock, left the MILP unsearched
    elif state.strategy == "whole":
        search_whole(state)
    else:
        search_lp_guided(state)
    prove(state)
    return finish(state)


def begin(backend: ExactBackend, problem: Problem, settings: SearchSettings) -> SolveState:
    """The clock, the work limits, the heuristic's plan and the LP bound."""
    from ..lpbound import LPSettings, lp_bound_of
    from .warmstart import heuristic_start

    start = time.perf_counter()
    limit = DEFAULT_TIME_LIMIT_S if settings.time_limit_s is None else float(settings.time_limit_s)
    g = problem.graph
    # solve() closes, checks and simulates the plan after this returns, within the limit; the
    # limit counts from solve()'s entry (its first call in a process loads this planner)
    clock_from = start if problem.began is None else min(start, problem.began)
    deadline = clock_from + limit - CLOSE_S_PER_POSITION * g.n_positions
    anytime = settings.anytime
    work_s = limit if settings.work_s is None else float(settings.work_s)
    state = SolveState(
        backend=backend,
        problem=problem,
        settings=settings,
        start=start,
        deadline=deadline,
        clock=Clock(deadline),
        work=WorkLimits.for_work(work_s, anytime=anytime, time_limit_s=limit),
        gap_target=float(settings.options.get("gap", OVERHEAD_TARGET)),
        options=dict(settings.options),
    )
    # the heuristic's plan first: a short limit on a loaded machine still returns at least the
    # plan of solve(solver="heuristic"); the LP bound gets its work (anytime: the time left)
    state.heuristic = heuristic_start(problem, deadline if anytime else None)
    if anytime:
        run_lp = state.left() > 2 * ANYTIME_LP_S_PER_POSITION * g.n_positions
    else:
        run_lp = (
            state.work.solves_lp(g.n_positions, limits.IPM_FROM_POSITIONS)
            and not state.clock.passed()
        )
        if not run_lp and state.clock.passed():
            state.clock.stop("lp_bound")
    if run_lp:
        state.lp = lp_bound_of(
            problem,
            LPSettings(
                max_iterations=state.work.lp_iterations
                if g.n_positions <= limits.IPM_FROM_POSITIONS
                else None,
                time_limit_s=max(0.01, (ANYTIME_LP_SHARE if anytime else 1.0) * state.left()),
            ),
        )
    else:  # no time (anytime) or work to build it: no bound, and no proof
        state.lp = _skipped_bound(
            g,
            problem.budget_bytes,
            "no time left to build the LP bound"
            if anytime
            else "the LP bound's model is too large for the work allowed",
        )
    return state


def _skipped_bound(graph, budget: int, why: str):
    """The trivial bound (no plan beats the ideal step), when the LP bound is not built."""
    from ..lpbuilder import LPBound

    ideal = graph.ideal_step_time_s
    return LPBound(1.0, ideal, ideal, budget, Status.SKIPPED, 0.0, {}, {}, {}, note=why)


def warm(state: SolveState) -> None:
    """The warm start, the valid bounds so far, what the info says of both, and the backend's
    gap in its own terms (the step)."""
    from .warmstart import warm_start

    s, lp, clock = state.settings, state.lp, state.clock
    lp_s = lp.step_time_s if lp.status == Status.OPTIMAL else None
    backend = state.backend
    ws = warm_start(
        state.problem,
        polish=s.polish and s.warm_start,
        bound_s=lp_s,
        gap=state.gap_target,
        work=state.work,
        clock=clock,
        lp=lp,
        heuristic=state.heuristic,
        solve_coarse=None
        if not s.coarse
        else lambda small, lim, wk: backend.solve(
            small,
            time_limit_s=lim,
            work_s=wk,
            seed=s.seed,
            workers=s.workers,
            anytime=s.anytime,
            departure=s.departure,
        ),
        departure=s.departure,
    )
    state.ws = ws
    state.warm_time = ws.step_time_s
    bounds = [b for b in (lp_s, ws.bound_s) if b is not None]
    state.bound_s = max(bounds) if bounds else None
    heuristic_time = ws.heuristic_sim.step_time_s if ws.heuristic_sim.fits else float("inf")
    state.base_extra = {
        "lp_bound_s": lp.wall_s,
        "lp_bound_status": lp.status,
        "heuristic_step_time_s": heuristic_time,
        "work_limits": state.work.as_dict(),
        "warm_start": ws.source,
        "warm_start_step_time_s": state.warm_time,
        **ws.notes,
    }
    # the phases the wall clock ended (or skipped) rather than their work limits: empty means
    # the same input gives this plan and proof on any machine (milp.md, "Solving")
    for name, note in ws.notes.items():
        if isinstance(note, dict) and note.get("clock_stopped"):
            clock.stop(name)
    if lp.clock_stopped or (s.anytime and lp.status in (Status.TIMEOUT, Status.SKIPPED)):
        clock.stopped.insert(0, "lp_bound")
    state.base_extra["clock_stopped"] = clock.stopped
    state.base_extra["anytime"] = s.anytime
    # the backends stop on a gap relative to their objective (the step): the target in those
    # terms, at the warm start's step
    warm_time, ideal = state.warm_time, state.problem.graph.ideal_step_time_s
    step_gap = (
        proof_tolerance_s(warm_time, ideal, state.gap_target) / warm_time
        if np.isfinite(warm_time) and warm_time > 0
        else min(state.gap_target, STEP_FLOOR)
    )
    state.options = {**state.options, "gap": step_gap}


def shortcut(state: SolveState) -> Solution | None:
    """The warm start's plan when no MILP is to be searched; None to go on."""
    g, hw = state.problem.graph, state.problem.hardware
    warm_time, bound_s = state.warm_time, state.bound_s
    finite = bool(np.isfinite(warm_time))
    if (
        state.settings.warm_start
        and finite
        and warm_time > 0
        and state.within(warm_time, bound_s, state.gap_target)
    ):
        # the warm start is already within the target of a valid bound: nothing to search
        assert bound_s is not None
        info = SolveInfo(
            solver=state.backend.name,
            status=Status.OPTIMAL if state.within(warm_time, bound_s) else Status.FEASIBLE,
            objective=warm_time,
            bound=min(bound_s, warm_time),
            gap=max(0.0, (warm_time - bound_s) / warm_time),
            wall_s=time.perf_counter() - state.start,
            predicted_step_time_s=warm_time,
            extra={"strategy": "warm start proven by the bound", **state.base_extra},
        )
        return Solution(state.ws.codes, None, info, simulation=state.ws.sim)
    if hw.collectives_on_link and g.collectives and not hw.duplex and finite:
        why = "the MILP does not model collectives on a half-duplex link; the warm start's plan"
        return fallback(state, Status.FEASIBLE, {**state.base_extra, "reason": why})
    if state.settings.anytime:
        skip = state.left() < MIN_SEARCH_S + 2 * ANYTIME_FORMULATE_S_PER_POSITION * g.n_positions
    else:
        skip = state.clock.passed(MIN_SEARCH_S)
        if not state.work.builds(g.n_positions) and finite:
            why = "the MILP's model is too large for the work allowed"
            return fallback(state, Status.FEASIBLE, {**state.base_extra, "reason": why})
    if skip and finite:
        state.clock.stopped.append("milp_skipped")
        return fallback(
            state, Status.TIMEOUT, {**state.base_extra, "reason": "no time left for the MILP"}
        )
    return None


def build(state: SolveState) -> None:
    """The MILP, hinted with the warm start; the strategy it is searched with and the work its
    rounds share."""
    s, ws, problem = state.settings, state.ws, state.problem
    f = formulate(
        problem.graph,
        problem.hardware,
        problem.budget_bytes,
        full=s.full,
        hint=ws.hint if s.warm_start else None,
        extra_candidates={"free": ws.free, "issue": ws.issue, "rebuild": ws.rebuild}
        if s.warm_start
        else None,
        exact_arithmetic=state.backend.exact_arithmetic,
        mask=problem.mask,
    )
    if s.warm_start and state.backend.takes_complete_hint:
        from .hint import complete_hint

        full_hint = complete_hint(f, *ws.hint)
        if full_hint:
            state.options = {**state.options, "complete_hint": full_hint}
    size = f.model.size()
    state.model = f
    state.info_extra = {
        "model": size,
        "build_s": time.perf_counter() - state.start,
        **state.base_extra,
    }
    strategy = s.strategy
    if strategy == "auto":
        small = size["binaries"] <= WHOLE_MODEL_BINARIES
        # where the LP decides (nearly) every tensor as the warm start does, LP-guided rounds
        # would fix the plan and search nothing: the model is searched whole
        strategy = "whole" if small or lp_decides_the_plan(state) else "lp-guided"
    state.strategy = strategy
    state.info_extra["strategy"] = strategy
    # the MILP's work: in the default mode its rounds (two when LP-guided) share it
    share = 1 if s.anytime or strategy == "whole" else 2
    work = state.work
    seconds, limit = work.milp_s / share, state.backend.work_limit
    state.options = {**state.options, **work.backend_options(limit, seconds, size["nonzeros"])}
    if (
        limit == "deterministic_time"
        and not work.cpsat_round_runs(seconds, size["nonzeros"])
        and np.isfinite(state.warm_time)
    ):
        # (where no start fits, the MILP is the search left: it runs on CP-SAT's floor)
        state.rounds_skipped = (
            f"the MILP not searched: its model ({size['nonzeros']} nonzeros) costs more to "
            f"build and presolve than the {seconds:.2f} s of work a round"
        )
        state.info_extra["milp_rounds"] = {"status": Status.SKIPPED, "reason": state.rounds_skipped}


def search_whole(state: SolveState) -> None:
    """The backend on the whole model; its own bound joins the proof (less its rounding)."""
    f = state.model
    assert f is not None
    status, value, obj, bound = state.run_backend(max(0.05, state.left()), f)
    if value is not None:
        state.consider(value, obj, f)
    # the best of the valid bounds: the relaxations' and, for a model over every schedule, the
    # MILP's own (less its rounding)
    best = state.best
    incumbent = min(state.warm_time, best.step_time_s) if best is not None else state.warm_time
    exact = state.backend.exact_arithmetic
    milp_bound = None if bound is None else f.proven_bound_s(bound, incumbent, exact)
    if milp_bound is not None:
        state.info_extra["milp_bound_s"] = milp_bound
    candidates = [b for b in (milp_bound, state.bound_s) if b is not None]
    state.bound_s = max(candidates) if candidates else None
    if (
        status != Status.OPTIMAL
        and best is not None
        and state.within(best.step_time_s, state.bound_s)
    ):
        status = Status.OPTIMAL
    state.status = status


def search_lp_guided(state: SolveState) -> None:
    """Two rounds: first free what the LP and the warm start disagree on (the warm start stays
    a complete feasible hint), then trust the LP alone."""
    f, lp, stopped = state.model, state.lp, state.clock.stopped
    assert f is not None
    rounds = [(0.999, state.ws.codes if state.settings.warm_start else None), (0.999, None)]
    stopped_before = len(stopped)
    for threshold, agree in rounds:
        remaining = state.left()
        if remaining <= (MIN_SEARCH_S if state.settings.anytime else 0.05):
            stopped.append("milp_rounds_skipped")
            break
        fixed = lp_fixings(f, lp, threshold, agree) if lp.status == Status.OPTIMAL else {}
        status, value, obj, _ = state.run_backend(remaining, f, fixed=fixed)
        state.info_extra.setdefault("rounds", []).append(
            {"threshold": threshold, "fixed_tensors": len(fixed) // 3, "status": status}
        )
        if value is not None:
            state.consider(value, obj, f)
        if state.best is not None and state.within(
            state.best.step_time_s, state.bound_s, state.gap_target
        ):
            break
    # "timeout" only when the clock ended or skipped a round, else the rounds' work did
    best = state.best
    if (
        best is not None
        and state.bound_s is not None
        and state.within(best.step_time_s, state.bound_s)
    ):
        state.status = Status.OPTIMAL
    else:
        state.status = Status.TIMEOUT if len(stopped) > stopped_before else Status.FEASIBLE


def finish(state: SolveState) -> Solution:
    """The best plan found when it is no worse than the warm start, else the warm start's, each
    under the status that is true of it."""
    best, warm_time, status, extra = state.best, state.warm_time, state.status, state.info_extra
    name = state.backend.name
    # relative only: an absolute slack swamps steps of tiny ops
    if best is not None and best.step_time_s <= warm_time * (1 + 1e-9):
        # the plan's step time is the simulator's (exact); the model's objective, rounded up per
        # op and copy (milp.md, "Scaling"), is kept as the objective
        predicted = best.step_time_s
        bound = None if state.bound_s is None else min(state.bound_s, predicted)
        gap = (
            None
            if bound is None
            else (max(0.0, (predicted - bound) / predicted) if predicted > 0 else 0.0)
        )
        if status == Status.OPTIMAL and not state.within(predicted, bound):
            # "optimal" is a proof against a valid bound, not the model's word: a model over
            # windows, or with rounded-up sizes, is a restriction of the problem
            status = Status.FEASIBLE
        elif status not in (Status.OPTIMAL, Status.TIMEOUT):
            status = Status.FEASIBLE
        info = SolveInfo(
            solver=name,
            status=status,
            objective=best.objective_s,
            bound=bound,
            gap=gap,
            wall_s=time.perf_counter() - state.start,
            predicted_step_time_s=predicted,
            extra=extra,
        )
        return Solution(best.codes, best.schedule, info)
    # no solution, or none better than the warm start: the warm start's plan, said so
    extra.update(
        fallback=state.ws.source,
        reason=state.rounds_skipped or "no solution within the time limit"
        if best is None
        else "solver's best was not better than the warm start",
    )
    if status == Status.INFEASIBLE and np.isfinite(warm_time):
        # the warm start fits, so a plan exists: the backend's "infeasible" is its own failure
        # (tolerances, presolve); the warm start is returned under an honest status
        extra["backend_failure"] = (
            f"{name} reported the model infeasible, but the warm start is a valid plan"
        )
        log.warning("%s: %s", name, extra["backend_failure"])
    elif status == Status.INFEASIBLE:
        # nothing fits: with restricted decisions (keep and recompute only) the budget can be
        # below the smallest feasible one, which solve() computes with swaps allowed
        extra["reason"] = (
            f"{name} proved the model infeasible and no start fits: "
            "no plan within this budget with these decisions"
        )
    return fallback(state, status, extra)


def fallback(state: SolveState, status: str, extra: dict[str, Any]) -> Solution:
    """The warm start's plan, under the status that is true of it."""
    warm_time, bound_s = state.warm_time, state.bound_s
    gap = None
    if bound_s is not None and np.isfinite(warm_time):
        bound_s = min(bound_s, warm_time)
        gap = max(0.0, (warm_time - bound_s) / warm_time) if warm_time > 0 else 0.0
    if gap is not None and state.within(warm_time, bound_s):
        final = Status.OPTIMAL  # the warm start is itself within the target of a valid bound
    elif status == Status.TIMEOUT:
        final = Status.TIMEOUT  # the time limit stopped the search
    else:
        final = Status.FEASIBLE  # the search ended without proving the warm start optimal
    info = SolveInfo(
        solver=state.backend.name,
        status=final,
        objective=warm_time,
        bound=bound_s,
        gap=gap,
        wall_s=time.perf_counter() - state.start,
        predicted_step_time_s=warm_time,
        extra=extra,
    )
    return Solution(state.ws.codes, None, info, simulation=state.ws.sim)
