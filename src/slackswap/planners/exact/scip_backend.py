"""SCIP through OR-Tools' linear solver wrapper (``pywraplp``, installed with OR-Tools): the same
formulation as CBC and HiGHS, enforcement literals as big-M rows from the variables' bounds
(formulations/milp.md, "Backends"), solved in this process with one thread. Its work limit is
SCIP's node limit (the driver's ``max_nodes``), its time limit the remaining clock."""

from __future__ import annotations

import time
from typing import Any

from ...core.status import Status
from ..base import installed
from ..limits import SCIP_BUILD_S_PER_NONZERO
from .driver import ExactBackend
from .formulation import Formulation
from .result import BackendResult


def _scip_model(f: Formulation, fixed: dict[int, int] | None):
    from ortools.linear_solver import pywraplp

    solver = pywraplp.Solver.CreateSolver("SCIP")
    if solver is None:
        raise ImportError("OR-Tools was built without SCIP")
    m = f.model
    fixed = fixed or {}
    x = []
    for v in m.vars:
        lb, ub = (fixed[v.index], fixed[v.index]) if v.index in fixed else (v.lb, v.ub)
        x.append(
            solver.IntVar(lb, ub, f"v{v.index}")
            if v.lp_integral
            else solver.NumVar(lb, ub, f"v{v.index}")
        )
    infinity = solver.infinity()
    for c in m.constraints:
        lo_b, hi_b = m.bounds_of(c.terms)
        k = len(c.enforce)
        # with k enforcement literals each side is relaxed by M * (k - sum(literals)), M from the
        # variables' bounds: the literals move to the left with coefficient -+M
        sides: list[tuple[float, float, int, str]] = []
        if c.hi is not None:
            big = max(0, hi_b - c.hi) if k else 0
            sides.append((-infinity, c.hi + big * k, big, "_hi"))
        if c.lo is not None:
            big = max(0, c.lo - lo_b) if k else 0
            sides.append((c.lo - big * k, infinity, -big, "_lo"))
        if not k and c.lo is not None and c.hi is not None:
            sides = [(c.lo, c.hi, 0, "")]
        for lo, hi, big, suffix in sides:
            row = solver.RowConstraint(lo, hi, c.name + suffix)
            for j, coef in c.terms:
                row.SetCoefficient(x[j], coef)
            for e in c.enforce:
                row.SetCoefficient(x[e], big)
    objective = solver.Objective()
    for j, coef in m.objective:
        objective.SetCoefficient(x[j], coef)
    objective.SetOffset(m.objective_offset)
    objective.SetMinimization()
    hint = m.hint if all(m.hint.get(v, val) == val for v, val in fixed.items()) else {}
    if hint:
        solver.SetHint([x[v] for v in hint], [float(val) for val in hint.values()])
    return solver, x


class ScipBackend(ExactBackend):
    name = "scip"

    def is_available(self) -> bool:
        if not installed("ortools.linear_solver.pywraplp"):
            return False
        from ortools.linear_solver import pywraplp

        return pywraplp.Solver.CreateSolver("SCIP") is not None

    def run(
        self,
        f: Formulation,
        time_limit_s: float,
        seed: int,
        workers: int,
        options: dict[str, Any],
        fixed: dict[int, int] | None = None,
    ) -> BackendResult:
        from ortools.linear_solver import pywraplp

        deadline = time.perf_counter() + float(time_limit_s)
        if time_limit_s < SCIP_BUILD_S_PER_NONZERO * f.model.size()["nonzeros"]:
            return BackendResult(Status.TIMEOUT)  # building the model alone would pass the limit
        solver, x = _scip_model(f, fixed)
        gap = float(options.get("gap", 1e-3))
        params = [f"randomization/randomseedshift = {int(seed)}", f"limits/gap = {gap}"]
        nodes = options.get("max_nodes")
        if nodes is not None:
            params.append(f"limits/nodes = {int(nodes)}")  # the work limit: the same on any machine
        solver.SetSolverSpecificParametersAsString("\n".join(params) + "\n")
        solver.SetNumThreads(1)
        left = deadline - time.perf_counter()
        if left <= 0.05:
            return BackendResult(Status.TIMEOUT)
        solver.SetTimeLimit(int(1000 * left))
        status = solver.Solve()
        if status == pywraplp.Solver.INFEASIBLE:
            return BackendResult(Status.INFEASIBLE)
        if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
            return BackendResult(Status.TIMEOUT)
        values = [v.solution_value() for v in x]
        obj = solver.Objective().Value()
        bound = solver.Objective().BestBound()
        optimal = status == pywraplp.Solver.OPTIMAL
        return BackendResult(
            Status.OPTIMAL if optimal else Status.TIMEOUT,
            lambda v: values[v],
            obj,
            bound if optimal else None,
        )
