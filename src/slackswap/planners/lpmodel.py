"""The LP bound's model as sparse rows (:class:`LinearModel`), and its solvers: HiGHS's dual
simplex in this process; HiGHS's interior point, PIQP, and HiGHS's branch and bound with
integer variables in a child process (planners/native.py: a crash is an error, the deadline
holds). An interior point method's value is lowered by a margin so that it stays a bound.
formulations/lp-bound.md, "Solving"."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from ..core.status import Status
from .scaling import MODEL_SCALE

# an interior point method's value is lowered by this share of the step (MODEL_SCALE units, or
# of the value if larger): its tolerances are absolute on its own scaling
IPM_MARGIN = 1e-6
PIQP_GAP = 1e-6  # PIQP's answer is believed when its relative duality gap is at most this


def _margin(value: float) -> float:
    """What an interior point method's value is lowered by, so that it stays a bound."""
    return IPM_MARGIN * max(MODEL_SCALE, abs(value))


class LinearModel:
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
        return LinearResult(
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
            return LinearResult(code, message, None, None, None, status == ms.kTimeLimit)
        value = float(h.getInfo().objective_function_value)
        x = np.array(h.getSolution().col_value)
        return LinearResult(0, message, x, value - _margin(value), None)

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
        from .limits import GRACE_S
        from .native import NativeSolverError, NativeTimeout, run_in_child

        options = {} if max_iterations is None else {"max_iterations": int(max_iterations)}
        deadline = None if time_limit_s is None else max(0.1, float(time_limit_s)) + GRACE_S
        try:
            answer = run_in_child("piqp", {"options": options}, self._arrays(), deadline)
        except NativeTimeout:
            return LinearResult(1, "PIQP killed at the time limit", None, None, None, True)
        except NativeSolverError as exc:
            return LinearResult(4, str(exc), None, None, None)
        # its own iteration limit (250) reached on a degenerate LP, or "infeasible" (seen on
        # feasible tiny LPs), is a failure, which HiGHS then answers; only a limit the caller set
        # is a limit
        code = {Status.OPTIMAL: 0, "work limit": 1 if max_iterations is not None else 4}.get(
            answer["status"], 4
        )
        if code != 0:
            return LinearResult(code, f"PIQP: {answer['message']}", None, None, None)
        if not answer["duality_gap_rel"] <= PIQP_GAP:
            return LinearResult(
                4,
                f"PIQP ended with a relative duality gap of {answer['duality_gap_rel']:.1e}",
                None,
                None,
                None,
            )
        value = min(float(answer["fun"]), float(answer["dual_bound"]))
        return LinearResult(
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
        start: dict[int, float] | None = None,
    ):
        """The same model with ``integer_vars`` integral (HiGHS branch and bound), in a child
        process (planners/native.py): a crash is an error, the deadline holds. ``start``: values
        of some variables, HiGHS's starting solution (it completes the rest).
        ``improving_solutions`` (improving solutions), ``max_nodes`` (branch-and-bound nodes) and
        ``max_iterations`` (simplex iterations over the whole search, the root node's included)
        are work limits, the same on any machine; the time limit is only a cap."""
        from .limits import GRACE_S
        from .native import NativeSolverError, NativeTimeout, run_in_child

        integrality = np.zeros(self.n)
        integrality[integer_vars] = 1
        arrays = {**self._arrays(), "integrality": integrality}
        if start:
            arrays["start_index"] = np.array(sorted(start), dtype=np.int64)
            arrays["start_value"] = np.array([float(start[i]) for i in sorted(start)])
        limit = max(0.1, float(time_limit_s))
        options: dict[str, Any] = {"time_limit_s": limit, "gap": gap}
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
                and not start
            ):
                answer = run_in_child(
                    "scipy", {"problem": "milp", "options": options}, arrays, kill
                )
                answer["status"] = {0: Status.OPTIMAL, 1: "time limit", 2: Status.INFEASIBLE}.get(
                    answer["status"], Status.FAILED
                )
            else:
                answer = run_in_child("highs-mip", {"options": options}, arrays, kill)
        except NativeTimeout:
            return LinearResult(1, "killed at the deadline", None, None, None, True)
        except NativeSolverError as exc:
            return LinearResult(4, str(exc), None, None, None)
        code = {Status.OPTIMAL: 0, Status.INFEASIBLE: 2, "time limit": 1, "work limit": 1}.get(
            answer["status"], 4
        )
        x = None if answer["x"] is None else np.array(answer["x"])
        return LinearResult(
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
class LinearResult:
    """What scipy's HiGHS answered: 0 optimal, 1 limit reached, 2 infeasible, others failures."""

    status: int
    message: str
    x: np.ndarray | None
    fun: float | None
    mip_dual_bound: float | None
    timed_out: bool = False  # the wall-clock cap, not a work limit, stopped it
    nodes: int | None = None  # branch-and-bound nodes HiGHS explored (its work)
    iterations: int | None = None  # simplex iterations (its work)
