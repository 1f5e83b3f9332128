"""The LP bound's model, built one method per section of formulations/lp-bound.md and solved: the
result is an LPBound, never a wrong bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..core.budget import min_budget
from ..core.codes import keep_all_codes
from ..core.status import Status
from ..core.stepmodel import expand
from . import limits  # IPM_FROM_POSITIONS read at each call (one place to change it)
from .base import Problem
from .limits import INTEGRAL_TIME_LIMIT_S, LATENCY_ROW_SHARE, PULL_CELLS
from .lpmodel import LinearModel
from .rebuild_pulls import add_to, rebuild_pulls
from .scaling import SMALLEST, lp_units, relax_small


@dataclass(frozen=True)
class LPBound:
    retention: float
    step_time_s: float
    ideal_step_time_s: float
    budget_bytes: int
    status: str
    wall_s: float
    keep: dict[str, float]
    swap: dict[str, float]
    recompute: dict[str, float]
    integral: bool = False  # decisions were integer variables (a MILP), not fractions
    gap: float = 0.0  # integral: the MILP's remaining gap between its decisions and its bound
    note: str = ""  # why no bound was proven ("unsolved", "timeout")
    nodes: int | None = None  # integral: branch-and-bound nodes explored (HiGHS's work)
    clock_stopped: bool = False  # the wall-clock cap, not a work limit or the gap, stopped it
    iterations: int | None = None  # simplex (or interior point) iterations, where known


@dataclass(frozen=True)
class LPSettings:
    """How the LP bound is solved (``lp_bound``'s keywords, documented there), apart from the
    problem it bounds: checked once here."""

    integral: bool = False
    time_limit_s: float | None = None
    gap: float = 1e-4
    producer_delay: bool = True
    improving_solutions: int | None = None
    max_iterations: int | None = None
    gap_on_step: bool = True
    kill_after_s: float | None = None
    max_nodes: int | None = None
    whole_departures: int = 0
    highs_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        w = self.whole_departures
        if isinstance(w, bool) or not isinstance(w, int | np.integer) or w < 0:
            raise ValueError(
                f"lp_bound: whole_departures must be a whole number of positions >= 0, got {w!r}"
            )
        if w and not self.integral:
            # its rows need integral decisions and binaries: without them it would be ignored
            raise ValueError(
                "lp_bound: whole_departures needs integral=True (its rows are binaries)"
            )


class LPBoundBuilder:
    """The LP bound's model under construction, one method per section of formulations/lp-bound.md,
    and what the sections share: the scaled sizes and times (Section "Scaling") and the variables
    made so far."""

    def __init__(self, problem: Problem, settings: LPSettings) -> None:
        start_clock = time.perf_counter()
        graph, hw, budget_bytes = problem.graph, problem.hardware, problem.budget_bytes
        integral, time_limit_s = settings.integral, settings.time_limit_s
        if integral and time_limit_s is None:
            time_limit_s = INTEGRAL_TIME_LIMIT_S
        n = graph.n_ops
        S = graph.n_positions
        saved = graph.saved
        m = len(saved)
        # scale bytes and seconds so the budget and the ideal step are both about 1000 units: HiGHS
        # tolerances are absolute, and raw bytes (1e9) beside seconds (1e-5) lose feasible points.
        # Coefficients that would still fall below SMALLEST units are rounded the way that relaxes
        # the model (bytes and op times down, lane bandwidth up), so the bound stays a bound
        # (formulations/lp-bound.md, "Scaling").
        bu, tu = lp_units(graph, hw, budget_bytes)
        nbytes = relax_small(graph.tensor_bytes.astype(float) / bu)
        fwd_s = relax_small(graph.forward_s / tu)
        prod = graph.producer
        last_fwd = graph.last_forward_use
        u_position = np.array([graph.bwd_position(int(u)) for u in graph.first_backward_use[saved]])
        lb_position = np.array([graph.bwd_position(int(v)) for v in graph.last_backward_use[saved]])
        self.S = S
        self.bu = bu
        self.budget_bytes = budget_bytes
        self.fwd_s = fwd_s
        self.gap = settings.gap
        self.gap_on_step = settings.gap_on_step
        self.graph = graph
        self.highs_options = settings.highs_options
        self.hw = hw
        self.improving_solutions = settings.improving_solutions
        self.integral = integral
        self.kill_after_s = settings.kill_after_s
        self.last_fwd = last_fwd
        self.lb_position = lb_position
        self.m = m
        self.mask = problem.mask
        self.max_iterations = settings.max_iterations
        self.max_nodes = settings.max_nodes
        self.n = n
        self.nbytes = nbytes
        self.prod = prod
        self.producer_delay = settings.producer_delay
        self.saved = saved
        self.start_clock = start_clock
        self.time_limit_s = time_limit_s
        self.tu = tu
        self.u_position = u_position
        self.whole_departures = settings.whole_departures

    def decisions(self) -> None:
        """keep (K), swap (W) and recompute (R) fractions per saved tensor, summing to one;
        restrictions fix a fraction to 0; a random group is recomputed together."""
        graph, m, mask, saved = self.graph, self.m, self.mask, self.saved
        lp = LinearModel()
        K = lp.vars(m, ub=1.0)
        W = lp.vars(m, ub=1.0)  # swap
        R = lp.vars(m, ub=1.0)
        for i, t in enumerate(saved):
            lp.eq([K[i], W[i], R[i]], [1, 1, 1], 1.0)
            if not graph.can_recompute[t]:
                lp.ub[R[i]] = 0.0
            if mask is not None:
                for var, code in ((K[i], 0), (W[i], 1), (R[i], 2)):
                    if not mask[t, code]:
                        lp.ub[var] = 0.0
        limit = self.hw.host_memory_bytes
        sizes = [float(graph.tensor_bytes[t]) for t in saved]
        if limit and sum(sizes) > limit:
            # host_memory: the swapped bytes together within the host's (the executor's pool
            # holds each swapped tensor for the step)
            lp.le(list(W), sizes, float(limit))
        column = {int(t): i for i, t in enumerate(saved)}
        for group in graph.rng_groups.values():
            members = [column[t] for t in group]
            for a, b in zip(members, members[1:]):
                lp.eq([R[a], R[b]], [1, -1], 0.0)
        self.K = K
        self.R = R
        self.W = W
        self.column = column
        self.lp = lp

    def reruns(self) -> None:
        """Rerun variables per op, what each recomputed tensor's rebuild reruns, and the stall and
        rerun time placed before each position."""
        R, S, fwd_s, graph, lp, n = self.R, self.S, self.fwd_s, self.graph, self.lp, self.n
        saved = self.saved
        rerun_ops = sorted({q for t in saved for q in graph.rerun_ops[t]})
        Z = lp.vars(len(rerun_ops), ub=1.0, cost=fwd_s[rerun_ops] if rerun_ops else 0.0)
        zi = {q: Z[j] for j, q in enumerate(rerun_ops)}
        for i, t in enumerate(saved):
            for q in graph.rerun_ops[t]:
                lp.le([R[i], zi[q]], [1, -1], 0.0)
        # rebuilds pull others along, and an op two rebuilds at two positions rerun runs twice
        # (integral decisions only: for fractions the rows are void; graphs of at most
        # PULL_CELLS positions x saved tensors, where they cost branch and bound little)
        self.pulls = (
            rebuild_pulls(lp, graph, saved, self.column, R, self.u_position)
            if self.integral and S * self.m <= PULL_CELLS
            else None
        )
        second = {} if self.pulls is None else self.pulls.second_runs()
        sigma = lp.vars(S, cost=1.0)
        E = lp.vars(S)  # rerun time placed before each backward op
        for k in range(n):
            lp.ub[E[k]] = 0.0
        # sum E = sum_q z[q] forward(q), as a chain of balances (one dense row costs the interior
        # point method a tenth at 640 layers): balance[k] = balance[k-1] + E[k] - the reruns of the
        # ops at position k, nothing left over at the end
        balance = lp.vars(S, lb=-np.inf)
        lp.lb[balance[-1]] = lp.ub[balance[-1]] = 0.0
        reruns_at: dict[int, list[tuple[int, float]]] = {}
        for q in rerun_ops:
            add_to(reruns_at, q, (zi[q], float(fwd_s[q])))
        for q, v in second.items():  # a second run costs and is placed like the first
            lp.c[v] = float(fwd_s[q])
            add_to(reruns_at, q, (v, float(fwd_s[q])))
        for k in range(S):
            idx, coef = [balance[k], E[k]], [1.0, -1.0]
            if k:
                idx.append(balance[k - 1])
                coef.append(-1.0)  # noqa: E702
            for v, w in reruns_at.get(k, ()):
                idx.append(v)
                coef.append(w)  # noqa: E702
            lp.eq(idx, coef, 0.0)
        self.E = E
        self.sigma = sigma

    def lanes(self) -> None:
        """The fluid lanes: bytes departed and arrived by each position, and the running sums of
        swapped bytes (produced, within forward life, needed, freed) and of kept bytes."""
        K, R, S, W, graph, last_fwd = self.K, self.R, self.S, self.W, self.graph, self.last_fwd
        lb_position, lp, nbytes, prod, saved = (
            self.lb_position,
            self.lp,
            self.nbytes,
            self.prod,
            self.saved,
        )
        tu, u_position = self.tu, self.u_position
        dur = relax_small(np.concatenate([graph.forward_s, graph.backward_s[::-1]]) / tu)
        dep = lp.vars(S)
        arr = lp.vars(S)
        # running sums of swapped bytes: produced (<= k), within forward life, needed, freed
        st_q: dict[int, Any] = {}
        st_f: dict[int, Any] = {}
        en_f: dict[int, Any] = {}
        st_need: dict[int, Any] = {}
        st_free: dict[int, Any] = {}
        st_keep: dict[int, Any] = {}
        en_keep: dict[int, Any] = {}
        for i, t in enumerate(saved):
            b = nbytes[t]
            add_to(st_q, prod[t], (W[i], b))
            add_to(st_f, prod[t], (W[i], b))
            add_to(en_f, last_fwd[t], (W[i], b))
            add_to(st_need, u_position[i], (W[i], b))
            add_to(st_free, lb_position[i] + 1, (W[i], b))
            add_to(st_keep, prod[t], (K[i], b))
            add_to(en_keep, lb_position[i], (K[i], b))
            add_to(st_keep, prod[t], (R[i], b))
            add_to(en_keep, last_fwd[t], (R[i], b))
            add_to(st_keep, u_position[i], (R[i], b))
            add_to(en_keep, lb_position[i], (R[i], b))
        Qp = lp.running_sum(S, st_q, {})
        F = lp.running_sum(S, st_f, en_f)
        Need = lp.running_sum(S, st_need, {})
        Freed = lp.running_sum(S, st_free, {})
        G = lp.running_sum(S, st_keep, en_keep)
        self.F = F
        self.Freed = Freed
        self.G = G
        self.Need = Need
        self.Qp = Qp
        self.arr = arr
        self.dep = dep
        self.dur = dur

    def memory(self) -> None:
        """Memory at every position: what any plan must hold there against the budget (with the rows
        of rebuilds that pull others along)."""
        E, F, Freed, G, Need, Qp = self.E, self.F, self.Freed, self.G, self.Need, self.Qp
        S, arr, bu, budget_bytes = self.S, self.arr, self.bu, self.budget_bytes
        dep, dur, graph, hw = self.dep, self.dur, self.graph, self.hw
        lp, nbytes, producer_delay = self.lp, self.nbytes, self.producer_delay
        sigma, tu = self.sigma, self.tu
        pulled = None if self.pulls is None else self.pulls.held(nbytes, S)
        bw_d = max(SMALLEST, hw.d2h_bytes_per_s * tu / bu)
        bw_h = max(SMALLEST, hw.h2d_bytes_per_s * tu / bu)
        # everything not saved, and workspaces, as keep-all has them
        base = expand(graph, keep_all_codes(graph), None, hw)
        main_points = base.position_first_point
        unsaved_mem = np.zeros(S)
        for t, s_, e_ in zip(base.iv_tensor, base.iv_start, base.iv_end):
            if not graph.is_saved[t]:
                unsaved_mem[s_ : e_ + 1] += nbytes[t]  # (already relaxed)
        ws = relax_small(base.point_workspace[main_points].astype(float) / bu)
        for k in range(S):
            if k == 0:
                lp.le([dep[0]], [1.0], 0.0)
                lp.le([arr[0]], [1.0], 0.0)
            else:
                lp.le(
                    [dep[k], dep[k - 1], sigma[k], E[k - 1]],
                    [1, -1, -bw_d, -bw_d],
                    bw_d * dur[k - 1],
                )
                lp.le(
                    [arr[k], arr[k - 1], sigma[k], E[k - 1]],
                    [1, -1, -bw_h, -bw_h],
                    bw_h * dur[k - 1],
                )
                if not hw.duplex:
                    lp.le(
                        [dep[k], arr[k], dep[k - 1], arr[k - 1], sigma[k], E[k - 1]],
                        [1, 1, -1, -1, -bw_d, -bw_d],
                        bw_d * dur[k - 1],
                    )
                # only what was produced before can leave, and what op k-1 produced only once it
                # ends: by the start of k (after its stall) at most the stall's worth of it
                if not producer_delay:
                    lp.le([dep[k], Qp[k - 1]], [1, -1], 0.0)
                elif k >= 2:
                    lp.le([dep[k], Qp[k - 2], sigma[k]], [1, -1, -bw_d], 0.0)
                else:
                    lp.le([dep[k], sigma[k]], [1, -bw_d], 0.0)
            lp.le([arr[k], dep[k]], [1, -1], 0.0)
            lp.le([Need[k], arr[k]], [1, -1], 0.0)
            cap = budget_bytes / bu - unsaved_mem[k] - ws[k]
            held = [G[k]] if pulled is None else [G[k], pulled[k]]
            ones = [1] * len(held)
            lp.le(held + [F[k]], ones + [1], cap)
            lp.le(held + [Qp[k], dep[k]], ones + [1, -1], cap)
            lp.le(held + [F[k], arr[k], Freed[k]], ones + [1, 1, -1], cap)
            lp.le(held + [Qp[k], dep[k], arr[k], Freed[k]], ones + [1, -1, 1, -1], cap)
        self.base = base
        self.bw_d = bw_d
        self.bw_h = bw_h
        self.main_points = main_points
        self.unsaved_mem = unsaved_mem
        self.ws = ws

    def add_departure_queue(self) -> None:
        """Whole tensors on the D2H lane at a few forward positions (integral only; lanequeue.py)."""
        Freed, G, Qp, W, arr, base = self.Freed, self.G, self.Qp, self.W, self.arr, self.base
        bu, budget_bytes, bw_d, dep, dur = self.bu, self.budget_bytes, self.bw_d, self.dep, self.dur
        graph, hw, integral, lp = self.graph, self.hw, self.integral, self.lp
        main_points, n, nbytes, saved = self.main_points, self.n, self.nbytes, self.saved
        tu, unsaved_mem, whole_departures = self.tu, self.unsaved_mem, self.whole_departures
        ws = self.ws
        queue_binaries = np.array([], dtype=int)
        if integral and whole_departures:
            # whole tensors on the D2H lane, at a few forward positions (lanequeue.py)
            from ..core.stepmodel import interval_memory
            from .lanequeue import QueueColumns, add_whole_departures, whole_departure_positions

            picks = whole_departure_positions(
                interval_memory(base)[main_points], budget_bytes, n, whole_departures
            )
            columns = QueueColumns(
                W,
                G,
                Qp,
                dep,
                arr,
                Freed,
                nbytes,
                dur,
                bw_d,
                hw.latency_s / tu,
                budget_bytes / bu - unsaved_mem - ws,
            )
            queue_binaries = add_whole_departures(
                lp,
                graph,
                saved,
                columns,
                picks,
                sure_ok=hw.duplex and not (hw.collectives_on_link and graph.collectives),
            )
        self.queue_binaries = queue_binaries

    def copies_within_step(self) -> None:
        """Every copy is done within the step: each lane's work fits in the step's compute, stall
        and rerun time (with collectives, a final wait)."""
        E, S, W, bu, bw_d, bw_h = self.E, self.S, self.W, self.bu, self.bw_d, self.bw_h
        dur, graph, hw, lp, m, nbytes = self.dur, self.graph, self.hw, self.lp, self.m, self.nbytes
        saved, sigma, tu = self.saved, self.sigma, self.tu
        # every copy is done within the step: each lane's work (the swapped tensors' copies with
        # their latency, and collectives that share the link) fits in the step's compute, stall and
        # rerun time, plus, with collectives, a final wait (the optimizer waits for the last one).
        # Latency per copy is what a fluid lane does not see: with it the bound sees a slow link.
        charged = bool(hw.collectives_on_link and graph.collectives)
        tail = lp.vars(1, cost=1.0) if charged else np.array([], dtype=int)
        coll_d = sum(c.d2h_bytes for c in graph.collectives) / bu if charged else 0.0
        coll_h = sum(c.h2d_bytes for c in graph.collectives) / bu if charged else 0.0
        lat = hw.latency_s / tu
        moved = [float(nbytes[t]) for t in saved]
        clock = list(sigma) + list(E) + list(tail)
        total = float(dur.sum())
        # the row is dense (every swap fraction): it is added only where it can matter, when the
        # copies' latency alone is a tenth of the step or collectives share the lanes
        if m and (charged or m * hw.latency_s > LATENCY_ROW_SHARE * graph.ideal_step_time_s):
            if hw.duplex:
                for bw, coll in ((bw_d, coll_d), (bw_h, coll_h)):
                    lp.le(
                        list(W) + clock,
                        [b / bw + lat for b in moved] + [-1.0] * len(clock),
                        total - coll / bw,
                    )
            else:
                lp.le(
                    list(W) + clock,
                    [b / bw_d + b / bw_h + 2 * lat for b in moved] + [-1.0] * len(clock),
                    total - coll_d / bw_d - coll_h / bw_h,
                )
        if charged:
            # a collective enters its lane when its position is reached and the lane is serial:
            # the collectives issued at or after position k all fit in the time from k to the end,
            # left[k] = sigma[k] + dur[k] + E[k] + left[k+1], left[S] = tail
            left = lp.vars(S + 1)  # time from position k to the end
            lp.eq([left[S], tail[0]], [1, -1], 0.0)
            for k in range(S - 1, -1, -1):
                lp.eq([left[k], left[k + 1], sigma[k], E[k]], [1, -1, -1, -1], float(dur[k]))
            after: dict[str, dict[int, float]] = {"d2h": {}, "h2d": {}}
            for c in graph.collectives:
                k = graph.collective_position(c)
                for lane, nb in (("d2h", c.d2h_bytes), ("h2d", c.h2d_bytes)):
                    if nb:
                        seconds = hw.d2h_time(nb) if lane == "d2h" else hw.h2d_time(nb)
                        key = lane if hw.duplex else "link"
                        after.setdefault(key, {})
                        after[key][k] = after[key].get(k, 0.0) + seconds / tu
            for per_position in after.values():
                need = 0.0
                for k in sorted(per_position, reverse=True):
                    need += per_position[k]
                    lp.le([left[k]], [-1.0], -need)

    def solve(self) -> Any:
        """The model solved (the LP, or with integral decisions the MILP) and its answer as an
        LPBound, never a wrong bound."""
        K, R, W, budget_bytes, gap = self.K, self.R, self.W, self.budget_bytes, self.gap
        gap_on_step, graph, highs_options = self.gap_on_step, self.graph, self.highs_options
        improving_solutions, integral = self.improving_solutions, self.integral
        kill_after_s, lp, max_iterations = self.kill_after_s, self.lp, self.max_iterations
        max_nodes, queue_binaries, saved = self.max_nodes, self.queue_binaries, self.saved
        start_clock, time_limit_s, tu = self.start_clock, self.time_limit_s, self.tu
        ideal = graph.ideal_step_time_s
        names = [graph.tensors[t].name for t in saved]
        mip_gap = 0.0

        if integral:
            # the gap is on the whole step (ideal + the objective's extra time), not on the extra
            # time alone: HiGHS stops once the absolute gap is that fraction of the ideal step
            res = lp.solve_integral(
                np.concatenate(
                    [K, W, R, queue_binaries]
                    + ([] if self.pulls is None else [sorted(self.pulls.binaries)])
                ).astype(np.int64),
                INTEGRAL_TIME_LIMIT_S if time_limit_s is None else time_limit_s,
                gap,
                improving_solutions=improving_solutions,
                abs_gap=gap * ideal / tu if gap_on_step else None,
                kill_after_s=kill_after_s,
                max_nodes=max_nodes,
                max_iterations=max_iterations,
                highs_options=highs_options,
            )
            wall = time.perf_counter() - start_clock
            if res.status == 2:
                return self.infeasible(res.message)
            if res.status not in (0, 1):
                return self.no_bound(Status.UNSOLVED, f"HiGHS status {res.status}: {res.message}")
            dual = res.mip_dual_bound
            if res.x is None:  # a limit before any integral point: the bound alone, if any
                bound_units = (
                    max(0.0, float(dual)) if dual is not None and np.isfinite(dual) else 0.0
                )
                step = ideal + bound_units * tu
                return LPBound(
                    min(1.0, ideal / step) if step > 0 else 1.0,
                    step,
                    ideal,
                    budget_bytes,
                    Status.TIMEOUT,
                    wall,
                    {},
                    {},
                    {},
                    integral=True,
                    gap=np.inf,
                    nodes=res.nodes,
                    clock_stopped=res.timed_out,
                    iterations=res.iterations,
                )
            objective = float(res.fun)
            if dual is None or not np.isfinite(dual):
                # optimal means within the relative gap; otherwise no bound is known but the trivial
                dual = objective * (1.0 - gap) if res.status == 0 else 0.0
            bound_units = max(0.0, min(objective, float(dual)))
            mip_gap = max(0.0, (objective - bound_units) / max(ideal / tu + objective, 1e-12))
            status = Status.OPTIMAL if res.status == 0 else Status.TIMEOUT
        else:
            # dual simplex is fastest on small models; past IPM_FROM_POSITIONS positions PIQP's interior
            # point method, several times faster there than HiGHS's (docs/tuning.md)
            if graph.n_positions > limits.IPM_FROM_POSITIONS:
                res = lp.solve_piqp(time_limit_s=time_limit_s, max_iterations=max_iterations)
                left = (
                    None
                    if time_limit_s is None
                    else time_limit_s - (time.perf_counter() - start_clock)
                )
                if res.status == 4 and (left is None or left > 0.1):
                    # PIQP failed (not a limit, not infeasible): HiGHS's IPX in the time left
                    res = lp.solve_interior(time_limit_s=left, max_iterations=max_iterations)
            else:
                res = lp.solve(time_limit_s=time_limit_s, max_iterations=max_iterations)
            wall = time.perf_counter() - start_clock
            if res.status == 2:
                return self.infeasible(res.message)
            if res.status == 1:
                return replace(
                    self.no_bound(Status.TIMEOUT, f"LP stopped at its limit: {res.message}"),
                    clock_stopped=res.timed_out,
                )
            if res.status != 0 or res.fun is None or not np.isfinite(res.fun):
                return self.no_bound(Status.UNSOLVED, f"HiGHS status {res.status}: {res.message}")
            bound_units = max(0.0, float(res.fun))
            status = Status.OPTIMAL
        x = res.x
        step = ideal + bound_units * tu
        return LPBound(
            retention=min(1.0, ideal / step) if step > 0 else 1.0,
            step_time_s=step,
            ideal_step_time_s=ideal,
            budget_bytes=budget_bytes,
            status=status,
            wall_s=wall,
            keep=dict(zip(names, x[K].round(6).tolist())),
            swap=dict(zip(names, x[W].round(6).tolist())),
            recompute=dict(zip(names, x[R].round(6).tolist())),
            integral=integral,
            gap=mip_gap,
            nodes=res.nodes if integral else None,
            clock_stopped=bool(integral and res.timed_out),
            iterations=res.iterations,
        )

    def no_bound(self, status: str, reason: str) -> LPBound:
        """Nothing proven: the trivial bound (the ideal step), which every plan respects."""
        ideal = self.graph.ideal_step_time_s
        return LPBound(
            1.0,
            ideal,
            ideal,
            self.budget_bytes,
            status,
            time.perf_counter() - self.start_clock,
            {},
            {},
            {},
            integral=self.integral,
            gap=np.inf,
            note=reason,
        )

    def infeasible(self, reason: str) -> LPBound:
        """HiGHS's "infeasible" is believed only below the smallest feasible budget; above it a
        plan exists (every tensor offloaded), so the answer is numerical trouble: no bound."""
        if self.budget_bytes < min_budget(self.graph, self.hw):
            return LPBound(
                0.0,
                np.inf,
                self.graph.ideal_step_time_s,
                self.budget_bytes,
                Status.INFEASIBLE,
                time.perf_counter() - self.start_clock,
                {},
                {},
                {},
                integral=self.integral,
            )
        return self.no_bound(
            Status.UNSOLVED, f"HiGHS reported infeasible at a feasible budget ({reason})"
        )
