"""OR-Tools CP-SAT backend (the default)."""

from __future__ import annotations

from typing import Any

from .driver import ExactBackend
from .formulate import Formulation


class CpSatBackend(ExactBackend):
    name = "cpsat"

    def run(self, f: Formulation, time_limit_s: float, seed: int, workers: int,
            options: dict[str, Any]):
        from ortools.sat.python import cp_model

        m = f.model
        model = cp_model.CpModel()
        x = [model.NewIntVar(v.lb, v.ub, v.name) for v in m.vars]
        for c in m.constraints:
            expr = sum(coef * x[v] for v, coef in c.terms)
            lits = [x[v] for v in c.enforce]
            if c.lo is not None and c.hi is not None and c.lo == c.hi:
                ct = model.Add(expr == c.lo)
            elif c.lo is not None and c.hi is not None:
                ct = model.AddLinearConstraint(expr, c.lo, c.hi)
            elif c.lo is not None:
                ct = model.Add(expr >= c.lo)
            else:
                ct = model.Add(expr <= c.hi)
            if lits:
                ct.OnlyEnforceIf(lits)
        model.Minimize(sum(coef * x[v] for v, coef in m.objective) + m.objective_offset)
        for v, val in m.hint.items():
            model.AddHint(x[v], val)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = float(time_limit_s)
        solver.parameters.num_workers = int(workers)
        solver.parameters.random_seed = int(seed)
        solver.parameters.relative_gap_limit = float(options.get("gap", 1e-3))
        if options.get("log"):
            solver.parameters.log_search_progress = True
        status = solver.Solve(model)
        if status == cp_model.OPTIMAL:
            name = "optimal"
        elif status == cp_model.FEASIBLE:
            gap = abs(solver.ObjectiveValue() - solver.BestObjectiveBound()) / max(1.0, abs(solver.ObjectiveValue()))
            name = "optimal" if gap <= float(options.get("gap", 1e-3)) else "feasible"
            if name == "feasible" and solver.WallTime() >= time_limit_s * 0.98:
                name = "timeout"
        elif status == cp_model.INFEASIBLE:
            return "infeasible", None, None, None
        else:
            return "timeout", None, None, None
        return name, (lambda v: solver.Value(x[v])), solver.ObjectiveValue(), solver.BestObjectiveBound()
