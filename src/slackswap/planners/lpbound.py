"""An upper bound on the retention any plan can reach: a linear relaxation solved with HiGHS.

Each saved tensor is split fractionally between keep, swap and recompute. Memory at every
position counts what any plan must hold there (formulations/lp-bound.md): kept tensors, the
smallest residency of swapped and recomputed ones, offloads the D2H lane cannot have finished yet,
and prefetches the H2D lane must already have landed. The lanes move at most bandwidth x elapsed
time, stalls buy time at their cost, and reruns cost their ops' forward time. Every valid plan is
a feasible point, so the optimum bounds the best retention from above.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from ..core.budget import min_budget, parse_budget
from ..core.graph import ActivationGraph
from ..core.hardware import Hardware, hardware
from ..core.stepmodel import expand, keep_all_codes


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


class _LP:
    """Sparse LP builder: named variable blocks, rows of (index, coefficient)."""

    def __init__(self) -> None:
        self.n = 0
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.c: list[float] = []
        self.rows_ub: list[tuple[list[int], list[float], float]] = []
        self.rows_eq: list[tuple[list[int], list[float], float]] = []

    def vars(self, count: int, lb=0.0, ub=np.inf, cost=0.0) -> np.ndarray:
        idx = np.arange(self.n, self.n + count)
        self.n += count
        self.lb.extend([lb] * count)
        self.ub.extend([ub] * count)
        self.c.extend(np.broadcast_to(np.asarray(cost, dtype=float), (count,)).tolist())
        return idx

    def le(self, idx, coef, rhs: float) -> None:
        self.rows_ub.append((list(idx), list(coef), float(rhs)))

    def eq(self, idx, coef, rhs: float) -> None:
        self.rows_eq.append((list(idx), list(coef), float(rhs)))

    def running_sum(
        self,
        S: int,
        starts: dict[int, list[tuple[int, float]]],
        ends: dict[int, list[tuple[int, float]]],
    ) -> np.ndarray:
        """Per-position variables V_k = sum of coef*x over intervals covering k (inclusive)."""
        V = self.vars(S, lb=-np.inf)
        for k in range(S):
            idx, coef = [V[k]], [1.0]
            if k:
                idx.append(V[k - 1])
                coef.append(-1.0)  # noqa: E702
            for v, w in starts.get(k, ()):
                idx.append(v)
                coef.append(-w)  # noqa: E702
            for v, w in ends.get(k - 1, ()):
                idx.append(v)
                coef.append(w)  # noqa: E702
            self.eq(idx, coef, 0.0)
        return V

    @staticmethod
    def _matrix(rows, n):
        data, ri, ci, b = [], [], [], []
        for r, (idx, coef, rhs) in enumerate(rows):
            ri.extend([r] * len(idx))
            ci.extend(idx)
            data.extend(coef)
            b.append(rhs)
        return coo_matrix((data, (ri, ci)), shape=(len(rows), n)).tocsr(), np.array(b)

    def solve(
        self,
        time_limit_s: float | None = None,
        max_iterations: int | None = None,
        method: str = "highs",
    ):
        """The LP (HiGHS through scipy, in this process: an LP solve is robust and fast)."""
        A_ub, b_ub = self._matrix(self.rows_ub, self.n)
        A_eq, b_eq = self._matrix(self.rows_eq, self.n)
        options = {}
        if time_limit_s is not None:
            options["time_limit"] = max(0.01, float(time_limit_s))
        if max_iterations is not None:
            options["maxiter"] = int(max_iterations)
        res = linprog(
            np.array(self.c),
            A_ub=A_ub,
            b_ub=b_ub,
            A_eq=A_eq,
            b_eq=b_eq,
            bounds=list(zip(self.lb, self.ub)),
            method=method,
            options=options,
        )
        # status 1 is either limit: the message says which (HiGHS's "Time limit reached")
        timed_out = int(res.status) == 1 and "time" in str(res.message).lower()
        return _Result(
            int(res.status),
            str(res.message),
            res.x,
            None if res.fun is None else float(res.fun),
            None,
            timed_out,
            iterations=int(getattr(res, "nit", 0) or 0),
        )

    def solve_interior(self, time_limit_s: float | None = None, max_iterations: int | None = None):
        """The LP by HiGHS's interior point method without crossover (highspy, in this process):
        the bound needs the optimal value, not a vertex, and crossover took 40% of the time at
        640 layers. The value is HiGHS's within its IPM tolerance (1e-8 of it): it is lowered by
        IPM_MARGIN of the step (model units) so that it stays below the optimum."""
        import highspy

        A_ub, b_ub = self._matrix(self.rows_ub, self.n)
        A_eq, b_eq = self._matrix(self.rows_eq, self.n)
        from scipy.sparse import vstack

        A = vstack([A_ub, A_eq]).tocsc()
        inf = highspy.kHighsInf
        lb, ub = np.array(self.lb), np.array(self.ub)
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = self.n, A.shape[0]
        lp.col_cost_ = np.array(self.c)
        lp.col_lower_ = np.where(np.isfinite(lb), lb, -inf)
        lp.col_upper_ = np.where(np.isfinite(ub), ub, inf)
        lp.row_lower_ = np.concatenate([np.full(len(b_ub), -inf), b_eq])
        lp.row_upper_ = np.concatenate([b_ub, b_eq])
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = A.indptr
        lp.a_matrix_.index_ = A.indices
        lp.a_matrix_.value_ = A.data
        h = _quiet_highs(highspy)
        h.setOptionValue("solver", "ipm")
        h.setOptionValue("run_crossover", "off")
        h.setOptionValue("threads", 1)
        h.setOptionValue("random_seed", 0)
        if time_limit_s is not None:
            h.setOptionValue("time_limit", max(0.01, float(time_limit_s)))
        if max_iterations is not None:
            h.setOptionValue("ipm_iteration_limit", int(max_iterations))
        h.passModel(lp)
        began = time.perf_counter()
        h.run()
        ms = highspy.HighsModelStatus
        status = h.getModelStatus()
        codes = {ms.kOptimal: 0, ms.kTimeLimit: 1, ms.kIterationLimit: 1, ms.kInfeasible: 2}
        if status not in codes:
            # the interior point ended imprecise and unconfirmed: again with crossover, in the
            # time left, rather than no bound at all
            h.setOptionValue("run_crossover", "on")
            if time_limit_s is not None:
                h.setOptionValue(
                    "time_limit", max(0.01, float(time_limit_s) - (time.perf_counter() - began))
                )
            h.run()
            status = h.getModelStatus()
        code = codes.get(status, 4)
        message = h.modelStatusToString(status)
        if code != 0:
            return _Result(code, message, None, None, None, status == ms.kTimeLimit)
        value = float(h.getInfo().objective_function_value)
        x = np.array(h.getSolution().col_value)
        return _Result(0, message, x, value - _margin(value), None)

    def _arrays(self) -> dict[str, np.ndarray]:
        """The model as arrays for a solver in a child process (planners/native.py)."""
        A_ub, b_ub = self._matrix(self.rows_ub, self.n)
        A_eq, b_eq = self._matrix(self.rows_eq, self.n)
        arrays = {
            "c": np.array(self.c),
            "b_ub": b_ub,
            "b_eq": b_eq,
            "lb": np.array(self.lb),
            "ub_vars": np.array(self.ub),
        }
        for name, A in (("ub", A_ub), ("eq", A_eq)):
            arrays.update(
                {
                    f"{name}_data": A.data,
                    f"{name}_indices": A.indices,
                    f"{name}_indptr": A.indptr,
                    f"{name}_shape": np.array(A.shape),
                }
            )
        return arrays

    def solve_piqp(self, time_limit_s: float | None = None, max_iterations: int | None = None):
        """The LP by PIQP's interior point method (a direct sparse LDL factorisation) in a child
        process: a crash is an error and the time limit holds. On the long chains of running sums
        it is about 10x faster than HiGHS's IPX at 640 layers (9.7 s against 108 s), whose
        conjugate gradients need ever more iterations as the chains grow. The value is the
        smaller of PIQP's primal and dual objectives, lowered by IPM_MARGIN of the step; a solve
        whose relative duality gap is above PIQP_GAP is not believed (status 4)."""
        from .native import GRACE_S, NativeSolverError, NativeTimeout, run_in_child

        options = {} if max_iterations is None else {"max_iterations": int(max_iterations)}
        deadline = None if time_limit_s is None else max(0.1, float(time_limit_s)) + GRACE_S
        try:
            answer = run_in_child("piqp", {"options": options}, self._arrays(), deadline)
        except NativeTimeout:
            return _Result(1, "PIQP killed at the time limit", None, None, None, True)
        except NativeSolverError as exc:
            return _Result(4, str(exc), None, None, None)
        # its own iteration limit (250) reached on a degenerate LP, or "infeasible" (seen on
        # feasible tiny LPs), is a failure, which HiGHS then answers; only a limit the caller set
        # is a limit
        code = {"optimal": 0, "work limit": 1 if max_iterations is not None else 4}.get(
            answer["status"], 4
        )
        if code != 0:
            return _Result(code, f"PIQP: {answer['message']}", None, None, None)
        if not answer["duality_gap_rel"] <= PIQP_GAP:
            return _Result(
                4,
                f"PIQP ended with a relative duality gap of {answer['duality_gap_rel']:.1e}",
                None,
                None,
                None,
            )
        value = min(float(answer["fun"]), float(answer["dual_bound"]))
        return _Result(
            0, f"PIQP: {answer['message']}", np.array(answer["x"]), value - _margin(value), None
        )

    def solve_integral(
        self,
        integer_vars: np.ndarray,
        time_limit_s: float,
        gap: float,
        *,
        improving_solutions: int | None = None,
        abs_gap: float | None = None,
        kill_after_s: float | None = None,
        max_nodes: int | None = None,
        max_iterations: int | None = None,
        highs_options: dict[str, Any] | None = None,
    ):
        """The same model with ``integer_vars`` integral (HiGHS branch and bound), in a child
        process (planners/native.py): a crash is an error, the deadline holds.
        ``improving_solutions`` (improving solutions), ``max_nodes`` (branch-and-bound nodes) and
        ``max_iterations`` (simplex iterations over the whole search, the root node's included)
        are work limits, the same on any machine; the time limit is only a cap."""
        from .native import GRACE_S, NativeSolverError, NativeTimeout, run_in_child

        integrality = np.zeros(self.n)
        integrality[integer_vars] = 1
        arrays = {**self._arrays(), "integrality": integrality}
        limit = max(0.1, float(time_limit_s))
        options = {"time_limit_s": limit, "gap": gap}
        if abs_gap is not None:
            options["abs_gap"] = float(abs_gap)
        if improving_solutions is not None:
            options["mip_max_improving_sols"] = int(improving_solutions)
        if max_nodes is not None:
            options["mip_max_nodes"] = int(max_nodes)
        if max_iterations is not None:
            options["simplex_iteration_limit"] = int(max_iterations)
        if highs_options:
            options["highs"] = dict(highs_options)
        # HiGHS checks its own limit only now and then (not in presolve or the root LP): the
        # child is killed later, at ``kill_after_s`` (the caller's deadline), so an incumbent
        # found a little late is not thrown away
        kill = limit + GRACE_S + 1.0 if kill_after_s is None else max(kill_after_s, limit)
        try:
            if (
                abs_gap is None
                and improving_solutions is None
                and max_nodes is None
                and max_iterations is None
                and not highs_options
            ):
                answer = run_in_child(
                    "scipy", {"problem": "milp", "options": options}, arrays, kill
                )
                answer["status"] = {0: "optimal", 1: "time limit", 2: "infeasible"}.get(
                    answer["status"], "failed"
                )
            else:
                answer = run_in_child("highs-mip", {"options": options}, arrays, kill)
        except NativeTimeout:
            return _Result(1, "killed at the deadline", None, None, None, True)
        except NativeSolverError as exc:
            return _Result(4, str(exc), None, None, None)
        code = {"optimal": 0, "infeasible": 2, "time limit": 1, "work limit": 1}.get(
            answer["status"], 4
        )
        x = None if answer["x"] is None else np.array(answer["x"])
        return _Result(
            code,
            f"{answer['status']}: {answer['message']}",
            x,
            answer["fun"],
            answer["dual_bound"],
            answer["status"] == "time limit",
            answer.get("nodes"),
            answer.get("iterations"),
        )


def _quiet_highs(highspy):
    """A Highs instance with its output off; its constructor prints a banner to the process's
    standard output (C level), which a library must not: that descriptor points elsewhere
    meanwhile."""
    import os
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    h.setOptionValue("output_flag", False)
    return h


@dataclass(frozen=True)
class _Result:
    """What scipy's HiGHS answered: 0 optimal, 1 limit reached, 2 infeasible, others failures."""

    status: int
    message: str
    x: np.ndarray | None
    fun: float | None
    mip_dual_bound: float | None
    timed_out: bool = False  # the wall-clock cap, not a work limit, stopped it
    nodes: int | None = None  # branch-and-bound nodes HiGHS explored (its work)
    iterations: int | None = None  # simplex iterations (its work)


LATENCY_ROW_SHARE = 0.1  # the every-copy-within-the-step row is added past this latency share
SMALLEST = 1e-6  # model units: smaller coefficients are rounded in the relaxing direction
IPM_FROM_SLOTS = 2500  # positions above which the LP is solved by an interior point method
# the budget and the ideal step (or the copy time, with no compute) in model units
MODEL_SCALE = 1000.0
# an interior point method's value is lowered by this share of the step (MODEL_SCALE units, or
# of the value if larger): PIQP's answer on a graph whose best plan has no overhead was 1e-7 of
# the step above the optimum (its tolerances are absolute on its own scaling)
IPM_MARGIN = 1e-6
PIQP_GAP = 1e-6  # PIQP's answer is believed when its relative duality gap is at most this


def _margin(value: float) -> float:
    """What an interior point method's value is lowered by, so that it stays a bound."""
    return IPM_MARGIN * max(MODEL_SCALE, abs(value))


def _relax_small(values: np.ndarray) -> np.ndarray:
    """Sizes and durations below SMALLEST units become 0: less memory and less time relax the
    model, so its optimum stays a lower bound on every plan's step time."""
    return np.where(values < SMALLEST, 0.0, values)


PULL_DEPTH = 4  # rebuild chains followed this many tensors deep
PULL_VARS_PER_TENSOR = 16  # at most this many chain variables per saved tensor in all
# the rows are built up to this many positions x saved tensors (SegNet: 11,440; BERT-Large:
# 182,000, where they made HiGHS's branch and bound of GPT-2 XL at 50% twice as slow and Llama-7B's
# three times, with the same bound)
PULL_CELLS = 100_000


def _rebuild_pulls(
    lp: _LP, graph: ActivationGraph, saved, column: dict[int, int], R, u_slot, nbytes, S: int
) -> np.ndarray | None:
    """rebuild_pull[x, chain, z] (lp-bound.md, "Rebuilds pull others along"): a recomputed x is
    rebuilt by its first backward use; its rerun reads its frontier, and a recomputed frontier
    tensor is rebuilt then too (or earlier), as is a recomputed output of any op rerun for it,
    recursively, and a rebuilt tensor lives until its last use. So where every tensor of such a
    chain from x is recomputed, its last, z, is resident from x's first use on, earlier than its
    own. One variable per chain, at least the AND of its decisions; per z and slot the OR of the
    chains covering it (never counted twice). A kept frontier tensor is not extended here: x
    may be rebuilt earlier than its first use (pulled by another), when the kept one is still
    resident."""
    covers: dict[int, dict[int, list[int]]] = {}  # z's column -> first slot -> chain variables
    chains_left = PULL_VARS_PER_TENSOR * len(saved)
    for i, x in enumerate(saved):
        if not graph.can_recompute[x]:
            continue
        ux = int(u_slot[i])
        # (tensor, chain of R columns from x to it) in breadth-first order
        frontier = [(int(x), [i])]
        seen = {int(x)}
        for _ in range(PULL_DEPTH - 1):
            nxt = []
            for y, chain in frontier:
                reached = {int(t) for t in graph.rerun_frontier[y]}
                reached |= {int(o) for q in graph.rerun_ops[y] for o in graph.op_outputs[q]}
                for z in sorted(reached - seen):
                    j = column.get(z)
                    if j is None:
                        continue
                    seen.add(z)
                    uz = int(u_slot[j])
                    if graph.can_recompute[z]:
                        nxt.append((z, chain + [j]))
                        if ux < uz:  # rebuilt with x, before its own first use
                            covers.setdefault(j, {}).setdefault(ux, []).append(
                                _and(lp, [R[c] for c in chain + [j]])
                            )
                            chains_left -= 1
                    if chains_left <= 0:
                        break
                if chains_left <= 0:
                    break
            frontier = nxt
            if chains_left <= 0 or not frontier:
                break
        if chains_left <= 0:
            break
    if not covers:
        return None
    starts: dict[int, list[tuple[int, float]]] = {}
    ends: dict[int, list[tuple[int, float]]] = {}
    for j, by_slot in covers.items():
        # resident from the earliest active chain's slot to u_z - 1: per segment between the
        # chains' distinct slots, held if any chain started by then is active
        slots = sorted(by_slot) + [int(u_slot[j])]
        active: list[int] = []
        for a, first in enumerate(slots[:-1]):
            active += by_slot[first]
            held = lp.vars(1, ub=1.0)[0]
            for v in active:
                lp.le([v, held], [1, -1], 0.0)
            _add(starts, first, (held, nbytes[int(saved[j])]))
            _add(ends, slots[a + 1] - 1, (held, nbytes[int(saved[j])]))
    return lp.running_sum(S, starts, ends)


def _and(lp: _LP, variables: list[int]) -> int:
    """A variable at least the AND of binary ``variables``."""
    v = lp.vars(1, ub=1.0)[0]
    lp.le(list(variables) + [v], [1.0] * len(variables) + [-1.0], len(variables) - 1.0)
    return v


def _add(d: dict, k: int, item) -> None:
    d.setdefault(int(k), []).append(item)


def lp_bound(
    graph: ActivationGraph,
    budget,
    hw: Hardware | str,
    *,
    integral: bool = False,
    time_limit_s: float | None = None,
    gap: float = 1e-4,
    producer_delay: bool = True,
    improving_solutions: int | None = None,
    max_iterations: int | None = None,
    gap_on_step: bool = True,
    kill_after_s: float | None = None,
    max_nodes: int | None = None,
    allowed=None,
    pins=None,
    mask: np.ndarray | None = None,
    whole_departures: int = 0,
    highs_options: dict[str, Any] | None = None,
) -> LPBound:
    """Upper bound on the retention of any plan for ``graph`` within ``budget`` on ``hw``.

    integral: make the keep/swap/recompute fractions binary and solve the MILP (HiGHS) for at
    most ``time_limit_s``. Every plan's decisions are integral, so its dual bound is still a valid
    bound, usually a little tighter; its decisions (the incumbent) are a good starting point for
    a plan, whose schedule the relaxation does not model (formulations/lp-bound.md).
    producer_delay=False lets a tensor start to leave the instant it exists: a looser relaxation
    whose integral decisions are another starting point for a plan.

    ``allowed``, ``pins`` (as for ``solve``) or a ready ``mask``: the bound of the restricted
    problem, where a decision a tensor may not take has fraction 0.

    ``whole_departures`` (integral only): at the first forward position where keeping
    everything tops the budget, the one most over it, and this many more, a swapped tensor is
    freed only once its whole copy, behind every swapped tensor produced before it, is done
    (lanequeue.py): a tighter bound where single copies take a large share of the forward pass
    (CNNs), at the cost of binaries; 0 (the default) leaves the fluid lanes alone.

    ``gap_on_step``: the integral relaxation stops once its gap is ``gap`` of the whole step
    (False: of the extra time alone, HiGHS's own measure, which runs much longer).
    Limits: ``improving_solutions`` and ``max_nodes`` (integral: stop after that many improving
    solutions, branch-and-bound nodes) and ``max_iterations`` (LP) are work limits, the same on
    any machine;
    ``time_limit_s`` (default 10 s integral, none for the LP) is a hard cap. The status says what
    the bound is: "optimal", "timeout" (a limit stopped it; the bound is what was proven),
    "infeasible" (the budget is below the smallest feasible one), or "unsolved" (HiGHS failed;
    the bound is the trivial one, the ideal step, and ``note`` says why). Never a wrong bound.
    """
    start_clock = time.perf_counter()
    if (
        isinstance(whole_departures, bool)
        or not isinstance(whole_departures, int | np.integer)
        or whole_departures < 0
    ):
        raise ValueError(
            f"lp_bound: whole_departures must be a whole number of positions >= 0, "
            f"got {whole_departures!r}"
        )
    if whole_departures and not integral:
        # its rows need integral decisions and binaries: without them it would be ignored
        raise ValueError("lp_bound: whole_departures needs integral=True (its rows are binaries)")
    hw = hardware(hw)
    budget_bytes = parse_budget(budget, graph, hw)
    if integral and time_limit_s is None:
        time_limit_s = 10.0
    n = graph.n_ops
    S = graph.n_slots
    saved = graph.saved
    m = len(saved)
    # scale bytes and seconds so the budget and the ideal step are both about 1000 units: HiGHS
    # tolerances are absolute, and raw bytes (1e9) beside seconds (1e-5) lose feasible points.
    # Coefficients that would still fall below SMALLEST units are rounded the way that relaxes
    # the model (bytes and op times down, lane bandwidth up), so the bound stays a bound
    # (formulations/lp-bound.md, "Scaling").
    saved_bytes = float(graph.tensor_bytes[graph.saved].sum())
    copy_s = saved_bytes / min(hw.d2h_bytes_per_s, hw.h2d_bytes_per_s) + hw.latency_s * len(
        graph.saved
    )
    bu = max(budget_bytes, int(graph.tensor_bytes.max(initial=0)), 1) / MODEL_SCALE
    # a step of no time or of denormal seconds (2e-313 s): the copies set the unit, and never one
    # so small that a copy's or a collective's seconds overflow to inf in units
    ideal_s = graph.ideal_step_time_s
    tu = (ideal_s if ideal_s >= 1e-12 else max(copy_s, 1e-12)) / MODEL_SCALE
    nbytes = _relax_small(graph.tensor_bytes.astype(float) / bu)
    fwd_s = _relax_small(graph.forward_s / tu)
    prod = graph.producer
    last_fwd = graph.last_forward_use
    u_slot = np.array([graph.bwd_slot(int(u)) for u in graph.first_backward_use[saved]])
    lb_slot = np.array([graph.bwd_slot(int(v)) for v in graph.last_backward_use[saved]])
    lp = _LP()
    K = lp.vars(m, ub=1.0)
    W = lp.vars(m, ub=1.0)  # swap
    R = lp.vars(m, ub=1.0)
    if mask is None and (allowed is not None or pins):
        from ..core.restrict import decision_mask

        mask = decision_mask(graph, allowed, pins, hardware(hw).min_swap_bytes)
    for i, t in enumerate(saved):
        lp.eq([K[i], W[i], R[i]], [1, 1, 1], 1.0)
        if not graph.can_recompute[t]:
            lp.ub[R[i]] = 0.0
        if mask is not None:
            for var, code in ((K[i], 0), (W[i], 1), (R[i], 2)):
                if not mask[t, code]:
                    lp.ub[var] = 0.0
    column = {int(t): i for i, t in enumerate(saved)}
    for group in graph.rng_groups.values():
        members = [column[t] for t in group]
        for a, b in zip(members, members[1:]):
            lp.eq([R[a], R[b]], [1, -1], 0.0)
    rerun_ops = sorted({q for t in saved for q in graph.rerun_ops[t]})
    Z = lp.vars(len(rerun_ops), ub=1.0, cost=fwd_s[rerun_ops] if rerun_ops else 0.0)
    zi = {q: Z[j] for j, q in enumerate(rerun_ops)}
    for i, t in enumerate(saved):
        for q in graph.rerun_ops[t]:
            lp.le([R[i], zi[q]], [1, -1], 0.0)
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
        _add(reruns_at, q, (zi[q], float(fwd_s[q])))
    for k in range(S):
        idx, coef = [balance[k], E[k]], [1.0, -1.0]
        if k:
            idx.append(balance[k - 1])
            coef.append(-1.0)  # noqa: E702
        for v, w in reruns_at.get(k, ()):
            idx.append(v)
            coef.append(w)  # noqa: E702
        lp.eq(idx, coef, 0.0)
    dur = _relax_small(np.concatenate([graph.forward_s, graph.backward_s[::-1]]) / tu)
    dep = lp.vars(S)
    arr = lp.vars(S)
    # running sums of swapped bytes: produced (<= k), within forward life, needed, freed
    st_q, st_f, en_f, st_need, st_free, st_keep, en_keep = {}, {}, {}, {}, {}, {}, {}
    for i, t in enumerate(saved):
        b = nbytes[t]
        _add(st_q, prod[t], (W[i], b))
        _add(st_f, prod[t], (W[i], b))
        _add(en_f, last_fwd[t], (W[i], b))
        _add(st_need, u_slot[i], (W[i], b))
        _add(st_free, lb_slot[i] + 1, (W[i], b))
        _add(st_keep, prod[t], (K[i], b))
        _add(en_keep, lb_slot[i], (K[i], b))
        _add(st_keep, prod[t], (R[i], b))
        _add(en_keep, last_fwd[t], (R[i], b))
        _add(st_keep, u_slot[i], (R[i], b))
        _add(en_keep, lb_slot[i], (R[i], b))
    Qp = lp.running_sum(S, st_q, {})
    F = lp.running_sum(S, st_f, en_f)
    Need = lp.running_sum(S, st_need, {})
    Freed = lp.running_sum(S, st_free, {})
    G = lp.running_sum(S, st_keep, en_keep)
    # rebuilds pull others along (integral decisions only: for fractions the rows are void;
    # graphs of at most PULL_CELLS positions x saved tensors, where they cost branch and bound
    # little)
    pulled = (
        _rebuild_pulls(lp, graph, saved, column, R, u_slot, nbytes, S)
        if integral and S * m <= PULL_CELLS
        else None
    )
    bw_d = max(SMALLEST, hw.d2h_bytes_per_s * tu / bu)
    bw_h = max(SMALLEST, hw.h2d_bytes_per_s * tu / bu)
    # everything not saved, and workspaces, as keep-all has them
    base = expand(graph, keep_all_codes(graph), None, hw)
    main_points = base.slot_first_point
    unsaved_mem = np.zeros(S)
    for t, s_, e_ in zip(base.iv_tensor, base.iv_start, base.iv_end):
        if not graph.is_saved[t]:
            unsaved_mem[s_ : e_ + 1] += nbytes[t]  # (already relaxed)
    ws = _relax_small(base.point_workspace[main_points].astype(float) / bu)
    for k in range(S):
        if k == 0:
            lp.le([dep[0]], [1.0], 0.0)
            lp.le([arr[0]], [1.0], 0.0)
        else:
            lp.le(
                [dep[k], dep[k - 1], sigma[k], E[k - 1]], [1, -1, -bw_d, -bw_d], bw_d * dur[k - 1]
            )
            lp.le(
                [arr[k], arr[k - 1], sigma[k], E[k - 1]], [1, -1, -bw_h, -bw_h], bw_h * dur[k - 1]
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
            k = graph.collective_slot(c)
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
    ideal = graph.ideal_step_time_s
    names = [graph.tensors[t].name for t in saved]
    mip_gap = 0.0

    def no_bound(status: str, reason: str, integral_: bool = integral) -> LPBound:
        """Nothing proven: the trivial bound (the ideal step), which every plan respects."""
        return LPBound(
            1.0,
            ideal,
            ideal,
            budget_bytes,
            status,
            time.perf_counter() - start_clock,
            {},
            {},
            {},
            integral=integral_,
            gap=np.inf,
            note=reason,
        )

    def infeasible(reason: str) -> LPBound:
        # HiGHS's "infeasible" is believed only below the smallest feasible budget; above it a
        # plan exists (every tensor offloaded), so the answer is numerical trouble: no bound
        if budget_bytes < min_budget(graph, hw):
            return LPBound(
                0.0,
                np.inf,
                ideal,
                budget_bytes,
                "infeasible",
                time.perf_counter() - start_clock,
                {},
                {},
                {},
                integral=integral,
            )
        return no_bound("unsolved", f"HiGHS reported infeasible at a feasible budget ({reason})")

    if integral:
        # the gap is on the whole step (ideal + the objective's extra time), not on the extra
        # time alone: HiGHS stops once the absolute gap is that fraction of the ideal step
        res = lp.solve_integral(
            np.concatenate([K, W, R, queue_binaries]),
            time_limit_s,
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
            return infeasible(res.message)
        if res.status not in (0, 1):
            return no_bound("unsolved", f"HiGHS status {res.status}: {res.message}")
        dual = res.mip_dual_bound
        if res.x is None:  # a limit before any integral point: the bound alone, if any
            bound_units = max(0.0, float(dual)) if dual is not None and np.isfinite(dual) else 0.0
            step = ideal + bound_units * tu
            return LPBound(
                min(1.0, ideal / step) if step > 0 else 1.0,
                step,
                ideal,
                budget_bytes,
                "timeout",
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
        status = "optimal" if res.status == 0 else "timeout"
    else:
        # dual simplex is fastest on small models; past IPM_FROM_SLOTS positions PIQP's interior
        # point method (640-layer transformer: 13 s with the model's build; HiGHS's IPX without
        # crossover 56-108 s, dual simplex 352 s; 16 layers: dual simplex 0.16 s)
        if graph.n_slots > IPM_FROM_SLOTS:
            res = lp.solve_piqp(time_limit_s=time_limit_s, max_iterations=max_iterations)
            left = (
                None if time_limit_s is None else time_limit_s - (time.perf_counter() - start_clock)
            )
            if res.status == 4 and (left is None or left > 0.1):
                # PIQP failed (not a limit, not infeasible): HiGHS's IPX in the time left
                res = lp.solve_interior(time_limit_s=left, max_iterations=max_iterations)
        else:
            res = lp.solve(time_limit_s=time_limit_s, max_iterations=max_iterations)
        wall = time.perf_counter() - start_clock
        if res.status == 2:
            return infeasible(res.message)
        if res.status == 1:
            return replace(
                no_bound("timeout", f"LP stopped at its limit: {res.message}"),
                clock_stopped=res.timed_out,
            )
        if res.status != 0 or res.fun is None or not np.isfinite(res.fun):
            return no_bound("unsolved", f"HiGHS status {res.status}: {res.message}")
        bound_units = max(0.0, float(res.fun))
        status = "optimal"
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
