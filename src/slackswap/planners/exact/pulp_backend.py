"""CBC and HiGHS through PuLP: the same formulation, enforcement literals turned into big-M rows
whose M comes from the variables' bounds (formulations/milp.md, "Backends")."""

from __future__ import annotations

import contextlib
import subprocess
import time
from typing import Any

from ..native import quiet_stdout
from .driver import ExactBackend
from .formulate import Formulation


def _pulp_problem(f: Formulation, fixed: dict[int, int] | None = None):
    import pulp

    m = f.model
    prob = pulp.LpProblem("slackswap", pulp.LpMinimize)
    x = []
    fixed = fixed or {}
    for v in m.vars:
        lb, ub = (fixed[v.index], fixed[v.index]) if v.index in fixed else (v.lb, v.ub)
        # binaries stay integer; times, lanes and memory sums are continuous for an LP-based solver
        cat = pulp.LpInteger if (v.lb == 0 and v.ub == 1 and not v.name.startswith("transient")) \
            else pulp.LpContinuous
        x.append(pulp.LpVariable(f"v{v.index}", lowBound=lb, upBound=ub, cat=cat))
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


class _DeadlinePopen(subprocess.Popen):
    """CBC checks its time limit only between nodes: a long root solve can run far past it.
    PuLP waits for the process; this wait gives up at the deadline and kills it."""

    deadline = float("inf")

    def wait(self, timeout=None):
        try:
            return super().wait(timeout=max(0.1, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            return super().wait()


@contextlib.contextmanager
def _hard_deadline(seconds: float):
    """PuLP's CBC runs under a wall-clock deadline (the time limit plus a grace period)."""
    from pulp.apis import coin_api

    shim = type("subprocess_with_deadline", (), {})()
    for name in dir(subprocess):
        if not name.startswith("__"):
            setattr(shim, name, getattr(subprocess, name))
    popen = type("Popen", (_DeadlinePopen,), {"deadline": time.monotonic() + seconds})
    shim.Popen = popen
    original = coin_api.subprocess
    coin_api.subprocess = shim
    try:
        yield
    finally:
        coin_api.subprocess = original


class _PulpBackend(ExactBackend):
    name = "pulp"
    quiet = False
    hard_deadline = False

    def is_available(self) -> bool:
        try:
            return bool(self._solver(1.0, 0, 1, False, 1e-3).available())
        except Exception:  # pulp missing or its solver binary / library absent
            return False

    def _solver(self, time_limit_s: float, seed: int, workers: int, warm: bool, gap: float):
        raise NotImplementedError

    def run(self, f: Formulation, time_limit_s: float, seed: int, workers: int,
            options: dict[str, Any], fixed: dict[int, int] | None = None):
        import warnings

        import pulp

        with warnings.catch_warnings():
            # PuLP 3 warns about its own 4.0 API; the calls used here work in both
            warnings.simplefilter("ignore", DeprecationWarning)
            prob, x = _pulp_problem(f, fixed)
        gap = float(options.get("gap", 1e-3))
        solver = self._solver(time_limit_s, seed, workers, bool(f.model.hint), gap)
        try:
            with contextlib.ExitStack() as stack:
                if self.quiet and not options.get("log"):
                    stack.enter_context(quiet_stdout())
                if self.hard_deadline:
                    stack.enter_context(_hard_deadline(time_limit_s * 1.1 + 2.0))
                prob.solve(solver)
        except pulp.PulpSolverError:
            if not self.hard_deadline:
                raise
            return "timeout", None, None, None  # killed at the deadline: no solution to read
        status = pulp.LpStatus.get(prob.status, "Undefined")
        sol_status = getattr(prob, "sol_status", None)
        if status == "Infeasible":
            return "infeasible", None, None, None
        # only a solution the solver vouches for: optimal, or integer-feasible at the time limit
        found = (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
        values = [v.varValue for v in x]
        if sol_status not in found or any(v is None for v in values):
            return "timeout", None, None, None
        obj = pulp.value(prob.objective)
        optimal = status == "Optimal" and sol_status == pulp.LpSolutionOptimal
        bound = obj if optimal else None
        return ("optimal" if optimal else "timeout"), (lambda v: values[v]), obj, bound


class CbcBackend(_PulpBackend):
    name = "cbc"
    hard_deadline = True
    _extra: tuple[str, ...] = ()

    def run(self, f, time_limit_s, seed, workers, options, fixed=None):
        result = super().run(f, time_limit_s, seed, workers, options, fixed)
        if result[0] == "infeasible":
            # CBC's integer preprocessing wrongly reports some degenerate models infeasible
            # (all times zero, say); confirm without it before believing it
            self._extra = ("preprocess off",)
            try:
                result = super().run(f, time_limit_s, seed, workers, options, fixed)
            finally:
                self._extra = ()
        return result

    def _solver(self, time_limit_s, seed, workers, warm, gap):
        import warnings

        import pulp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(round(time_limit_s))),
                                 threads=workers, warmStart=warm, gapRel=gap,
                                     options=[f"randomCbcSeed {seed + 1}", *self._extra])


class HighsBackend(_PulpBackend):
    name = "highs"
    quiet = True

    def _solver(self, time_limit_s, seed, workers, warm, gap):
        import pulp

        return pulp.HiGHS(msg=False, timeLimit=float(time_limit_s), threads=workers, gapRel=gap,
                          warmStart=warm, random_seed=seed, output_flag=False)
