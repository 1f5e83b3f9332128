"""OR-Tools CP-SAT backend (the default).

With a warm start the model is first solved with the warm start's decisions fixed, which takes
little time and yields values for every variable (times, lanes, memory); that complete solution
is the hint of the real solve, so CP-SAT starts from a feasible point at least as good.
"""

from __future__ import annotations

import time
from typing import Any

from ...core.status import Status
from ..base import installed
from ..interrupts import solve_cpsat
from ..limits import (  # tuning constants: docs/tuning.md
    CPSAT_BUILD_S_PER_NONZERO,
    INTERLEAVE,
    MIN_ROUND_DTIME,
    PROBING_OFF_FROM_NONZEROS,
    PROOF_SUBSOLVERS,
    STOP_S_PER_NONZERO,
)
from .driver import ExactBackend
from .formulation import Formulation
from .result import BackendResult


def build_model(f: Formulation, fixed: dict[int, int] | None = None):
    """The formulation as a CP-SAT model and its decision variables (the smallest-budget search
    builds on it with the budget a variable)."""
    from ortools.sat.python import cp_model

    m = f.model
    model = cp_model.CpModel()
    x = []
    for v in m.vars:
        if fixed is not None and v.index in fixed:
            x.append(model.new_constant(fixed[v.index]))
        else:
            x.append(model.new_int_var(v.lb, v.ub, v.name))
    for c in m.constraints:
        expr = sum(coef * x[v] for v, coef in c.terms)
        lits = [x[v] for v in c.enforce]
        if c.lo is not None and c.hi is not None and c.lo == c.hi:
            ct = model.add(expr == c.lo)
        elif c.lo is not None and c.hi is not None:
            ct = model.add_linear_constraint(expr, c.lo, c.hi)
        elif c.lo is not None:
            ct = model.add(expr >= c.lo)
        else:
            assert c.hi is not None  # a constraint bounds one side at least
            ct = model.add(expr <= c.hi)
        if lits:
            ct.only_enforce_if(lits)
    model.minimize(sum(coef * x[v] for v, coef in m.objective) + m.objective_offset)
    return model, x


class CpSatBackend(ExactBackend):
    name = "cpsat"
    exact_arithmetic = True
    integer_variables = "all"
    work_limit = "deterministic_time"
    takes_complete_hint = True

    def is_available(self) -> bool:
        return installed("ortools.sat.python.cp_model")

    def run(
        self,
        f: Formulation,
        time_limit_s: float,
        seed: int,
        workers: int,
        options: dict[str, Any],
        fixed: dict[int, int] | None = None,
    ) -> BackendResult:
        from ortools.sat.python import cp_model

        deadline = time.perf_counter() + float(time_limit_s)
        if time_limit_s < CPSAT_BUILD_S_PER_NONZERO * f.model.size()["nonzeros"]:
            return BackendResult(Status.TIMEOUT)  # building the model alone would pass the limit
        dtime = options.get("deterministic_time_s")
        if (
            dtime is not None
            and dtime < MIN_ROUND_DTIME
            and f.model.size()["nonzeros"] >= PROBING_OFF_FROM_NONZEROS
        ):
            return BackendResult(Status.TIMEOUT)  # its work ends in presolve: no search to run
        gap_limit = float(options.get("gap", 1e-3))
        hint = dict(options.get("complete_hint") or f.model.hint)
        if fixed and any(hint.get(v, val) != val for v, val in fixed.items()):
            hint = {}  # a hint that contradicts the fixings would only mislead
        model, x = build_model(f, fixed=fixed)
        dtime = options.get("deterministic_time_s")
        interleave = INTERLEAVE and dtime is not None and workers > 1
        if interleave and hint:
            point = {**hint, **(fixed or {})}
            if len(point) == len(f.model.vars) and f.model.first_violation(point) is not None:
                hint = {}  # an infeasible complete hint aborts the interleaved search
        for v, val in hint.items():
            if not (fixed and v in fixed):
                model.add_hint(x[v], val)
        solver = cp_model.CpSolver()
        # work, not the clock, ends the search (deterministic time); the clock is the hard cap
        solver.parameters.max_time_in_seconds = max(
            0.05, deadline - time.perf_counter() - STOP_S_PER_NONZERO * f.model.size()["nonzeros"]
        )
        if dtime is not None:
            solver.parameters.max_deterministic_time = max(0.01, float(dtime))
            solver.parameters.interleave_search = interleave
        solver.parameters.num_workers = int(workers)
        solver.parameters.random_seed = int(seed)
        solver.parameters.relative_gap_limit = gap_limit
        solver.parameters.linearization_level = int(options.get("linearization_level", 2))
        if f.model.size()["nonzeros"] >= PROBING_OFF_FROM_NONZEROS:
            solver.parameters.cp_model_probing_level = 0
        if f.full and PROOF_SUBSOLVERS:
            # over every schedule the model's own bound is a proof; its linear relaxation is
            # weak (enforced rows), and the search without LP proves where the LP workers
            # stall (milp.md, "Solving")
            solver.parameters.subsolvers.extend(PROOF_SUBSOLVERS)
            solver.parameters.max_presolve_iterations = 1
        if options.get("log"):
            solver.parameters.log_search_progress = True
        status = solve_cpsat(solver, model)
        if status == cp_model.INFEASIBLE:
            return BackendResult(Status.INFEASIBLE)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return BackendResult(Status.TIMEOUT)
        obj, bound = solver.objective_value, solver.best_objective_bound
        gap = abs(obj - bound) / max(1.0, abs(obj))
        proven = status == cp_model.OPTIMAL or gap <= gap_limit
        return BackendResult(
            Status.OPTIMAL if proven else Status.TIMEOUT,
            lambda v: int(fixed[v]) if fixed and v in fixed else solver.value(x[v]),
            obj,
            bound,
        )
