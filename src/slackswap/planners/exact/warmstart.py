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
from ...core.plan import KEEP, OVERHEAD_TARGET, RECOMPUTE, STEP_FLOOR, SWAP, proof_tolerance_s
from ..base import Problem
from ..local_search import improve
from .limits import DEFAULT_TIME_LIMIT_S, Clock, WorkLimits

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


def _warm(
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


def _better(a: SimResult, b: SimResult) -> bool:
    """a is a better plan than b: it fits where b does not, or it is faster."""
    if a.fits != b.fits:
        return a.fits
    return a.step_time_s < b.step_time_s


def _integral_codes(problem: Problem, relaxation) -> np.ndarray:
    g = problem.graph
    codes = np.full(len(g.tensors), -1, dtype=np.int8)
    for t in g.saved:
        name = g.tensors[int(t)].name
        values = (relaxation.keep[name], relaxation.swap[name], relaxation.recompute[name])
        codes[t] = (KEEP, SWAP, RECOMPUTE)[int(np.argmax(values))]
    return codes


# the second integral relaxation plans with copy lanes this much slower: decisions that leave the
# lanes some headroom for what the fluid model does not see (whole tensors, in production order)
LANE_HEADROOM = 0.98
# each relaxation runs until its decisions are proven within this fraction of the step (a point
# HiGHS reaches by the same path on any machine); the clock is only a cap
RELAXATION_GAP = 1e-4
RELAXATION_CAP_S = 20.0
# by default the relaxations run without HiGHS's sub-MIP heuristics (RINS, RENS): they were most
# of the root node's time (SegNet at 50%: 4.1 of 4.9 s) for the same bound and nearly the same
# decisions on the CNN rows; the root node has no other work limit
RELAXATION_HIGHS = {"mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False}
RELAXATION_MIN_S = 1.5  # less time left than this: the relaxation is not started
HEURISTIC_POLISH_S = 2.0  # less time left than this: the restricted heuristics without polish
# less time left than this: the heuristic itself without its polish (at most 20,000 simulated
# positions, about 0.2 s on the reference machine, and the bundled pricing)
HEURISTIC_MAIN_POLISH_S = 0.4
# less time left than this: the heuristic's polish does not search on with more work where no
# candidate fits (heuristic.UNFIT_POLISH_FACTOR: at most about 6.4 s on the reference machine)
HEURISTIC_UNFIT_POLISH_S = 8.0
# less time left than this per position: the heuristic runs without its bundled pricing either
# (three runs and their simulations; BERT-Large, 582 positions: 8 ms each on the reference machine)
HEURISTIC_BUNDLE_S_PER_SLOT = 1e-4


# the coarse start (coarse_start): graphs of fewer ops are searched whole; its coarse graph has
# about COARSE_OPS_PER_S ops per second of its limit (a 64-layer GPT-style step, 643 ops, gets its
# plan in 30 s on the reference machine), at most COARSE_MAX_OPS, at least COARSE_MIN_BLOCKS blocks
# and at most 1 / COARSE_RATIO of the original's
COARSE_MIN_OPS = 1500
COARSE_OPS_PER_S = 20
COARSE_MAX_OPS = 650
COARSE_MIN_BLOCKS = 4
COARSE_RATIO = 4
COARSE_MIN_S = 5.0
NOT_RELAXATIONS = (
    "heuristic",
    "rounded LP",
    "coarse plan",
    "departure bound",
    "departure bound from the best plan",
)
# the departure bound (planners/departures.py) is built for graphs of at most this many
# positions x saved tensors, and started with at least this much time left; its clock cap is
# this share of the time left (its work limit, set by the caller, usually ends it first)
DEPARTURE_CELLS = 100_000
DEPARTURE_MIN_S = 0.5
DEPARTURE_CLOCK_SHARE = 0.6
# the departure bound again from the best plan of the starts, capped this share of the proof
# tolerance under it: "no point is that fast" closes the proof (formulations/departure-bound.md,
# "From the best plan")
DEPARTURE_CLOSING_SHARE = 0.9
DEPARTURE_CLOSING_WORK = 1.0  # its work, as a share of the first run's
# by default its whole work (its models' sizes charged) is this share of the first run's: it comes
# after the relaxations, whose root nodes no work limit bounds (ResNet50 at 50%: 2 s each)
DEPARTURE_CLOSING_SHARE_OF_WORK = 0.5
# each departure run stops within this share of the proof tolerance of its bound
DEPARTURE_GAP_SHARE = 0.8


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
    bundle = main_polish or left_now > HEURISTIC_BUNDLE_S_PER_SLOT * g.n_slots
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
    note = {
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


class _Background:
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
    from ..lpbound import lp_bound

    g, hw, budget = problem.graph, problem.hardware, problem.budget_bytes
    work = WorkLimits.for_work(DEFAULT_TIME_LIMIT_S) if work is None else work
    clock = Clock(None) if clock is None else clock
    anytime = work.anytime
    deadline = clock.deadline
    search_work: int | None = work.search_work
    search_cap_s = work.search_cap_s
    # the heuristic's plan (heuristic_start: the very plan of solve(solver="heuristic"), in
    # anytime mode whenever the time left covers it); the restricted problems' runs below polish
    # (anytime: only with more time left); the searches below go further anyway
    h_codes, h_sim = (
        heuristic
        if heuristic is not None
        else heuristic_start(problem, deadline if anytime else None)
    )
    left_now = clock.left() if anytime else float("inf")
    heuristic_polish = left_now > HEURISTIC_POLISH_S
    # their bundled pricing (a second run of the rules) too, unless (anytime) the time left
    # would not cover it: then the published rules alone, so the limit holds
    bundle = left_now > HEURISTIC_BUNDLE_S_PER_SLOT * g.n_slots
    best = _warm(problem, h_codes, h_sim, "heuristic", h_codes, h_sim)
    # more decisions must never give a worse plan: the heuristic's plans of the restricted
    # problems (recompute-only, offload-only) are starts too, at the cost of two heuristic runs
    for label, kinds in (
        ("recompute-only heuristic", ("keep", "recompute")),
        ("offload-only heuristic", ("keep", "swap")),
    ):
        mask = _restricted(problem, kinds)
        if mask is None:
            continue
        codes = (
            SlackSwapHeuristic()
            .solve(replace(problem, mask=mask), polish=heuristic_polish, bundle_reruns=bundle)
            .codes
        )
        sim = simulate_decisions(g, codes, hw, budget)
        if _better(sim, best.sim):
            best = _warm(problem, codes, sim, label, h_codes, h_sim)

    def left() -> float:
        return clock.left()

    def proven() -> bool:
        known = [b for b in (bound_s, best.bound_s) if b is not None]
        return (
            bool(known)
            and best.sim.fits
            and best.step_time_s - max(known)
            <= proof_tolerance_s(best.step_time_s, g.ideal_step_time_s, gap)
        )

    if not polish or proven():
        return best
    notes: dict[str, Any] = {}
    work_left = search_work
    searched = 0.0

    def relaxed_codes(label: str, lanes: float = 1.0, tight: bool = True) -> np.ndarray | None:
        if not anytime and g.n_slots * len(g.saved) > work.relax_cells:
            # its root node alone would pass the work allowed (decided by size, not the clock)
            notes[label] = {
                "status": "skipped",
                "reason": "model too large for the work",
                "clock_stopped": False,
            }
            return None
        if left() <= (RELAXATION_MIN_S + 2 * 4e-4 * g.n_slots if anytime else 0.1):
            notes[label] = {"status": "skipped", "reason": "deadline", "clock_stopped": True}
            return None
        planning_hw = (
            hw
            if lanes == 1.0
            else hw.with_link(
                d2h_bytes_per_s=hw.d2h_bytes_per_s * lanes,
                h2d_bytes_per_s=hw.h2d_bytes_per_s * lanes,
            )
        )
        cap = max(0.1, min(work.relax_cap_s, 0.6 * left())) if anytime else max(0.1, left())
        relaxation = lp_bound(
            g,
            budget,
            planning_hw,
            integral=True,
            mask=problem.mask,
            time_limit_s=cap,
            gap=RELAXATION_GAP,
            max_nodes=work.relax_nodes,
            highs_options=None if anytime else RELAXATION_HIGHS,
            producer_delay=tight,
            gap_on_step=False,
            kill_after_s=None if deadline is None else max(0.1, left() - (1.0 if anytime else 0.0)),
        )
        notes[label] = {
            "status": relaxation.status,
            "wall_s": relaxation.wall_s,
            "retention": relaxation.retention,
            "lanes": lanes,
            "tight": tight,
            "nodes": relaxation.nodes,
            "clock_stopped": relaxation.clock_stopped,
        }
        if (
            lanes == 1.0
            and tight
            and relaxation.status in ("optimal", "timeout")
            and np.isfinite(relaxation.step_time_s)
        ):
            raise_bound(relaxation.step_time_s)  # the real lanes: a valid bound
        return _integral_codes(problem, relaxation) if relaxation.keep else None

    def raise_bound(step_s: float) -> None:
        best.bound_s = step_s if best.bound_s is None else max(best.bound_s, step_s)

    background = None
    # its rounds stop within a share of the proof tolerance: the plan from its point then needs
    # only the rest (formulations/departure-bound.md, "Solving it"); none when the search is to
    # the end (gap 0)
    departure_gap = {
        "gap": DEPARTURE_GAP_SHARE * gap,
        "min_gap_s": DEPARTURE_GAP_SHARE * STEP_FLOOR * g.ideal_step_time_s if gap > 0 else 0.0,
    }
    # with no tensor allowed to swap there is no copy lane for it to see: the LP bound and the
    # integral relaxation cover that case (recompute-only CNN rows: 20 of 21 proven without it)
    swappable = problem.mask is None or bool(problem.mask[g.saved, SWAP].any())
    departure_work_s = work.departure_deterministic_s if departure else None
    if departure_work_s is not None and swappable and g.n_slots * len(g.saved) <= DEPARTURE_CELLS:
        if left() <= (DEPARTURE_MIN_S if anytime else 0.05):
            notes["departure_bound"] = {
                "status": "skipped",
                "reason": "deadline",
                "clock_stopped": True,
            }
        else:
            # on the second core (CP-SAT releases the GIL) while the integral relaxations run in
            # their child processes; its answer is taken at a fixed place among the starts (after
            # theirs), so the plan does not depend on which finished first
            from ..departures import departure_bound

            fits = best.sim.fits
            incumbent, hint = (best.step_time_s, best.codes) if fits else (None, None)
            # a bound this close under the plan proves it with the rest of the tolerance to spare
            enough = (
                None
                if not fits
                else best.step_time_s
                - DEPARTURE_GAP_SHARE
                * proof_tolerance_s(best.step_time_s, g.ideal_step_time_s, gap)
            )
            cap_s = DEPARTURE_CLOCK_SHARE * left() if anytime else left()
            background = _Background()
            background.start(
                lambda on_start: departure_bound(
                    g,
                    budget,
                    hw,
                    mask=problem.mask,
                    incumbent_s=incumbent,
                    hint=hint,
                    deterministic_time_s=departure_work_s,
                    time_limit_s=cap_s,
                    on_start=on_start,
                    enough_s=enough,
                    work_s=None if anytime else work.departure_s,
                    **departure_gap,
                )
            )

    first_departure: list = []  # the first run's answer, once taken

    def departure_codes() -> np.ndarray | None:
        if background is None:
            return None
        found = background.result()
        if found is None:  # a failed phase, like a native solver's crash: the others go on
            notes["departure_bound"] = {"status": "failed", "error": background.error}
            log.warning("departure bound failed: %s", departure.error)
            return None
        first_departure.append(found)
        return take_departure(found, "departure_bound")

    def take_departure(found, label: str) -> np.ndarray | None:
        """A departure bound's answer: its bound joins the proof, its decisions are a start."""
        notes[label] = {
            "status": found.status,
            "wall_s": found.wall_s,
            "step_time_s": found.step_time_s,
            "positions": found.positions,
            "binaries": found.binaries,
            "work": found.work,
            "clock_stopped": found.clock_stopped,
            **({"note": found.note} if found.note else {}),
        }
        beaten = (
            found.step_time_s is not None
            and best.sim.fits
            and found.step_time_s > best.step_time_s * (1 + 1e-9)
        )
        if (found.status == "infeasible" or beaten) and best.sim.fits:
            # a plan fits and is this fast: the relaxation cannot say otherwise; a fault of the
            # bound, not a proof
            log.warning(
                "departure bound: %s although a plan fits at %.9g s; bound ignored",
                found.status if not beaten else f"bound {found.step_time_s:.9g} s",
                best.step_time_s,
            )
            return None
        if found.step_time_s is not None and found.status != "skipped":
            raise_bound(found.step_time_s)
        codes = found.codes
        if (
            codes is not None
            and problem.mask is not None
            and not problem.mask[g.saved, codes[g.saved]].all()
        ):
            # never a start outside the allowed decisions (its rows forbid them: a fault)
            log.warning("departure bound: decisions outside the allowed ones; start dropped")
            return None
        return codes

    def closing_departure_codes() -> np.ndarray | None:
        """The departure bound again, from the best plan of the starts (often better than the
        plan the first run began from: the first run's own decisions, searched locally), capped
        just under it: showing that no point is that fast is often far less work than the
        model's optimum (FCN8 at 50%: 0.3 units against more than 3). Only where the first
        run neither failed nor solved its model to the end (then no cap changes its answer);
        one stopped within its gap did not (the 8-layer GPT-style step at 40%: the plan from its
        point is further above it than the rest of the tolerance)."""
        if not first_departure or not best.sim.fits:
            return None
        first = first_departure[0].status
        stopped_in_gap = first == "optimal" and departure_gap["gap"] > 0
        if first not in ("feasible", "timeout") and not stopped_in_gap:
            return None
        if left() <= (DEPARTURE_MIN_S if anytime else 0.05):
            notes["departure_bound_from_best"] = {
                "status": "skipped",
                "reason": "deadline",
                "clock_stopped": True,
            }
            return None
        from ..departures import departure_bound

        tolerance = proof_tolerance_s(best.step_time_s, g.ideal_step_time_s, gap)
        found = departure_bound(
            g,
            budget,
            hw,
            mask=problem.mask,
            hint=best.codes,
            incumbent_s=best.step_time_s - DEPARTURE_CLOSING_SHARE * tolerance,
            deterministic_time_s=DEPARTURE_CLOSING_WORK * departure_work_s,
            time_limit_s=DEPARTURE_CLOCK_SHARE * left() if anytime else left(),
            work_s=None if anytime else DEPARTURE_CLOSING_SHARE_OF_WORK * work.departure_s,
            **departure_gap,
        )
        return take_departure(found, "departure_bound_from_best")

    def coarse_codes() -> np.ndarray | None:
        if solve_coarse is None or g.n_ops < COARSE_MIN_OPS:
            return None
        # its share of the work (anytime: of the time limit, less where the clock has left
        # less, then noted); its own solve's clock cap is the time left
        limit, clocked = work.coarse_work_s, False
        if anytime and 0.6 * left() < limit:
            limit, clocked = 0.6 * left(), True
        if limit < COARSE_MIN_S:
            if clocked:
                notes["coarse"] = {"status": "skipped", "reason": "deadline", "clock_stopped": True}
            return None
        return coarse_start(
            problem,
            lambda small, lim: solve_coarse(
                small, lim if anytime else max(0.1, 0.9 * left()), limit
            ),
            limit,
            notes,
            clocked,
        )

    starts = (
        ("coarse plan", coarse_codes),
        ("integral LP", lambda: relaxed_codes("integral_lp")),
        ("looser integral LP", lambda: relaxed_codes("integral_lp_loose", tight=False)),
        (
            "integral LP with lane headroom",
            lambda: relaxed_codes("integral_lp_headroom", lanes=LANE_HEADROOM),
        ),
        ("departure bound", departure_codes),
        ("heuristic", lambda: h_codes),
        ("departure bound from the best plan", closing_departure_codes),
    )
    if not anytime:
        # by default two relaxations: a third root node (no work limit bounds it; ResNet50 at
        # 50%: 2 s each) put the closing departure run past a 10 s cap
        starts = tuple(item for item in starts if item[0] != "integral LP with lane headroom")
    relaxations_fail = False
    for label, make in starts:
        if (work_left is not None and work_left <= 0) or proven():
            break
        if left() <= (0.2 if anytime else 0.05) or (
            search_cap_s is not None and searched >= search_cap_s
        ):
            notes[f"skipped_from_{label.replace(' ', '_')}"] = {"clock_stopped": True}
            break
        if relaxations_fail and label not in NOT_RELAXATIONS:
            continue  # one relaxation found no integral point in its time: the others would not
        codes = make()
        if codes is None:
            relaxations_fail = label not in NOT_RELAXATIONS
            continue
        if proven():
            continue
        cap = left() if search_cap_s is None else min(left(), search_cap_s - searched)
        # the coarse plan's search gets half the work: the relaxations' starts may still do better
        allowed_work = work_left if work_left is None or label != "coarse plan" else work_left // 2
        result = improve(
            g,
            hw,
            budget,
            codes,
            time_limit_s=max(0.0, cap),
            max_work=allowed_work,
            mask=problem.mask,
        )
        searched += result.wall_s
        if work_left is not None:
            work_left -= result.work
        notes[f"local_search_from_{label.replace(' ', '_')}"] = {
            "retention": result.sim.retention,
            "fits": result.sim.fits,
            "moves": result.moves,
            "evaluations": result.evaluations,
            "wall_s": result.wall_s,
            "complete": result.complete,
            "clock_stopped": result.clock_stopped,
        }
        if _better(result.sim, best.sim):
            best = _warm(
                problem,
                result.codes,
                result.sim,
                f"{label} + local search",
                h_codes,
                h_sim,
                best.bound_s,
            )
    if background is not None and not background.taken:
        background.stop()  # the starts ended first (a proof, the work, the clock): not waited for
        notes["departure_bound"] = {"status": "stopped", "clock_stopped": False}
    best.notes = notes
    return best
