"""The departure bound: a lower bound on the step time in which swapped tensors leave whole.

The LP bound's lanes are fluid: an offload frees its bytes as they leave, and a fraction of a
tensor can be swapped. On graphs whose single copies take a large share of the forward pass
(CNNs on PCIe: one VGG activation takes 2 ms to copy in a 4.8 ms forward pass) that frees memory
no plan can free, and the LP bound leaves most of a small overhead unproven. This bound keeps
the decisions integral and the D2H lane a queue of whole tensors with release dates: a tensor
is off the device at a position only once its whole copy, behind every swapped tensor produced
before it, is done. It drops what it does not need to stay a relaxation (the H2D lane, rerun
transients, where the reruns fall), so every plan is a feasible point; CP-SAT solves it exactly
in integers. formulations/departure-bound.md names every variable and constraint used here.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.codes import keep_all_codes
from ..core.graph import ActivationGraph
from ..core.hardware import Hardware
from ..core.plan import KEEP
from ..core.status import Status
from .base import Problem
from .departure_model import DepartureData, DepartureModel
from .interrupts import solve_cpsat
from .limits import (  # tuning constants: docs/tuning.md
    ADDED_POSITIONS,
    DTIME_PER_S,
    FIRST_POSITIONS,
    MAX_BINARIES,
    PROBE_SHARE,
    ROUND_S_PER_BINARY,
    ROUND_SHARE,
)


@dataclass(frozen=True)
class DepartureBound:
    """``step_time_s``: no plan's step is shorter (None: no bound). ``codes``: the decisions of
    the relaxation's best point (a start for a plan, not a plan: its schedule is not modelled).
    ``status``: "optimal" (the relaxation solved), "feasible" (its work limit ended it, or its
    bound reached ``enough_s``; the bound is what was proven), "timeout" (the clock did), "infeasible" (no plan fits the budget),
    "skipped" (too large, ``note`` says), "trivial" (keeping everything fits at every position)."""

    status: str
    step_time_s: float | None
    ideal_step_time_s: float
    wall_s: float
    codes: np.ndarray | None
    positions: int = 0
    binaries: int = 0
    work: float = 0.0  # CP-SAT's deterministic time spent
    clock_stopped: bool = False
    note: str = ""

    @property
    def overhead_s(self) -> float | None:
        return None if self.step_time_s is None else self.step_time_s - self.ideal_step_time_s


def departure_bound(
    graph: ActivationGraph,
    budget,
    hw: Hardware | str,
    *,
    time_limit_s: float = 10.0,
    deterministic_time_s: float | None = None,
    workers: int = 1,
    seed: int = 0,
    incumbent_s: float | None = None,
    hint: np.ndarray | None = None,
    allowed=None,
    pins=None,
    mask: np.ndarray | None = None,
    max_binaries: int = MAX_BINARIES,
    gap: float = 0.0,
    min_gap_s: float = 0.0,
    enough_s: float | None = None,
    on_start: Callable[[Any], None] | None = None,
    work_s: float | None = None,
) -> DepartureBound:
    """The departure bound of ``graph`` within ``budget`` on ``hw`` (formulations/departure-bound.md).

    ``deterministic_time_s``: CP-SAT's work limit over all its rounds, the same bound on any
    machine (one worker by default: interleaved workers, CP-SAT's deterministic parallel search,
    took 5x longer to prove VGG16 at 90%); ``time_limit_s`` is the hard cap on the clock.
    ``work_s``: besides, the rounds' whole work in seconds of the reference machine, each round
    charged for its model's size (building it and CP-SAT's work beside its deterministic time,
    ROUND_S_PER_BINARY) and its deterministic time (at DTIME_PER_S): a large model's rounds stop
    on work, not on the clock (ResNet50 at 50%: rounds of 8,000 binaries).
    ``hint``: decision codes of a plan that fits; its simulated timeline is the search's first
    point. ``incumbent_s``: the step time of a known plan, which caps the overhead searched (when
    no point is under the cap, the bound is the cap, status "feasible", never "infeasible").
    ``allowed``, ``pins`` (as for ``solve``) or a ready ``mask``: the bound of the restricted
    problem. ``gap``, ``min_gap_s``: each round stops once its best point is within ``gap`` of its
    overhead (or ``min_gap_s``) of its bound; the bound stays valid, and a point within the gap
    is all a proof within a larger tolerance needs (the last fraction of a percent is most of the
    work: SegNet at 50%, 3.9 units within 0.8%, more than 12 to the end). ``enough_s``: a bound
    of at least this step time is all the caller needs (a known plan's proof): the run stops
    once it has one, status "feasible", though its model is not solved. ``on_start(solver)``
    is called before each round's search with the CP-SAT solver (a caller in another thread may
    then stop it).

    Args:
        graph: the step.
        budget: as for ``solve``.
        hw: the hardware.
        (every other option as above)

    Returns:
        The DepartureBound: the bound, its status, and its best point's decisions.

    Raises:
        ValueError: a gap, min_gap_s, enough_s or hint of the wrong form.
    """
    settings = DepartureSettings(
        time_limit_s=time_limit_s,
        deterministic_time_s=deterministic_time_s,
        work_s=work_s,
        workers=workers,
        seed=seed,
        max_binaries=max_binaries,
        gap=gap,
        min_gap_s=min_gap_s,
    )
    return departure_bound_of(
        Problem.resolve(graph, budget, hw, allowed, pins, mask),
        settings,
        incumbent_s=incumbent_s,
        hint=hint,
        enough_s=enough_s,
        on_start=on_start,
    )


@dataclass(frozen=True)
class DepartureSettings:
    """How the departure bound searches (``departure_bound``'s keywords, documented there),
    apart from the problem it bounds: checked once here."""

    time_limit_s: float = 10.0
    deterministic_time_s: float | None = None
    work_s: float | None = None
    workers: int = 1
    seed: int = 0
    max_binaries: int = MAX_BINARIES
    gap: float = 0.0
    min_gap_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("gap", "min_gap_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(
                    f"departure_bound: {name} must be a finite number >= 0, got {value!r}"
                )


def departure_bound_of(
    problem: Problem,
    settings: DepartureSettings | None = None,
    *,
    incumbent_s: float | None = None,
    hint: np.ndarray | None = None,
    enough_s: float | None = None,
    on_start: Callable[[Any], None] | None = None,
) -> DepartureBound:
    """The departure bound of a resolved problem (hardware, budget in bytes and decision mask as
    the planners hold them): what the exact planner calls, with nothing parsed again. The clock
    cap counts from this call. ``incumbent_s``, ``hint``, ``enough_s``, ``on_start``: as for
    ``departure_bound``."""
    began = time.perf_counter()
    settings = settings or DepartureSettings()
    graph = problem.graph
    if enough_s is not None and (
        isinstance(enough_s, bool) or not isinstance(enough_s, numbers.Real) or math.isnan(enough_s)
    ):
        raise ValueError(f"departure_bound: enough_s must be a number or None, got {enough_s!r}")
    if hint is not None:
        hint = np.asarray(hint)
        if hint.shape != (len(graph.tensors),):
            raise ValueError(
                f"departure_bound: hint must hold one decision code per tensor "
                f"({len(graph.tensors)}), got shape {hint.shape}"
            )
    rounds = _Rounds(
        DepartureData(graph, problem.budget_bytes, problem.hardware, problem.mask),
        began=began,
        time_limit_s=settings.time_limit_s,
        deterministic_time_s=settings.deterministic_time_s,
        work_s=settings.work_s,
        workers=settings.workers,
        seed=settings.seed,
        gap=settings.gap,
        min_gap_s=settings.min_gap_s,
        enough_s=enough_s,
        hint=hint,
        on_start=on_start,
    )
    return rounds.run(incumbent_s, settings.max_binaries)


class _Rounds:
    """Lazy constraint generation over positions (formulations/departure-bound.md, "Rounds over
    positions"): each round solves the model over some positions, a valid bound; where its
    optimum breaks another position, those join the next round, until none is broken, the work
    is spent or the clock stops it."""

    def __init__(
        self,
        data: DepartureData,
        *,
        began: float,
        time_limit_s: float,
        deterministic_time_s: float | None,
        work_s: float | None,
        workers: int,
        seed: int,
        gap: float,
        min_gap_s: float,
        enough_s: float | None,
        hint: np.ndarray | None,
        on_start: Callable[[Any], None] | None,
    ) -> None:
        self.data, self.began, self.time_limit_s = data, began, time_limit_s
        self.deterministic_time_s, self.workers, self.seed = deterministic_time_s, workers, seed
        self.gap, self.min_gap_s, self.enough_s = gap, min_gap_s, enough_s
        self.hint, self.on_start = hint, on_start
        self.ideal = data.graph.ideal_step_time_s
        self.cap = 2**40
        self.spent, self.rounds, self.best_bound = 0.0, 0, self.ideal
        self.codes: np.ndarray | None = None
        self.work_left = None if work_s is None else float(work_s)
        self.build_s_per_binary: float | None = None  # a round's build is outside CP-SAT's clock
        self.sizes: dict[str, Any] = {}

    def result(self, status, bound=None, codes=None, note="", **kw) -> DepartureBound:
        elapsed = time.perf_counter() - self.began
        return DepartureBound(status, bound, self.ideal, elapsed, codes, note=note, **kw)

    def run(self, incumbent_s: float | None, max_binaries: int) -> DepartureBound:
        """The rounds, from the positions most over the budget (after a probe of the one most
        over it alone), until one returns the bound."""
        data, graph, ideal = self.data, self.data.graph, self.ideal
        keep_all: np.ndarray | None = keep_all_codes(graph)
        if data.mask is not None and not data.mask[graph.saved, KEEP].all():
            keep_all = None  # a tensor may not be kept: keeping everything is no start
        if not data.critical:
            return self.result(
                Status.TRIVIAL,
                ideal,
                keep_all,
                note="keeping every tensor fits the budget at every position",
            )
        if data.binaries(data.critical) > max_binaries:
            return self.result(
                Status.SKIPPED,
                note=f"{data.binaries(data.critical)} departed_by binaries (over {max_binaries})",
                positions=len(data.critical),
                binaries=data.binaries(data.critical),
            )
        if not data.tu > 0:
            return self.result(Status.TRIVIAL, ideal, keep_all, note="a step of no time")
        if incumbent_s is not None and np.isfinite(incumbent_s):
            self.cap = data.up(incumbent_s - ideal) + 1  # every plan no slower fits under it
        # positions_added: the positions most over the budget first; a round's optimum is a
        # valid bound (fewer rows relax), and where it breaks another position, those join the
        # next round
        by_excess = sorted(data.critical, key=lambda k: (-data.excess[k], k))
        first = set(by_excess[:FIRST_POSITIONS]) | {data.critical[0]}
        # the probe: the position most over the room alone, for a small share of the work;
        # often its optimum is already the bound
        probe = PROBE_SHARE > 0 and len(data.critical) > 1
        positions = {by_excess[0]} if probe else first
        while True:
            self.rounds += 1
            whole = not probe and len(positions) == len(data.critical)
            stopped = self.before_round(positions)
            if stopped is not None:
                return stopped
            done, broken = self.solve_round(positions, probe, whole)
            if done is not None:
                return done
            if probe:  # the first round proper, whatever the probe broke
                probe, positions = False, first
            elif broken is None:  # the round's share ran out: every position, the work left
                positions = set(data.critical)
            else:
                # the rows the completion misses by the most first, as a cutting-plane loop adds
                # its most violated cuts (formulations/departure-bound.md, "Rounds over
                # positions")
                positions.update(sorted(broken, key=lambda k: (-broken[k], k))[:ADDED_POSITIONS])

    def before_round(self, positions: set[int]) -> DepartureBound | None:
        """The bound so far where the next round's model would not be built within the clock
        cap (a loaded machine: said so, rather than a late answer) or would pass the work
        left; None to go on."""
        binaries = self.data.binaries(sorted(positions))
        if (
            self.build_s_per_binary is not None
            and time.perf_counter() - self.began + self.build_s_per_binary * binaries
            >= 0.95 * self.time_limit_s
        ):
            return self.result(
                Status.TIMEOUT,
                self.best_bound,
                self.codes,
                note=f"{self.rounds - 1} rounds",
                **{**self.sizes, "clock_stopped": True},
            )
        if self.work_left is not None and self.work_left <= ROUND_S_PER_BINARY * binaries:
            # its model alone would pass the work left: the bound so far (its work, not a clock)
            return self.result(
                Status.FEASIBLE,
                self.best_bound,
                self.codes,
                note=f"{self.rounds - 1} rounds, work spent",
                **self.sizes,
            )
        return None

    def solver_for(self, model: DepartureModel, probe: bool, whole: bool):
        """CP-SAT with this round's limits: the clock left, and its share of the work."""
        from ortools.sat.python import cp_model

        solver = cp_model.CpSolver()
        solver.parameters.num_workers = int(self.workers)
        solver.parameters.random_seed = int(self.seed)
        # its linear relaxation with the Boolean rows too: proofs in half the work
        solver.parameters.linearization_level = 2
        # CP-SAT's relative gap is on its objective, the overhead in units
        solver.parameters.relative_gap_limit = float(self.gap)
        solver.parameters.absolute_gap_limit = math.floor(self.min_gap_s / self.data.tu)
        clock_left = self.time_limit_s - (time.perf_counter() - self.began)
        solver.parameters.max_time_in_seconds = max(0.05, clock_left)
        total = self.deterministic_time_s
        if total is not None:
            # a round over some positions gets a share; the round over all gets what is left
            share = PROBE_SHARE if probe else 1.0 if whole else ROUND_SHARE
            round_dtime = min(total - self.spent, share * total)
            if self.work_left is not None:
                self.work_left -= ROUND_S_PER_BINARY * model.binaries
                round_dtime = min(round_dtime, DTIME_PER_S * self.work_left)
            solver.parameters.max_deterministic_time = max(0.01, round_dtime)
            solver.parameters.interleave_search = self.workers > 1
        return solver

    def solve_round(
        self, positions: set[int], probe: bool, whole: bool
    ) -> tuple[DepartureBound | None, dict[int, int] | None]:
        """One round: its model built and solved. Returns the bound when this round ends the
        search, else None and the positions its optimum breaks (None: not solved to the end)."""
        from ortools.sat.python import cp_model

        data, ideal, cap = self.data, self.ideal, self.cap
        build_began = time.perf_counter()
        model = DepartureModel(data, sorted(positions))
        model.cp.add(model.overhead <= cap)
        if self.hint is not None:
            model.add_hint(self.hint)
        self.build_s_per_binary = (time.perf_counter() - build_began) / max(1, model.binaries)
        solver = self.solver_for(model, probe, whole)
        if self.on_start is not None:
            self.on_start(solver)
        solve_began = time.perf_counter()
        status = solve_cpsat(solver, model.cp)
        self.spent += solver.deterministic_time
        if self.work_left is not None:
            self.work_left -= solver.deterministic_time / DTIME_PER_S
        clocked = (
            status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE)
            and time.perf_counter() - solve_began >= 0.95 * solver.parameters.max_time_in_seconds
        )
        if status == cp_model.MODEL_INVALID:
            raise RuntimeError(f"departure bound: CP-SAT rejected the model: {model.cp.validate()}")
        sizes = self.sizes = {
            "positions": len(positions),
            "binaries": model.binaries,
            "work": self.spent,
            "clock_stopped": clocked,
        }
        rounds = self.rounds
        if status == cp_model.INFEASIBLE:
            if cap < 2**40:
                # capped at incumbent_s: no point that fast, so every plan is slower than cap
                # units (its point has at most ceil(overhead / unit)); not "no plan fits"
                note = f"no plan is as fast as incumbent_s ({rounds} rounds)"
                bound = ideal + cap * data.tu
                return self.result(Status.FEASIBLE, bound, self.codes, note=note, **sizes), None
            note = "no plan fits the budget at some position"
            return self.result(Status.INFEASIBLE, note=note, **sizes), None
        # the integer optimum is at most ceil(true overhead / unit): one unit below its bound is
        # below every plan's overhead (and fewer positions only relax: each round's is a bound)
        found = ideal + max(0.0, (solver.best_objective_bound - 1) * data.tu)
        self.best_bound = best_bound = max(self.best_bound, found)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            self.codes = model.decisions(solver)
        codes = self.codes
        broken = model.broken_positions(solver) if status == cp_model.OPTIMAL else None
        if broken == {}:
            return self.result(
                Status.OPTIMAL, best_bound, codes, note=f"{rounds} rounds", **sizes
            ), None
        if self.enough_s is not None and best_bound >= self.enough_s:
            note = f"enough_s reached ({rounds} rounds)"
            return self.result(Status.FEASIBLE, best_bound, codes, note=note, **sizes), None
        total = self.deterministic_time_s
        spent_out = (total is not None and self.spent >= total * (1 - 1e-9)) or (
            self.work_left is not None and self.work_left <= 0.01
        )
        late = time.perf_counter() - self.began >= 0.95 * self.time_limit_s
        if whole or spent_out or clocked or late:
            clocked = clocked or not spent_out and not whole
            stopped = self.result(
                Status.TIMEOUT if clocked else Status.FEASIBLE,
                best_bound,
                codes,
                note=f"{rounds} rounds",
                **{**sizes, "clock_stopped": clocked},
            )
            return stopped, None
        return None, broken
