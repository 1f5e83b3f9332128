"""The warm start's search over starts (formulations/milp.md, "Solving", step 2): each start's
decisions (the coarse plan, the integral relaxations, the departure bound, the heuristic's, the
departure bound again from the best plan) are improved by local search, the fastest plan kept,
and each relaxation's or departure run's bound joins the proof. A start is tried only while the
plan is not yet proven within the gap of the best known bound, and while the work and the clock
allow. warmstart.py's ``warm_start`` runs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from ...core.plan import STEP_FLOOR, SWAP, proof_tolerance_s
from ...core.status import Status
from ..base import Problem
from ..limits import (
    COARSE_MIN_OPS,
    COARSE_MIN_S,
    DEPARTURE_CELLS,
    DEPARTURE_CLOCK_SHARE,
    DEPARTURE_CLOSING_SHARE,
    DEPARTURE_CLOSING_SHARE_OF_WORK,
    DEPARTURE_CLOSING_WORK,
    DEPARTURE_GAP_SHARE,
    DEPARTURE_MIN_S,
    LANE_HEADROOM,
    RELAX_CELL_WEIGHT_WITHOUT_SWAP,
    RELAXATION_GAP,
    RELAXATION_HIGHS,
    RELAXATION_MIN_S,
    Clock,
    WorkLimits,
)
from ..local_search import improve
from .warmstart import (
    Background,
    WarmStart,
    better,
    coarse_start,
    integral_codes,
    warm_from,
)

log = logging.getLogger("slackswap")

# starts whose decisions do not come from an integral relaxation: one relaxation that finds no
# integral point in its work means the others would not either, but these are still tried
NOT_RELAXATIONS = (
    "heuristic",
    "rounded LP",
    "coarse plan",
    "departure bound",
    "departure bound from the best plan",
)


def relaxation_cells(problem: Problem) -> float:
    """The integral relaxation's size in cells (positions x saved tensors), a tensor that may
    not swap weighing RELAX_CELL_WEIGHT_WITHOUT_SWAP of one that may (it has no lane rows)."""
    g, mask = problem.graph, problem.mask
    swappable = len(g.saved) if mask is None else int(mask[g.saved, SWAP].sum())
    others = len(g.saved) - swappable
    return g.n_positions * (swappable + RELAX_CELL_WEIGHT_WITHOUT_SWAP * others)


class StartSearch:
    """The best plan so far (``best``), the bound it is held against, and each start's notes."""

    def __init__(
        self,
        problem: Problem,
        best: WarmStart,
        *,
        bound_s: float | None,
        gap: float,
        work: WorkLimits,
        clock: Clock,
        solve_coarse: Callable[[Problem, float, float], Any] | None,
        departure: bool,
    ) -> None:
        self.problem, self.best, self.bound_s, self.gap = problem, best, bound_s, gap
        self.work, self.clock, self.solve_coarse = work, clock, solve_coarse
        self.anytime = work.anytime
        self.notes: dict[str, Any] = {}
        self.background: Background | None = None
        self.first_departure: list = []  # the first departure run's answer, once taken
        # a departure run stops within a share of the proof tolerance: the plan from its point
        # then needs only the rest (formulations/departure-bound.md, "Solving it"); none when
        # the search is to the end (gap 0)
        g = problem.graph
        self.departure_gap = {
            "gap": DEPARTURE_GAP_SHARE * gap,
            "min_gap_s": DEPARTURE_GAP_SHARE * STEP_FLOOR * g.ideal_step_time_s if gap > 0 else 0.0,
        }
        self.departure_work_s = work.departure_deterministic_s if departure else None

    def left(self) -> float:
        return self.clock.left()

    def proven(self) -> bool:
        """The best plan is within the gap of its overhead of the best known bound."""
        best, g = self.best, self.problem.graph
        known = [b for b in (self.bound_s, best.bound_s) if b is not None]
        return (
            bool(known)
            and best.sim.fits
            and best.step_time_s - max(known)
            <= proof_tolerance_s(best.step_time_s, g.ideal_step_time_s, self.gap)
        )

    def raise_bound(self, step_s: float) -> None:
        best = self.best
        best.bound_s = step_s if best.bound_s is None else max(best.bound_s, step_s)

    # ------------------------------------------------------------------ the starts
    def relaxed_codes(
        self, label: str, lanes: float = 1.0, tight: bool = True
    ) -> np.ndarray | None:
        """The integral relaxation's decisions (lpbound.py, ``integral=True``); on the real lanes
        and with the producer delay its bound joins the proof."""
        from ..lpbound import LPSettings, lp_bound_of

        problem, work, anytime, notes = self.problem, self.work, self.anytime, self.notes
        g, hw = problem.graph, problem.hardware
        if not anytime and relaxation_cells(problem) > work.relax_cells:
            # its root node alone would pass the work allowed (decided by size, not the clock)
            notes[label] = {
                "status": Status.SKIPPED,
                "reason": "model too large for the work",
                "clock_stopped": False,
            }
            return None
        if self.left() <= (RELAXATION_MIN_S + 2 * 4e-4 * g.n_positions if anytime else 0.1):
            notes[label] = {"status": Status.SKIPPED, "reason": "deadline", "clock_stopped": True}
            return None
        planning_hw = (
            hw
            if lanes == 1.0
            else hw.with_link(
                d2h_bytes_per_s=hw.d2h_bytes_per_s * lanes,
                h2d_bytes_per_s=hw.h2d_bytes_per_s * lanes,
            )
        )
        left = self.left()
        cap = max(0.1, min(work.relax_cap_s, 0.6 * left)) if anytime else max(0.1, left)
        deadline = self.clock.deadline
        relaxation = lp_bound_of(
            replace(problem, hardware=planning_hw),
            LPSettings(
                integral=True,
                time_limit_s=cap,
                gap=RELAXATION_GAP,
                max_nodes=work.relax_nodes,
                highs_options=None if anytime else RELAXATION_HIGHS,
                producer_delay=tight,
                gap_on_step=False,
                kill_after_s=None
                if deadline is None
                else max(0.1, self.left() - (1.0 if anytime else 0.0)),
            ),
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
            and relaxation.status in (Status.OPTIMAL, Status.TIMEOUT)
            and np.isfinite(relaxation.step_time_s)
        ):
            self.raise_bound(relaxation.step_time_s)  # the real lanes: a valid bound
        return integral_codes(problem, relaxation) if relaxation.keep else None

    def start_departure(self) -> None:
        """The departure bound (planners/departures.py) started in the background, on the second
        core (CP-SAT releases the GIL) while the integral relaxations run in their child
        processes; its answer is taken at a fixed place among the starts (after theirs), so the
        plan does not depend on which finished first."""
        problem, notes, anytime = self.problem, self.notes, self.anytime
        g = problem.graph
        # with no tensor allowed to swap there is no copy lane for it to see: the LP bound and
        # the integral relaxation cover that case
        swappable = problem.mask is None or bool(problem.mask[g.saved, SWAP].any())
        work_s = self.departure_work_s
        if work_s is None or not swappable or g.n_positions * len(g.saved) > DEPARTURE_CELLS:
            return
        if self.left() <= (DEPARTURE_MIN_S if anytime else 0.05):
            notes["departure_bound"] = {
                "status": Status.SKIPPED,
                "reason": "deadline",
                "clock_stopped": True,
            }
            return
        from ..departures import DepartureSettings, departure_bound_of

        best = self.best
        fits = best.sim.fits
        incumbent, hint = (best.step_time_s, best.codes) if fits else (None, None)
        # a bound this close under the plan proves it with the rest of the tolerance to spare
        enough = (
            None
            if not fits
            else best.step_time_s
            - DEPARTURE_GAP_SHARE
            * proof_tolerance_s(best.step_time_s, g.ideal_step_time_s, self.gap)
        )
        cap_s = DEPARTURE_CLOCK_SHARE * self.left() if anytime else self.left()
        full_work_s = None if anytime else self.work.departure_s
        gaps = self.departure_gap
        self.background = Background()
        self.background.start(
            lambda on_start: departure_bound_of(
                problem,
                DepartureSettings(
                    deterministic_time_s=work_s,
                    time_limit_s=cap_s,
                    work_s=full_work_s,
                    gap=gaps["gap"],
                    min_gap_s=gaps["min_gap_s"],
                ),
                incumbent_s=incumbent,
                hint=hint,
                on_start=on_start,
                enough_s=enough,
            )
        )

    def departure_codes(self) -> np.ndarray | None:
        """The background departure run's answer, taken now."""
        background = self.background
        if background is None:
            return None
        found = background.result()
        if found is None:  # a failed phase, like a native solver's crash: the others go on
            self.notes["departure_bound"] = {"status": Status.FAILED, "error": background.error}
            log.warning("departure bound failed: %s", background.error)
            return None
        self.first_departure.append(found)
        return self.take_departure(found, "departure_bound")

    def take_departure(self, found, label: str) -> np.ndarray | None:
        """A departure bound's answer: its bound joins the proof, its decisions are a start."""
        problem, best = self.problem, self.best
        g = problem.graph
        self.notes[label] = {
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
        if (found.status == Status.INFEASIBLE or beaten) and best.sim.fits:
            # a plan fits and is this fast: the relaxation cannot say otherwise; a fault of the
            # bound, not a proof
            log.warning(
                "departure bound: %s although a plan fits at %.9g s; bound ignored",
                found.status if not beaten else f"bound {found.step_time_s:.9g} s",
                best.step_time_s,
            )
            return None
        if found.step_time_s is not None and found.status != Status.SKIPPED:
            self.raise_bound(found.step_time_s)
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

    def closing_departure_codes(self) -> np.ndarray | None:
        """The departure bound again, from the best plan of the starts (often better than the
        plan the first run began from: the first run's own decisions, searched locally), capped
        just under it: showing that no point is that fast is often far less work than the
        model's optimum. Only where the first run neither failed nor solved its model to the
        end (then no cap changes its answer); one stopped within its gap did not (the plan from
        its point may be further above it than the rest of the tolerance)."""
        best, problem, anytime = self.best, self.problem, self.anytime
        if not self.first_departure or not best.sim.fits:
            return None
        first = self.first_departure[0].status
        stopped_in_gap = first == Status.OPTIMAL and self.departure_gap["gap"] > 0
        if first not in (Status.FEASIBLE, Status.TIMEOUT) and not stopped_in_gap:
            return None
        if self.left() <= (DEPARTURE_MIN_S if anytime else 0.05):
            self.notes["departure_bound_from_best"] = {
                "status": Status.SKIPPED,
                "reason": "deadline",
                "clock_stopped": True,
            }
            return None
        from ..departures import DepartureSettings, departure_bound_of

        g = problem.graph
        assert self.departure_work_s is not None  # a first run was taken
        tolerance = proof_tolerance_s(best.step_time_s, g.ideal_step_time_s, self.gap)
        found = departure_bound_of(
            problem,
            DepartureSettings(
                deterministic_time_s=DEPARTURE_CLOSING_WORK * self.departure_work_s,
                time_limit_s=DEPARTURE_CLOCK_SHARE * self.left() if anytime else self.left(),
                work_s=None if anytime else DEPARTURE_CLOSING_SHARE_OF_WORK * self.work.departure_s,
                gap=self.departure_gap["gap"],
                min_gap_s=self.departure_gap["min_gap_s"],
            ),
            hint=best.codes,
            incumbent_s=best.step_time_s - DEPARTURE_CLOSING_SHARE * tolerance,
        )
        return self.take_departure(found, "departure_bound_from_best")

    def coarse_codes(self) -> np.ndarray | None:
        """A large graph of repeated blocks: the plan of a coarse copy (coarse_start)."""
        problem, anytime, solve_coarse = self.problem, self.anytime, self.solve_coarse
        if solve_coarse is None or problem.graph.n_ops < COARSE_MIN_OPS:
            return None
        # its share of the work (anytime: of the time limit, less where the clock has left
        # less, then noted); its own solve's clock cap is the time left
        limit, clocked = self.work.coarse_work_s, False
        if anytime and 0.6 * self.left() < limit:
            limit, clocked = 0.6 * self.left(), True
        if limit < COARSE_MIN_S:
            if clocked:
                self.notes["coarse"] = {
                    "status": Status.SKIPPED,
                    "reason": "deadline",
                    "clock_stopped": True,
                }
            return None
        return coarse_start(
            problem,
            lambda small, lim: solve_coarse(
                small, lim if anytime else max(0.1, 0.9 * self.left()), limit
            ),
            limit,
            self.notes,
            clocked,
        )

    # ------------------------------------------------------------------ the search
    def starts(self) -> tuple[tuple[str, Callable[[], np.ndarray | None]], ...]:
        """The starts in the order they are tried."""
        h_codes = self.best.heuristic_codes
        starts: tuple[tuple[str, Callable[[], np.ndarray | None]], ...] = (
            ("coarse plan", self.coarse_codes),
            ("integral LP", lambda: self.relaxed_codes("integral_lp")),
            ("looser integral LP", lambda: self.relaxed_codes("integral_lp_loose", tight=False)),
            (
                "integral LP with lane headroom",
                lambda: self.relaxed_codes("integral_lp_headroom", lanes=LANE_HEADROOM),
            ),
            ("departure bound", self.departure_codes),
            ("heuristic", lambda: h_codes),
            ("departure bound from the best plan", self.closing_departure_codes),
        )
        if not self.anytime:
            # by default two relaxations: a third root node (no work limit bounds it) put the
            # closing departure run past the default time limit
            starts = tuple(item for item in starts if item[0] != "integral LP with lane headroom")
        return starts

    def run(self) -> WarmStart:
        """Each start in turn, improved by local search; the best plan, with the notes. The
        background search is stopped and joined however the starts end: a KeyboardInterrupt
        must not leave a native search running in a thread while the interpreter exits (its
        threads would be destroyed running: "terminate called", SIGABRT)."""
        try:
            return self._run()
        finally:
            background = self.background
            if background is not None and not background.taken:
                background.stop()

    def _run(self) -> WarmStart:
        problem, notes, anytime = self.problem, self.notes, self.anytime
        g, hw, budget = problem.graph, problem.hardware, problem.budget_bytes
        work_left = self.work.search_work
        search_cap_s = self.work.search_cap_s
        searched = 0.0
        self.start_departure()
        relaxations_fail = False
        for label, make in self.starts():
            if (work_left is not None and work_left <= 0) or self.proven():
                break
            if self.left() <= (0.2 if anytime else 0.05) or (
                search_cap_s is not None and searched >= search_cap_s
            ):
                notes[f"skipped_from_{label.replace(' ', '_')}"] = {"clock_stopped": True}
                break
            if relaxations_fail and label not in NOT_RELAXATIONS:
                continue  # one relaxation found no integral point in its time: the others neither
            codes = make()
            if codes is None:
                relaxations_fail = label not in NOT_RELAXATIONS
                continue
            if self.proven():
                continue
            left = self.left()
            cap = left if search_cap_s is None else min(left, search_cap_s - searched)
            # the coarse plan's search gets half the work: the relaxations' starts may still do
            # better
            allowed_work = (
                work_left if work_left is None or label != "coarse plan" else work_left // 2
            )
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
            best = self.best
            if better(result.sim, best.sim):
                self.best = warm_from(
                    problem,
                    result.codes,
                    result.sim,
                    f"{label} + local search",
                    best.heuristic_codes,
                    best.heuristic_sim,
                    best.bound_s,
                )
        background = self.background
        if background is not None and not background.taken:
            background.stop()  # the starts ended first (a proof, the work, the clock)
            notes["departure_bound"] = {"status": Status.STOPPED, "clock_stopped": False}
        self.best.notes = notes
        return self.best
