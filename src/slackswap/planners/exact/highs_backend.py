"""HiGHS through its own Python interface (highspy): the same formulation as the other
backends, enforcement literals turned into big-M rows whose M comes from the variables' bounds
(formulations/milp.md, "Backends"), solved in a child process (planners/native.py). Unlike
PuLP's HiGHS interface, a node or time limit returns the incumbent and HiGHS's dual bound; the
driver's start (the model's hint) is passed as HiGHS's starting solution."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ...core.status import Status
from ..base import installed
from ..limits import CHILD_START_S, GRACE_S
from .driver import ExactBackend
from .formulation import Formulation
from .result import BackendResult


def linear_model(f: Formulation, fixed: dict[int, int] | None = None):
    """The formulation as a ``LinearModel`` (planners/lpmodel.py) and its integer variables.
    A row with k enforcement literals is relaxed by M * (k - sum(literals)), M the largest
    amount the row's bounds allow it to be violated by."""
    from ..lpmodel import LinearModel

    m = f.model
    fixed = fixed or {}
    lm = LinearModel()
    for var in m.vars:
        lb, ub = (fixed[var.index],) * 2 if var.index in fixed else (var.lb, var.ub)
        lm.vars(1, lb=float(lb), ub=float(ub))
    cost = np.zeros(lm.n)
    for v, weight in m.objective:
        cost[v] += weight
    lm.c = cost.tolist()
    for c in m.constraints:
        idx = [v for v, _ in c.terms]
        coef = [float(k) for _, k in c.terms]
        lo_b, hi_b = m.bounds_of(c.terms)
        k = len(c.enforce)
        if c.lo is not None and c.hi is not None and c.lo == c.hi and not k:
            lm.eq(idx, coef, float(c.hi))
            continue
        if c.hi is not None:
            big = float(max(0, hi_b - c.hi))
            lits = list(c.enforce) if big else []
            lm.le(idx + lits, coef + [big] * len(lits), float(c.hi) + big * len(lits))
        if c.lo is not None:
            big = float(max(0, c.lo - lo_b))
            lits = list(c.enforce) if big else []
            lm.le(
                idx + lits,
                [-x for x in coef] + [big] * len(lits),
                -float(c.lo) + big * len(lits),
            )
    integer = np.array([v.index for v in m.vars if v.lp_integral], dtype=np.int64)
    return lm, integer


class HighsBackend(ExactBackend):
    name = "highs"
    solver = "highs"

    def is_available(self) -> bool:
        return installed("highspy")

    def run(
        self,
        f: Formulation,
        time_limit_s: float,
        seed: int,
        workers: int,
        options: dict[str, Any],
        fixed: dict[int, int] | None = None,
    ) -> BackendResult:
        start = time.perf_counter()
        if time_limit_s < CHILD_START_S:
            return BackendResult(Status.TIMEOUT)
        lm, integer = linear_model(f, fixed)
        hint = f.model.hint
        if fixed and not all(hint.get(v, val) == val for v, val in fixed.items()):
            hint = {}
        left = time_limit_s - (time.perf_counter() - start) - CHILD_START_S
        if left <= 0:
            return BackendResult(Status.TIMEOUT)
        nodes = options.get("max_nodes")
        result = lm.solve_integral(
            integer,
            left,
            float(options.get("gap", 1e-3)),
            max_nodes=None if nodes is None else int(nodes),
            kill_after_s=left + GRACE_S,
            highs_options={"random_seed": int(seed)},
            start=hint,
        )
        offset = f.model.objective_offset
        if result.status == 2:
            return BackendResult(Status.INFEASIBLE)
        if result.x is None:
            return BackendResult(Status.FAILED if result.status == 4 else Status.TIMEOUT)
        values = [float(v) for v in result.x]
        objective = float(result.fun) + offset
        if result.status == 0:
            return BackendResult(Status.OPTIMAL, lambda v: values[v], objective, objective)
        bound = None if result.mip_dual_bound is None else float(result.mip_dual_bound) + offset
        # stopped by a node limit (work: the same on any machine) or by the clock
        status = Status.TIMEOUT if result.timed_out else Status.FEASIBLE
        return BackendResult(status, lambda v: values[v], objective, bound)
