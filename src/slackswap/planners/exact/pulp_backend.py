"""CBC through PuLP (HiGHS has its own interface: highs_backend.py): the same formulation, enforcement literals turned into big-M rows
whose M comes from the variables' bounds (formulations/milp.md, "Backends"), each solved in a
child process (planners/native.py)."""

from __future__ import annotations

import logging
import time
from typing import Any

from ...core.status import Status
from ..base import installed
from ..limits import CHILD_START_S, PULP_BUILD_S_PER_NONZERO
from .driver import ExactBackend
from .formulation import Formulation
from .result import BackendResult

log = logging.getLogger("slackswap")


def _pulp_problem(f: Formulation, fixed: dict[int, int] | None = None):
    import pulp

    m = f.model
    prob = pulp.LpProblem("slackswap", pulp.LpMinimize)
    x = []
    fixed = fixed or {}
    for var in m.vars:
        lb, ub = (fixed[var.index], fixed[var.index]) if var.index in fixed else (var.lb, var.ub)
        cat = pulp.LpInteger if var.lp_integral else pulp.LpContinuous
        x.append(pulp.LpVariable(f"v{var.index}", lowBound=lb, upBound=ub, cat=cat))
    for i, c in enumerate(m.constraints):
        expr = pulp.lpSum(coef * x[v] for v, coef in c.terms)
        lo_b, hi_b = m.bounds_of(c.terms)
        # with k enforcement literals: the row is relaxed by M * (k - sum(literals))
        relax = pulp.lpSum(1 - x[v] for v in c.enforce) if c.enforce else 0
        if c.hi is not None:
            big = max(0, hi_b - c.hi)
            if c.enforce:
                prob += expr <= c.hi + big * relax, f"c{i}u"
            else:
                prob += expr <= c.hi, f"c{i}u"
        if c.lo is not None:
            big = max(0, c.lo - lo_b)
            if c.enforce:
                prob += expr >= c.lo - big * relax, f"c{i}l"
            else:
                prob += expr >= c.lo, f"c{i}l"
    prob += pulp.lpSum(coef * x[v] for v, coef in m.objective) + m.objective_offset
    hint = m.hint if all(m.hint.get(v, val) == val for v, val in fixed.items()) else {}
    for v, val in hint.items():
        x[v].setInitialValue(val)
    return prob, x


class _PulpBackend(ExactBackend):
    """PuLP's model, solved in a child process (planners/native.py): a crash in the native
    solver becomes a failed run (the driver falls back to the best plan found), the time limit is
    a hard deadline, and nothing in this process is patched or redirected."""

    name = "pulp"
    solver = "pulp"
    cbc_options: tuple[str, ...] = ()

    def is_available(self) -> bool:
        if not installed("pulp"):
            return False
        import pulp

        if self.solver == "cbc":
            return bool(pulp.PULP_CBC_CMD(msg=False).available())
        return bool(pulp.HiGHS(msg=False).available())

    def run(
        self,
        f: Formulation,
        time_limit_s: float,
        seed: int,
        workers: int,
        options: dict[str, Any],
        fixed: dict[int, int] | None = None,
    ) -> BackendResult:
        import warnings

        import pulp

        from ..limits import GRACE_S
        from ..native import NativeSolverError, NativeTimeout, run_in_child

        if time_limit_s < CHILD_START_S + PULP_BUILD_S_PER_NONZERO * f.model.size()["nonzeros"]:
            return BackendResult(Status.TIMEOUT)  # building and starting it would pass the limit
        start = time.perf_counter()
        with warnings.catch_warnings():
            # PuLP 3 warns about its own 4.0 API; the calls used here work in both
            warnings.simplefilter("ignore", DeprecationWarning)
            prob, x = _pulp_problem(f, fixed)
            data = prob.to_dict()
        gap = float(options.get("gap", 1e-3))
        nodes = options.get("max_nodes")
        request = {
            "problem": data,
            "solver": self.solver,
            "options": {
                "time_limit_s": float(time_limit_s),
                # with a node limit, one thread: the same search on any machine
                "workers": 1 if nodes is not None else int(workers),
                "seed": int(seed),
                "warm": bool(f.model.hint),
                "gap": gap,
                "max_nodes": nodes,
                "cbc_options": [f"randomCbcSeed {seed + 1}", *self.cbc_options],
            },
        }
        try:
            left = time_limit_s - (time.perf_counter() - start)
            if left < CHILD_START_S:
                return BackendResult(Status.TIMEOUT)
            request["options"]["time_limit_s"] = left - CHILD_START_S
            answer = run_in_child("pulp", request, None, left + GRACE_S)
        except NativeTimeout:
            return BackendResult(Status.TIMEOUT)  # killed at the deadline: no solution to read
        except NativeSolverError as exc:
            log.warning("%s: %s", self.name, exc)
            return BackendResult(Status.FAILED)
        status = answer["status"]
        if status == "Infeasible":
            return BackendResult(Status.INFEASIBLE)
        # only a solution the solver vouches for: optimal, or integer-feasible at the time limit
        values = [answer["values"].get(v.name) for v in x]
        if answer["solution"] is None or any(v is None for v in values):
            return BackendResult(Status.TIMEOUT)
        for var, value in zip(x, values):
            var.varValue = value
        obj = pulp.value(prob.objective)  # here: the child's copy of the model drops its constant
        optimal = status == "Optimal" and answer["solution"] == Status.OPTIMAL
        bound = obj if optimal else None
        return BackendResult(
            Status.OPTIMAL if optimal else Status.TIMEOUT,
            lambda v: values[v],
            obj,
            bound,
        )


class CbcBackend(_PulpBackend):
    name = "cbc"
    solver = "cbc"

    def run(self, f, time_limit_s, seed, workers, options, fixed=None):
        start = time.perf_counter()
        result = super().run(f, time_limit_s, seed, workers, options, fixed)
        left = time_limit_s - (time.perf_counter() - start)
        if result.status is Status.INFEASIBLE and left > 0.5:
            # CBC's integer preprocessing wrongly reports some degenerate models infeasible
            # (all times zero, say); confirm without it before believing it
            again = CbcBackend()
            again.cbc_options = ("preprocess off",)
            result = _PulpBackend.run(again, f, left, seed, workers, options, fixed)
        return result
