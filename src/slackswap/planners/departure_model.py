"""The departure bound's model (formulations/departure-bound.md): the step's data in integer units
(DepartureData: what keeping everything holds, the room per position, its rounding always
relaxing) and the CP-SAT model over some positions (DepartureModel: decisions, whole departures
on the D2H queue, memory at each position, the overhead).
"""

from __future__ import annotations

import bisect
import math
from typing import Any

import numpy as np

from ..core.codes import keep_all_codes
from ..core.graph import ActivationGraph
from ..core.hardware import Hardware
from ..core.plan import KEEP, RECOMPUTE, SWAP
from ..core.stepmodel import expand
from .scaling import departure_units


class DepartureData:
    """What the model reads: positions over the budget, the room for saved tensors there, the
    units (formulations/departure-bound.md, "Units")."""

    def __init__(self, graph: ActivationGraph, budget_bytes: int, hw: Hardware, mask) -> None:
        self.graph, self.hw, self.budget_bytes, self.mask = graph, hw, budget_bytes, mask
        S = graph.n_positions
        saved = self.saved = [int(t) for t in graph.saved]
        prod = self.prod = graph.producer
        self.last_fwd = graph.last_forward_use
        self.first_use = {t: graph.bwd_position(int(graph.first_backward_use[t])) for t in saved}
        self.last_use = {t: graph.bwd_position(int(graph.last_backward_use[t])) for t in saved}
        nbytes = self.nbytes = graph.tensor_bytes
        # what every plan holds besides the saved tensors: unsaved tensors and workspace, as
        # keeping everything has them (the LP bound's constants, lp-bound.md)
        base = expand(graph, keep_all_codes(graph), None, hw)
        other = np.zeros(S, dtype=np.int64)
        for t, s_, e_ in zip(base.iv_tensor, base.iv_start, base.iv_end):
            if not graph.is_saved[t]:
                other[s_ : e_ + 1] += int(nbytes[t])
        other += base.point_workspace[base.position_first_point].astype(np.int64)
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
        self.tu, self.bu = departure_units(graph, hw, budget_bytes)
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


class DepartureModel:
    """The CP-SAT model over some positions, and what reads, checks and hints it."""

    def __init__(self, data: DepartureData, positions: list[int]) -> None:
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
        self.departed: dict[Any, Any] = {}
        self.ahead: dict[Any, Any] = {}
        self.busy: dict[Any, Any] = {}
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
