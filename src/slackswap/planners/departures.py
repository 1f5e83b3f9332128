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

import bisect
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.budget import parse_budget
from ..core.graph import ActivationGraph
from ..core.hardware import Hardware, hardware
from ..core.plan import KEEP, RECOMPUTE, SWAP
from ..core.stepmodel import expand, keep_all_codes
from .interrupts import solve_cpsat

# model size past which the bound is not built (departed_by binaries): it is a tool for graphs
# of tens to a few hundred positions, where single copies are long against the compute
MAX_BINARIES = 40_000
TIME_RANGE = 1e7  # time unit: (ideal step + every copy) / TIME_RANGE
BYTE_RANGE = 1e6  # byte unit: the larger of the budget and the largest tensor / BYTE_RANGE


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
    then stop it)."""
    from ortools.sat.python import cp_model

    began = time.perf_counter()
    hw = hardware(hw)
    budget_bytes = parse_budget(budget, graph, hw)
    if mask is None and (allowed is not None or pins):
        from ..core.restrict import decision_mask

        mask = decision_mask(graph, allowed, pins, hardware(hw).min_swap_bytes)
    ideal = graph.ideal_step_time_s
    for name, value in (("gap", gap), ("min_gap_s", min_gap_s)):
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not math.isfinite(value)
            or value < 0
        ):
            raise ValueError(f"departure_bound: {name} must be a finite number >= 0, got {value!r}")
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

    def result(status, bound=None, codes=None, note="", **kw) -> DepartureBound:
        return DepartureBound(
            status, bound, ideal, time.perf_counter() - began, codes, note=note, **kw
        )

    data = _Data(graph, budget_bytes, hw, mask)
    keep_all = keep_all_codes(graph)
    if mask is not None and not mask[graph.saved, KEEP].all():
        keep_all = None  # a tensor may not be kept: keeping everything is no start
    if not data.critical:
        return result(
            "trivial",
            ideal,
            keep_all,
            note="keeping every tensor fits the budget at every position",
        )
    if data.binaries(data.critical) > max_binaries:
        return result(
            "skipped",
            note=f"{data.binaries(data.critical)} departed_by binaries (over {max_binaries})",
            positions=len(data.critical),
            binaries=data.binaries(data.critical),
        )
    if not data.tu > 0:
        return result("trivial", ideal, keep_all, note="a step of no time")
    cap = 2**40
    if incumbent_s is not None and np.isfinite(incumbent_s):
        cap = data.up(incumbent_s - ideal) + 1  # every plan no slower fits under it
    # positions_added: the positions most over the budget first; a round's optimum is a valid
    # bound (fewer rows relax), and where it breaks another position, those join the next round
    by_excess = sorted(data.critical, key=lambda k: (-data.excess[k], k))
    first = set(by_excess[:FIRST_POSITIONS]) | {data.critical[0]}
    # the probe: the position most over the room alone, for a small share of the work; often its
    # optimum is already the bound (ResNet50 at 80%: 0.28 units, where the first round over 9
    # positions is 6% short of it after 10)
    probe = PROBE_SHARE > 0 and len(data.critical) > 1
    positions = {by_excess[0]} if probe else first
    spent, rounds, best_bound, codes = 0.0, 0, ideal, None
    work_left = None if work_s is None else float(work_s)
    build_s_per_binary = None  # building a round's model (Python) is outside CP-SAT's clock
    sizes: dict[str, Any] = {}
    while True:
        rounds += 1
        whole = not probe and len(positions) == len(data.critical)
        if (
            build_s_per_binary is not None
            and time.perf_counter() - began + build_s_per_binary * data.binaries(sorted(positions))
            >= 0.95 * time_limit_s
        ):
            # the next round's model would not be built within the clock cap (a loaded
            # machine): the bound so far, said so, rather than a late answer
            return result(
                "timeout",
                best_bound,
                codes,
                note=f"{rounds - 1} rounds",
                **{**sizes, "clock_stopped": True},
            )
        if work_left is not None and work_left <= ROUND_S_PER_BINARY * data.binaries(
            sorted(positions)
        ):
            # its model alone would pass the work left: the bound so far (its work, not a clock)
            return result(
                "feasible", best_bound, codes, note=f"{rounds - 1} rounds, work spent", **sizes
            )
        build_began = time.perf_counter()
        model = _Model(data, sorted(positions))
        model.cp.add(model.overhead <= cap)
        if hint is not None:
            model.add_hint(hint)
        build_s_per_binary = (time.perf_counter() - build_began) / max(1, model.binaries)
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = int(workers)
        solver.parameters.random_seed = int(seed)
        # its linear relaxation with the Boolean rows too: proofs in half the work (VGG16 at 80%)
        solver.parameters.linearization_level = 2
        # CP-SAT's relative gap is on its objective, the overhead in units
        solver.parameters.relative_gap_limit = float(gap)
        solver.parameters.absolute_gap_limit = math.floor(min_gap_s / data.tu)
        clock_left = time_limit_s - (time.perf_counter() - began)
        solver.parameters.max_time_in_seconds = max(0.05, clock_left)
        if deterministic_time_s is not None:
            # a round over some positions gets a share; the round over all gets what is left
            share = PROBE_SHARE if probe else 1.0 if whole else ROUND_SHARE
            round_dtime = min(deterministic_time_s - spent, share * deterministic_time_s)
            if work_left is not None:
                work_left -= ROUND_S_PER_BINARY * model.binaries
                round_dtime = min(round_dtime, DTIME_PER_S * work_left)
            solver.parameters.max_deterministic_time = max(0.01, round_dtime)
            solver.parameters.interleave_search = workers > 1
        if on_start is not None:
            on_start(solver)
        solve_began = time.perf_counter()
        status = solve_cpsat(solver, model.cp)
        spent += solver.deterministic_time
        if work_left is not None:
            work_left -= solver.deterministic_time / DTIME_PER_S
        clocked = (
            status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE)
            and time.perf_counter() - solve_began >= 0.95 * solver.parameters.max_time_in_seconds
        )
        if status == cp_model.MODEL_INVALID:
            raise RuntimeError(f"departure bound: CP-SAT rejected the model: {model.cp.validate()}")
        sizes = {
            "positions": len(positions),
            "binaries": model.binaries,
            "work": spent,
            "clock_stopped": clocked,
        }
        if status == cp_model.INFEASIBLE:
            if cap < 2**40:
                # capped at incumbent_s: no point that fast, so every plan is slower than cap
                # units (its point has at most ceil(overhead / unit)); not "no plan fits"
                return result(
                    "feasible",
                    ideal + cap * data.tu,
                    codes,
                    note=f"no plan is as fast as incumbent_s ({rounds} rounds)",
                    **sizes,
                )
            return result("infeasible", note="no plan fits the budget at some position", **sizes)
        # the integer optimum is at most ceil(true overhead / unit): one unit below its bound is
        # below every plan's overhead (and fewer positions only relax: each round's is a bound)
        best_bound = max(best_bound, ideal + max(0.0, (solver.best_objective_bound - 1) * data.tu))
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            codes = model.decisions(solver)
        broken = model.broken_positions(solver) if status == cp_model.OPTIMAL else None
        if broken == {}:
            return result("optimal", best_bound, codes, note=f"{rounds} rounds", **sizes)
        if enough_s is not None and best_bound >= enough_s:
            return result(
                "feasible", best_bound, codes, note=f"enough_s reached ({rounds} rounds)", **sizes
            )
        spent_out = (
            deterministic_time_s is not None and spent >= deterministic_time_s * (1 - 1e-9)
        ) or (work_left is not None and work_left <= 0.01)
        if whole or spent_out or clocked or time.perf_counter() - began >= 0.95 * time_limit_s:
            clocked = clocked or not spent_out and not whole
            return result(
                "timeout" if clocked else "feasible",
                best_bound,
                codes,
                note=f"{rounds} rounds",
                **{**sizes, "clock_stopped": clocked},
            )
        if probe:  # the first round proper, whatever the probe broke
            probe, positions = False, first
        elif broken is None:  # the round's share ran out: every position, with the work left
            positions = set(data.critical)
        else:
            # the rows the completion misses by the most first, as a cutting-plane loop adds
            # its most violated cuts (formulations/departure-bound.md, "Rounds over positions")
            positions.update(sorted(broken, key=lambda k: (-broken[k], k))[:ADDED_POSITIONS])


FIRST_POSITIONS = 8  # the first round's positions (besides the first over the budget)
# the probe's share of the work (the position most over the room alone; 0: no probe)
PROBE_SHARE = 0.25
ADDED_POSITIONS = 8  # at most this many broken positions join each next round
# a round over some positions gets at most this share of the work; one that does not solve in it
# gives way to the round over every position (fewer rows can make the proof harder: with no
# incumbent, VGG19 at 90% over 25 positions was not solved with 10 of work, over all 60 with 2).
# From the heuristic's plan with 2 of work, a quarter per round left VGG16 at 50% and VGG19 at
# 90% unsolved; half solved them (1.3 and 0.8 in all)
ROUND_SHARE = 0.5
# what a round costs beyond CP-SAT's deterministic time, per binary of its model (the Python
# build, the hint, CP-SAT's presolve: ResNet50 at 50%, two rounds of 4,000 binaries, 2.7 s of wall
# time for 1 unit of deterministic time), and CP-SAT's
# deterministic time per second with one worker on the reference machine
ROUND_S_PER_BINARY = 5e-4
DTIME_PER_S = 0.45


class _Data:
    """What the model reads: positions over the budget, the room for saved tensors there, the
    units (formulations/departure-bound.md, "Units")."""

    def __init__(self, graph: ActivationGraph, budget_bytes: int, hw: Hardware, mask) -> None:
        self.graph, self.hw, self.budget_bytes, self.mask = graph, hw, budget_bytes, mask
        S = graph.n_slots
        saved = self.saved = [int(t) for t in graph.saved]
        prod = self.prod = graph.producer
        self.last_fwd = graph.last_forward_use
        self.first_use = {t: graph.bwd_slot(int(graph.first_backward_use[t])) for t in saved}
        self.last_use = {t: graph.bwd_slot(int(graph.last_backward_use[t])) for t in saved}
        nbytes = self.nbytes = graph.tensor_bytes
        # what every plan holds besides the saved tensors: unsaved tensors and workspace, as
        # keeping everything has them (the LP bound's constants, lp-bound.md)
        base = expand(graph, keep_all_codes(graph), None, hw)
        other = np.zeros(S, dtype=np.int64)
        for t, s_, e_ in zip(base.iv_tensor, base.iv_start, base.iv_end):
            if not graph.is_saved[t]:
                other[s_ : e_ + 1] += int(nbytes[t])
        other += base.point_workspace[base.slot_first_point].astype(np.int64)
        self.room = [int(budget_bytes) - int(other[k]) for k in range(S)]
        # saved bytes resident at each position when everything is kept: [producer, last use]
        held = np.zeros(S + 1, dtype=np.int64)
        for t in saved:
            held[prod[t]] += int(nbytes[t])
            held[self.last_use[t] + 1] -= int(nbytes[t])
        held = np.cumsum(held)[:S]
        self.critical = [k for k in range(S) if held[k] > self.room[k]]
        self.excess = {k: int(held[k]) - self.room[k] for k in self.critical}
        self.produced = np.sort(np.array([prod[t] for t in saved], dtype=np.int64))
        self.order = sorted(saved, key=lambda t: (int(prod[t]), t))  # the D2H lane's order
        copies = sum(hw.d2h_time(int(nbytes[t])) for t in saved)
        self.tu = (graph.ideal_step_time_s + copies) / TIME_RANGE
        self.bu = max(1, math.ceil(max(budget_bytes, int(nbytes.max(initial=1))) / BYTE_RANGE))
        dur = np.concatenate([graph.forward_s, graph.backward_s[::-1]])
        self.compute_before = np.concatenate([[0.0], np.cumsum(dur)])  # P[k]

    def binaries(self, positions) -> int:
        return int(np.searchsorted(self.produced, np.array(positions), side="left").sum())

    # every rounding relaxes (formulations/departure-bound.md, "Units"): copy and rerun times
    # down, time available up (one unit more than the float sum), bytes down, room up
    def down(self, seconds: float) -> int:
        return max(0, math.floor(seconds / self.tu * (1 - 1e-9)))

    def up(self, seconds: float) -> int:
        return math.ceil(seconds / self.tu * (1 + 1e-9)) + 1


class _Model:
    """The CP-SAT model over some positions, and what reads, checks and hints it."""

    def __init__(self, data: _Data, positions: list[int]) -> None:
        from ortools.sat.python import cp_model

        self.data = d = data
        g, n = d.graph, d.graph.n_ops
        m = self.cp = cp_model.CpModel()
        saved, mask = d.saved, d.mask
        swap = self.swap = {t: m.new_bool_var(f"swap[{t}]") for t in saved}
        recompute = self.recompute = {t: m.new_bool_var(f"recompute[{t}]") for t in saved}
        for t in saved:
            m.add(swap[t] + recompute[t] <= 1)  # one_decision[x] (keep: neither)
            if not g.can_recompute[t]:
                m.add(recompute[t] == 0)
            if mask is not None:  # allowed_decision[x, c]
                if not mask[t, KEEP]:
                    m.add(swap[t] + recompute[t] == 1)
                if not mask[t, SWAP]:
                    m.add(swap[t] == 0)
                if not mask[t, RECOMPUTE]:
                    m.add(recompute[t] == 0)
        for group in g.rng_groups.values():  # random_group[g]
            for a, b in zip(group, group[1:]):
                m.add(recompute[int(a)] == recompute[int(b)])
        rerun_ops = sorted({int(q) for t in saved for q in g.rerun_ops[t]})
        rerun = self.rerun = {q: m.new_bool_var(f"rerun[{q}]") for q in rerun_ops}
        self.rerun_of: dict[int, list[int]] = {q: [] for q in rerun_ops}
        for t in saved:
            for q in g.rerun_ops[t]:
                m.add_implication(recompute[t], rerun[int(q)])  # rerun_cover[x, q]
                self.rerun_of[int(q)].append(t)
        self.rerun_units = {q: d.down(float(g.forward_s[q])) for q in rerun_ops}
        horizon = 2**40
        overhead = self.overhead = m.new_int_var(0, horizon, "overhead")
        stall = self.stall = [m.new_int_var(0, horizon, f"stall_before[{k}]") for k in range(n)]
        for k in range(n - 1):
            m.add(stall[k] <= stall[k + 1])  # stall_monotone[k]
        # overhead_split: forward stalls and reruns (backward only) take disjoint time
        m.add(stall[n - 1] + sum(self.rerun_units[q] * rerun[q] for q in rerun_ops) <= overhead)
        self.copy_units = {t: d.down(d.hw.d2h_time(int(d.nbytes[t]))) for t in saved}
        self.departed, self.ahead, self.busy = {}, {}, {}
        self.binaries = 0
        self.positions = set(positions)
        for k in positions:
            self._position(k)
        # departed_monotone[x, k]: a copy done by one position is done by every later one
        modelled: dict[int, list[tuple[int, Any]]] = {}
        for (t, k), var in self.departed.items():
            modelled.setdefault(t, []).append((k, var))
        for pairs in modelled.values():
            pairs.sort(key=lambda pair: pair[0])
            for (_, earlier), (_, later) in zip(pairs, pairs[1:]):
                m.add_implication(earlier, later)
        m.minimize(overhead)

    def _position(self, k: int) -> None:
        d, m, n = self.data, self.cp, self.data.graph.n_ops
        P, prod, swap = d.compute_before, d.prod, self.swap
        before = [t for t in d.order if prod[t] < k]
        slack = self.stall[k] if k < n else self.overhead
        departed = {}
        for t in before:
            departed[t] = self.departed[t, k] = m.new_bool_var(f"departed_by[{t},{k}]")
            m.add_implication(departed[t], swap[t])  # departed_swapped[x, k]
        self.binaries += len(departed)
        groups = sorted({int(prod[t]) for t in before})
        members = {p: [t for t in before if prod[t] == p] for p in groups}
        previous = None
        for p_prev, p in zip(groups, groups[1:]):
            # departure_prefix[p, k]: the lane is first in first out in production order
            ahead = m.new_bool_var(f"all_before_departed[{p},{k}]")
            self.ahead[p, k] = (ahead, [t for q in groups if q < p for t in members[q]])
            if previous is not None:
                m.add_implication(ahead, previous)
            for y in members[p_prev]:
                m.add_bool_or([~ahead, ~swap[y], departed[y]])
            for x in members[p]:
                m.add_implication(departed[x], ahead)
            previous = ahead
        # lane_busy[p, k]: copies released at or after op p's end (its compute end P[p + 1]
        # plus the stall before it) and done by k's start fit between the two; suffix sums keep
        # the rows short. One unit more for the stalls' rounding ("Units")
        later = None
        for p in reversed(groups):
            work = sum(self.copy_units[t] * departed[t] for t in members[p])
            busy = m.new_int_var(0, sum(self.copy_units[t] for t in before), f"lane_busy[{p},{k}]")
            self.busy[p, k] = (busy, [t for q in groups if q >= p for t in members[q]])
            m.add(busy == work + (later if later is not None else 0))
            m.add(busy <= d.up(P[k] - P[p + 1]) + 1 + slack - self.stall[p])
            later = busy
        # memory_at[k]: resident saved bytes within the room; a tensor is away between its
        # last forward use and first backward use when recomputed, or swapped and departed
        held, away = self._held_away(k)
        m.add(
            held
            - sum(b * self.recompute[t] for b, t in away)
            - sum(b * departed[t] for b, t in away if t in departed)
            <= -(-d.room[k] // d.bu)
        )

    def _held_away(self, k: int) -> tuple[int, list[tuple[int, int]]]:
        d = self.data
        resident = [t for t in d.saved if d.prod[t] <= k <= d.last_use[t]]
        held = sum(int(d.nbytes[t]) // d.bu for t in resident)
        away = [
            (int(d.nbytes[t]) // d.bu, t) for t in resident if d.last_fwd[t] < k < d.first_use[t]
        ]
        return held, away

    def decisions(self, solver) -> np.ndarray:
        codes = keep_all_codes(self.data.graph).copy()
        for t in self.swap:
            codes[t] = (
                SWAP
                if solver.value(self.swap[t])
                else RECOMPUTE
                if solver.value(self.recompute[t])
                else KEEP
            )
        return codes

    def add_hint(self, codes: np.ndarray) -> None:
        """The point of a plan with these decisions: its simulated timeline gives which copies
        are done by each position and the stalls; only the decisions when it does not fit."""
        from ..check.simulate import simulate_decisions

        d, m = self.data, self.cp
        g, tu = d.graph, d.tu
        for t in self.swap:
            m.add_hint(self.swap[t], int(codes[t] == SWAP))
            m.add_hint(self.recompute[t], int(codes[t] == RECOMPUTE))
        sim = simulate_decisions(g, np.asarray(codes), d.hw, d.budget_bytes)
        if not sim.fits:
            return
        n = g.n_ops
        begins: dict[int, float] = {}
        for s0, _, op, kind in sim.compute_intervals:
            if kind == 0:
                begins.setdefault(int(op), float(s0))
            elif kind == 2:
                begins.setdefault(2 * n - 1 - int(op), float(s0))
        done = {int(t): float(e) for _, e, t in sim.d2h_intervals}
        gone = {
            (t, k): int(codes[t] == SWAP and done.get(t, np.inf) <= begins.get(k, -np.inf))
            for t, k in self.departed
        }
        for key, var in self.departed.items():
            m.add_hint(var, gone[key])
        for (_, k), (var, tensors) in self.ahead.items():
            m.add_hint(var, int(all(gone[t, k] or codes[t] != SWAP for t in tensors)))
        for (_, k), (var, tensors) in self.busy.items():
            m.add_hint(var, sum(self.copy_units[t] * gone[t, k] for t in tensors))
        stalls = [
            max(0, math.ceil((begins.get(k, 0.0) - d.compute_before[k]) / tu) + 1) for k in range(n)
        ]
        for k in range(n):
            stalls[k] = max(stalls[k], stalls[k - 1] if k else 0)
            m.add_hint(self.stall[k], stalls[k])
        reruns = sum(
            units
            for q, units in self.rerun_units.items()
            if any(codes[t] == RECOMPUTE for t in self.rerun_of[q])
        )
        m.add_hint(
            self.overhead,
            max(math.ceil((sim.step_time_s - g.ideal_step_time_s) / tu) + 2, stalls[-1] + reruns),
        )

    def broken_positions(self, solver) -> dict[int, int]:
        """Positions over the budget, not in this model, whose memory row no completion of the
        solution meets, each with the bytes (in units) its row is missed by. The completion
        keeps every value the solution has (the stalls, the copies done at modelled positions)
        and, at each critical position in order, takes the copies done at the one before
        (departed_monotone), then more in the lane's order while every lane_busy row holds,
        only copies done by the next modelled position. With no
        position broken the solution is a point of the model over every position, so the
        round's optimum is the whole model's."""
        d = self.data
        swapped = [t for t in d.order if solver.value(self.swap[t])]
        recomputed = {t for t in d.saved if solver.value(self.recompute[t])}
        overhead = solver.value(self.overhead)
        stalls = [solver.value(v) for v in self.stall]
        done_at = {
            k: {t for t in swapped if (t, k) in self.departed and solver.value(self.departed[t, k])}
            for k in self.positions
        }
        modelled = sorted(self.positions)
        broken: dict[int, int] = {}
        previous: set[int] = set()
        for k in d.critical:  # in position order
            if k in done_at:
                previous = done_at[k]
                continue
            after = bisect.bisect_right(modelled, k)  # the next modelled position, if any
            ceiling = done_at[modelled[after]] if after < len(modelled) else None
            previous = self._copies_done(k, swapped, stalls, overhead, previous, ceiling)
            held, away = self._held_away(k)
            freed = sum(b for b, t in away if t in recomputed or t in previous)
            over = held - freed - -(-d.room[k] // d.bu)
            if over > 0:
                broken[k] = over
        return broken

    def _copies_done(
        self,
        k: int,
        swapped: list[int],
        stalls: list[int],
        overhead: int,
        floor: set[int],
        ceiling: set[int] | None,
    ) -> set[int]:
        """Copies done by position k: those of ``floor`` (done at a critical position before,
        so every lane_busy row at k holds for them), then whole producer groups in the lane's
        order while the rows hold, then the largest of the next group that still fit (first in
        first out: nothing after that group can be done); only tensors in ``ceiling`` (done by
        the next modelled position) when one is given."""
        d, n = self.data, self.data.graph.n_ops
        P, prod, units = d.compute_before, d.prod, self.copy_units
        slack = stalls[k] if k < n else overhead
        groups = sorted({int(prod[t]) for t in swapped if prod[t] < k})
        # lane time from p's end to k's start, as the lane_busy row has it
        room = {p: d.up(P[k] - P[p + 1]) + 1 + slack - stalls[p] for p in groups}
        # the floor's copy time from each group on (suffix sums, as lane_busy has them)
        floor_time = dict.fromkeys(groups, 0)
        for t in floor:
            floor_time[int(prod[t])] += units[t]
        load, later = {}, 0
        for p in reversed(groups):
            later += floor_time[p]
            load[p] = later
        done = set(floor)

        def take(tensors: list[int], p: int) -> bool:
            cost = sum(units[t] for t in tensors)
            if any(load[q] + cost > room[q] for q in groups if q <= p):
                return False
            for q in groups:
                if q <= p:
                    load[q] += cost
            done.update(tensors)
            return True

        for p in groups:
            members = [t for t in swapped if prod[t] == p and t not in done]
            allowed = [t for t in members if ceiling is None or t in ceiling]
            if len(allowed) < len(members) or not take(allowed, p):
                for t in sorted(allowed, key=lambda x: -int(d.nbytes[x])):
                    take([t], p)
                break
        return done
