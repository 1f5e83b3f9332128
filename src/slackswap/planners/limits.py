"""How much each phase of the planners may work, and the clock's one role: a hard cap. The
planners' tuning constants live here, one line each on why (what each was measured on:
docs/tuning.md).

By default every phase stops on a work limit that does not depend on the machine or its load:
CP-SAT's deterministic time, HiGHS's branch-and-bound nodes and simplex iterations, PIQP's
iterations, the local search's simulated positions. Whether a phase runs at all is decided from
the problem's size and the work allowed, never from the time left. The same input and ``work_s``
then give the same plan, schedule, status and bound on any machine that finishes the work before
the time limit. The time limit is only a hard cap: a phase it stops or skips is named in
``plan.info.extra["clock_stopped"]`` and the plan's status is "timeout" (formulations/milp.md,
"Solving").

``anytime=True`` is the other way: each phase gets a share of the time left, so a faster or
idler machine searches further (and two runs may differ).

The rates below are this project's reference machine's (2 cores) with another busy process
beside the planner, so that the default work (``work_s`` equal to the time limit, 10 s) ends
within the limit there (benchmarks/RESULTS.md, "Deterministic by default").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

DEFAULT_TIME_LIMIT_S = 10.0
NO_DEADLINE_S = 1e6

# --- rates of the reference machine, loaded (one busy process beside the planner); what each
# was measured on: docs/tuning.md ---
# CP-SAT's deterministic time per second with 2 interleaved workers
CPSAT_DTIME_PER_S = 0.25
# the least deterministic time a CP-SAT search is given (a MILP round whose model's size alone
# passes its work is not run: WorkLimits.cpsat_round_runs)
CPSAT_DTIME_FLOOR = 0.05
# simulated positions per second of local search
SEARCH_POSITIONS_PER_S = 100_000
# branch-and-bound nodes per second of the MILP through CBC or HiGHS (one thread; their only
# work limit there)
MILP_NODES_PER_S = 20
# HiGHS branch-and-bound nodes per second of an integral relaxation (a large model's root node
# is charged by its size, RELAX_CELLS_PER_S)
RELAX_NODES_PER_S = 5
# positions x saved tensors an integral relaxation's root node handles per second of work: a
# larger model is not started (its root alone would pass the work allowed)
RELAX_CELLS_PER_S = 125_000
# a tensor that may not swap weighs this share of a cell: it has no lane rows (HF Llama and
# GPT-2 of 12 layers, 376,000-492,000 cells, a root node of 0.35 s keep/recompute only against
# 1.45-1.47 s with swaps)
RELAX_CELL_WEIGHT_WITHOUT_SWAP = 0.25
# simplex iterations per second of the LP bound (dual simplex; a limit that a model it can solve
# in its share never reaches)
LP_ITERATIONS_PER_S = 200_000
# building the MILP, per position
BUILD_S_PER_POSITION = 6e-4
# building and solving the LP bound, per position: dual simplex and, past IPM_FROM_POSITIONS
# positions, PIQP's interior point
LP_S_PER_POSITION = 3e-4
LP_IPM_S_PER_POSITION = 1e-3
# CP-SAT's work beside its deterministic time, per nonzero of the model (building, presolve,
# the first LP)
CPSAT_S_PER_NONZERO = 2e-5

# --- shares of the work ---
SEARCH_SHARE = 0.45  # all local searches together (cheap on the CNN rows)
RELAX_SHARE = 0.15  # each integral relaxation
MILP_SHARE = 0.25  # the MILP (all its rounds)
PROOF_SHARE = 0.2  # the proof round (CP-SAT over every position; small models only, PROOF_CELLS)
LP_SHARE = 0.5  # the LP bound: most of it, since without a bound nothing is proven
BUILD_SHARE = 0.25  # a model (LP, MILP) whose build alone is estimated above this is not built
COARSE_SHARE = 0.3  # a large graph's coarse copy, solved first
# the departure bound's work (it runs beside the integral relaxations), each run
DEPARTURE_SHARE = 0.45
# the departure bound's CP-SAT deterministic time per second of work (one worker), and at most
DEPARTURE_DTIME_SHARE = 0.2
DEPARTURE_DTIME_MAX = 12.0

# --- the solve strategy's thresholds (strategy.py; formulations/milp.md, "Solving") ---
# a model of at most this many binaries is solved whole, a larger one LP-guided
WHOLE_MODEL_BINARIES = 2500
# an LP-guided round that would leave at most this share of the tensors free searches the model
# whole instead (milp.md, "Solving")
LP_GUIDED_MIN_FREE = 0.05
# the proof round: the model over every position, when a plan is not proven, on graphs of at
# most this many positions x saved tensors (SegNet: 176 x 65) and nonzeros
PROOF_CELLS = 12_000
PROOF_NONZEROS = 400_000

# --- the warm start's starts (warmstart.py, start_search.py) ---
# the second integral relaxation plans with copy lanes this much slower: decisions that leave the
# lanes some headroom for what the fluid model does not see (whole tensors, in production order)
LANE_HEADROOM = 0.98
# each relaxation runs until its decisions are proven within this fraction of the step (a point
# HiGHS reaches by the same path on any machine); the clock is only a cap
RELAXATION_GAP = 1e-4
RELAXATION_CAP_S = 20.0
# by default the relaxations run without HiGHS's sub-MIP heuristics (RINS, RENS): they were most
# of the root node's time for the same bound and nearly the same decisions on the CNN rows; the
# root node has no other work limit
RELAXATION_HIGHS = {"mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False}
RELAXATION_MIN_S = 1.5  # less time left than this: the relaxation is not started
HEURISTIC_POLISH_S = 2.0  # less time left than this: the restricted heuristics without polish
# less time left than this: the heuristic itself without its polish (at most POLISH_POSITIONS
# simulated positions) and the bundled pricing
HEURISTIC_MAIN_POLISH_S = 0.4
# less time left than this: the heuristic's polish does not search on with more work where no
# candidate fits (heuristic.UNFIT_POLISH_FACTOR times its usual work)
HEURISTIC_UNFIT_POLISH_S = 8.0
# less time left than this per position: the heuristic runs without its bundled pricing either
# (three runs and their simulations)
HEURISTIC_BUNDLE_S_PER_POSITION = 1e-4


# the coarse start (coarse_start): graphs of fewer ops are searched whole; its coarse graph has
# about COARSE_OPS_PER_S ops per second of its limit, at most COARSE_MAX_OPS, at least
# COARSE_MIN_BLOCKS blocks and at most 1 / COARSE_RATIO of the original's
COARSE_MIN_OPS = 1500
COARSE_OPS_PER_S = 20
COARSE_MAX_OPS = 650
COARSE_MIN_BLOCKS = 4
COARSE_RATIO = 4
COARSE_MIN_S = 5.0
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
# after the relaxations, whose root nodes no work limit bounds
DEPARTURE_CLOSING_SHARE_OF_WORK = 0.5
# each departure run stops within this share of the proof tolerance of its bound
DEPARTURE_GAP_SHARE = 0.8

# --- the clock (the hard cap, and the anytime mode's shares of it) ---
MIN_SEARCH_S = 0.3  # anytime: below this much time left, no MILP is built
MIN_PROOF_S = 1.0  # anytime: less time left than this, no proof round
# anytime: the LP bound's share of the time left, and what a phase costs before it can stop on
# its own, per position (a phase is started only when the time left covers it)
ANYTIME_LP_SHARE = 0.8
ANYTIME_LP_S_PER_POSITION = 4e-4  # building the LP bound
ANYTIME_FORMULATE_S_PER_POSITION = 4e-4  # building the MILP
# solve()'s closing, checking and simulating after the search, per position: taken off the
# time limit so that the whole call keeps it
CLOSE_S_PER_POSITION = 5e-5


@dataclass(frozen=True)
class WorkLimits:
    """The work each phase may do, fixed by ``work_s`` alone (seconds of the reference machine,
    loaded): the same on every machine. ``anytime``: the phases share the clock instead."""

    work_s: float
    anytime: bool
    relax_nodes: int | None  # branch-and-bound nodes of each integral relaxation
    relax_cells: int  # the largest model (positions x saved tensors) a relaxation is built for
    relax_cap_s: float  # anytime: each relaxation's clock cap
    search_cap_s: float | None  # anytime: the local searches' clock cap
    search_work: int  # simulated positions, all local searches together
    lp_iterations: int | None  # the LP bound's simplex iterations
    milp_s: float  # the MILP's work (all its rounds), in seconds (cpsat_dtime converts it)
    proof_s: float  # the proof round's
    departure_deterministic_s: float  # the departure bound's (CP-SAT, one worker)
    departure_s: float  # and its whole work, its models' sizes charged (departures.work_s)
    coarse_work_s: float  # the coarse copy's solve

    @classmethod
    def for_work(
        cls, work_s: float, anytime: bool = False, time_limit_s: float | None = None
    ) -> WorkLimits:
        """Deterministic limits for ``work_s``; with ``anytime``, today's clock shares of
        ``time_limit_s`` (default ``work_s``) where a phase has no work limit."""
        limit = work_s if time_limit_s is None else time_limit_s
        departure = min(DEPARTURE_DTIME_SHARE * work_s, DEPARTURE_DTIME_MAX)
        if anytime:
            search_s = min(15.0, 0.45 * limit)
            return cls(
                work_s=work_s,
                anytime=True,
                relax_nodes=None,
                relax_cells=10**12,
                relax_cap_s=min(5.0, 0.15 * limit) + 0.7,
                search_cap_s=2.0 * search_s,
                search_work=int(100_000 * search_s),
                lp_iterations=None,
                milp_s=0.6 * limit,
                proof_s=limit,
                departure_deterministic_s=min(0.2 * limit, DEPARTURE_DTIME_MAX),
                departure_s=float("inf"),
                coarse_work_s=COARSE_SHARE * limit,
            )
        return cls(
            work_s=work_s,
            anytime=False,
            relax_nodes=max(1, int(RELAX_NODES_PER_S * RELAX_SHARE * work_s)),
            relax_cells=int(RELAX_CELLS_PER_S * RELAX_SHARE * work_s),
            relax_cap_s=float("inf"),
            search_cap_s=None,
            search_work=int(SEARCH_POSITIONS_PER_S * SEARCH_SHARE * work_s),
            lp_iterations=max(1000, int(LP_ITERATIONS_PER_S * LP_SHARE * work_s)),
            milp_s=MILP_SHARE * work_s,
            proof_s=PROOF_SHARE * work_s,
            departure_deterministic_s=departure,
            departure_s=DEPARTURE_SHARE * work_s,
            coarse_work_s=COARSE_SHARE * work_s,
        )

    def builds(self, n_positions: int) -> bool:
        """Whether the MILP over ``n_positions`` positions is worth building: its build alone,
        estimated from its size, fits the work allowed (never the clock)."""
        return self.anytime or BUILD_S_PER_POSITION * n_positions <= BUILD_SHARE * self.work_s

    def solves_lp(self, n_positions: int, ipm_from_positions: int) -> bool:
        """Whether the LP bound over ``n_positions`` positions fits its share of the work (an
        estimate from its size; anytime: the caller looks at the clock)."""
        per_position = (
            LP_IPM_S_PER_POSITION if n_positions > ipm_from_positions else LP_S_PER_POSITION
        )
        return self.anytime or per_position * n_positions <= LP_SHARE * self.work_s

    def milp_nodes(self, seconds: float) -> int | None:
        """CBC's or HiGHS's branch-and-bound nodes for ``seconds`` of the MILP (anytime: none,
        the clock alone)."""
        return None if self.anytime else max(1, int(MILP_NODES_PER_S * seconds))

    def backend_options(self, work_limit: str, seconds: float, nonzeros: int) -> dict[str, Any]:
        """``seconds`` of work (of the reference machine) as an exact backend's own limit
        (``ExactBackend.work_limit``): CP-SAT's deterministic time, or branch-and-bound nodes."""
        if work_limit == "deterministic_time":
            return {"deterministic_time_s": self.cpsat_dtime(seconds, nonzeros)}
        return {"max_nodes": self.milp_nodes(seconds)}

    def cpsat_round_runs(self, seconds: float, nonzeros: int) -> bool:
        """Whether a CP-SAT round (one of the MILP's, or the proof round) with ``seconds`` of
        work on a model of ``nonzeros`` is run:
        not where its size-bound work alone (building, presolve, the first LP:
        CPSAT_S_PER_NONZERO a nonzero) passes those seconds, when ``cpsat_dtime``'s floor alone
        would give it work. On HF profiles of 6 and 12 layers (63,000-118,000 nonzeros, 1.25 s
        of work a round) such rounds took 2.4-6.8 s of presolve each and never bettered the
        warm start (formulations/milp.md, "Solving"); since ``start_bounds`` and the no-swap
        cuts those models have 26,000-59,000 nonzeros and a presolve of under a second, and
        their rounds run. Decided from the size and the work, never the clock; anytime:
        always."""
        return self.anytime or CPSAT_S_PER_NONZERO * nonzeros <= seconds

    def cpsat_dtime(self, seconds: float, nonzeros: int) -> float:
        """CP-SAT's deterministic time for ``seconds`` of work on a model of ``nonzeros``: what
        is left once its size-bound work is paid (anytime: the older rate alone, 0.25 a
        second)."""
        if self.anytime:
            return 0.25 * seconds
        return max(
            CPSAT_DTIME_FLOOR, CPSAT_DTIME_PER_S * (seconds - CPSAT_S_PER_NONZERO * nonzeros)
        )

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Clock:
    """The hard cap on the wall clock (a ``time.perf_counter()`` deadline, None: none) and the
    phases it stopped or skipped. A phase checks ``passed()`` before it starts and gets
    ``left()`` as its own cap; in the default mode nothing else reads the clock."""

    deadline: float | None
    stopped: list[str] = field(default_factory=list)

    def left(self) -> float:
        """Seconds to the cap (without one: NO_DEADLINE_S, a finite cap that never binds, which
        the solvers' own clocks accept)."""
        return NO_DEADLINE_S if self.deadline is None else self.deadline - time.perf_counter()

    def passed(self, margin_s: float = 0.0) -> bool:
        return self.left() <= margin_s

    def stop(self, phase: str) -> None:
        if phase not in self.stopped:
            self.stopped.append(phase)


# the integral LP relaxation's clock cap where its caller gives none (lpbuilder.LPSettings)
INTEGRAL_TIME_LIMIT_S = 10.0

# --- the heuristic (planners/heuristic.py) ---
# the bundled variant is tried up to this many positions: past it, it would cost a third of the
# heuristic's time goal (benchmarks/solve_scaling.py --size-goals; docs/tuning.md)
BUNDLED_UP_TO_POSITIONS = 20_000
POLISH_EVALUATIONS_PER_TENSOR = 10  # small graphs: the lane trades need about 9 a tensor
POLISH_POSITIONS = 50_000  # simulated positions of the polish
# a lane trade's cover (planners/local_search.py) takes at most this many tensors before it gives up
REPAIR_ROUNDS = 4
# the polish's work, in multiples, when no candidate fits (the alternative is no plan at all):
# profiled HF models on the CPU at 30% (keep and recompute only) needed 16-32
UNFIT_POLISH_FACTOR = 32
UNFIT_POLISH_POSITIONS = 640_000  # the unfit polish's simulated positions in all

# --- the departure bound (planners/departures.py) ---
# model size past which the bound is not built (departed_by binaries): it is a tool for graphs
# of tens to a few hundred positions, where single copies are long against the compute
MAX_BINARIES = 40_000
FIRST_POSITIONS = 8  # the first round's positions (besides the first over the budget)
# the probe's share of the work (the position most over the room alone; 0: no probe)
PROBE_SHARE = 0.25
ADDED_POSITIONS = 8  # at most this many broken positions join each next round
# a round over some positions gets at most this share of the work; one that does not solve in it
# gives way to the round over every position (fewer rows can make the proof harder: with no
# incumbent, on the CNN rows; docs/tuning.md). From the heuristic's plan, a quarter per round
# left CNN rows unsolved that half solved
ROUND_SHARE = 0.5
# what a round costs beyond CP-SAT's deterministic time, per binary of its model (the Python
# build, the hint, CP-SAT's presolve), and CP-SAT's
# deterministic time per second with one worker on the reference machine
ROUND_S_PER_BINARY = 5e-4
DTIME_PER_S = 0.45

# --- CP-SAT (planners/exact/cpsat.py) ---
# interleave_search makes CP-SAT's parallel workers deterministic (the same answer at the same
# deterministic time on any machine). OR-Tools 9.15 aborts the process ("Check failed:
# heuristics.fixed_search") when such a search is given a complete hint that is infeasible (it
# tries to repair it): the hint is checked here first, and an infeasible one is not given.
INTERLEAVE = True
CPSAT_BUILD_S_PER_NONZERO = 6e-6  # CP-SAT model building (docs/tuning.md for these figures)
# CP-SAT checks its clock now and then, and freeing a large model takes time after it stops: it
# is stopped earlier by this much per nonzero
STOP_S_PER_NONZERO = 1.5e-6
# over every position (a proof): one worker without LP, one with; CP-SAT's own presolve loops
# once (proofs several times faster than the default portfolio)
PROOF_SUBSOLVERS = ("no_lp", "default_lp")
# CP-SAT's presolve probing does not check the wall clock and counts little of its work as
# deterministic time: on large models it ran far past the round's cap. Above this size it is off
PROBING_OFF_FROM_NONZEROS = 250_000
# a round on a model of that size whose search would get less deterministic time than this once
# the model's size is paid is not run: its presolve alone (PresolveToFixPoint, not counted as
# deterministic time either) costs more than the work allowed, for no plan
MIN_ROUND_DTIME = 0.25


# --- model sizes: which model is built, and how ---
# the MILP gets every position by default on graphs of at most this many positions x saved
# tensors (formulations/milp.md, "Candidates"); larger ones get windows
FULL_CELLS = 1500
# the LP bound's rebuild-pull rows (planners/rebuild_pulls.py): at most this many pull points per
# saved tensor, and only on graphs of at most PULL_CELLS positions x saved tensors (on larger ones
# they slowed HiGHS's branch and bound several times for the same bound)
PULL_POINTS_PER_TENSOR = 32
# and the pairs of rebuilds per op whose second run of it they charge (nearest first uses first)
SHARED_RERUN_PAIRS_PER_OP = 16
PULL_CELLS = 100_000
# the LP bound's every-copy-within-the-step row is added when the copies' latency passes this
# share of the ideal step (below it the row binds nothing)
LATENCY_ROW_SHARE = 0.1
# positions above which the LP bound is solved by an interior point method (PIQP), where dual
# simplex slows down most
IPM_FROM_POSITIONS = 2500
# the smallest budget (planners/minpeak.py): the exact model over every position on graphs of at
# most this many positions x saved tensors and nonzeros, with this much CP-SAT deterministic time
# (one worker: the same on any machine); the heuristic's plans tried between the floor and the
# keep-all peak, by bisection
MIN_PEAK_CELLS = 20_000
MIN_PEAK_NONZEROS = 400_000
MIN_PEAK_DTIME = 4.0
BISECTION_STEPS = 12
# the heuristic's fit is not monotone in the budget (a plan can fit a budget below one where the
# rules failed): below the bisection's answer the full heuristic (its polish and local search)
# is tried at these fractions of the best peak so far (the largest step first), restarting from
# each better plan, at most
# DESCENT_ROUNDS times (SegNet recompute-only: 2.30 GB by bisection, 2.07 GB found below it)
DESCENT_FRACTIONS = (0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999)
DESCENT_ROUNDS = 6
# repeated blocks (planners/repeats.py): fewer repeats than this are not worth a coarse problem;
# a block has at most this many ops (a transformer layer at the aten level: hundreds); at most
# this many shape runs are narrowed by their references (each a pass over the ops)
REPEATS_MIN_BLOCKS = 8
REPEATS_MAX_PERIOD = 4096
REPEATS_MAX_NARROWED = 8

# --- solvers in a child process (planners/native.py, the PuLP and SCIP backends) ---
GRACE_S = 0.3  # past the solver's own limit, before the child is killed
CHILD_START_S = 0.5  # starting the child and reading the model there
# building the model, per nonzero: PuLP's model and its serialising; pywraplp's, one Python call
# per term (a backend is not started where its build alone would pass the time limit)
PULP_BUILD_S_PER_NONZERO = 3e-5
SCIP_BUILD_S_PER_NONZERO = 2e-5
