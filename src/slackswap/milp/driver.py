"""What every exact backend shares: warm start from the heuristic, the solve, the decode, and
the guarantee that the returned plan is never worse than the heuristic's."""

from __future__ import annotations

import time
from typing import Any

from ..heuristic import heuristic_codes
from ..plan import SolveInfo
from ..simulate import run_timeline
from ..solve import Problem, Solution
from ..stepmodel import expand
from .formulate import Formulation, formulate

DEFAULT_TIME_LIMIT_S = 60.0


def heuristic_start(problem: Problem):
    """The heuristic's plan with its default schedule, as candidates and a hint."""
    g, hw, budget = problem.graph, problem.hardware, problem.budget_bytes
    codes, _ = heuristic_codes(g, hw, budget)
    exp = expand(g, codes, None, hw, budget_bytes=budget)
    swapped = [int(t) for t in g.saved if codes[t] == 1]
    rebuilt = [int(t) for t in g.saved if codes[t] == 2]
    free = {t: int(exp.d2h_free[t]) for t in swapped}
    issue = {t: int(exp.h2d_issue[t]) for t in swapped}
    rebuild = {t: int(exp.materialize_at[t]) for t in rebuilt}
    sim = run_timeline(g, exp, hw, budget)
    return codes, free, issue, rebuild, sim


class ExactBackend:
    """Subclasses implement ``run(formulation, time_limit_s, seed, workers, options)`` and return
    (status, value function or None, objective units, bound units)."""

    name = "exact"

    def run(self, f: Formulation, time_limit_s: float, seed: int, workers: int,
            options: dict[str, Any]):
        raise NotImplementedError

    def solve(self, problem: Problem, time_limit_s: float | None = None, seed: int = 0,
              workers: int = 2, warm_start: bool = True, full: bool | None = None,
              **options: Any) -> Solution:
        from .decode import decode

        start = time.perf_counter()
        limit = DEFAULT_TIME_LIMIT_S if time_limit_s is None else float(time_limit_s)
        g, hw = problem.graph, problem.hardware
        h_codes, free, issue, rebuild, h_sim = heuristic_start(problem)
        hint = (h_codes, free, issue, rebuild) if warm_start else None
        extra = {"free": free, "issue": issue, "rebuild": rebuild} if warm_start else None
        f = formulate(g, hw, problem.budget_bytes, full=full, hint=hint, extra_candidates=extra)
        build_s = time.perf_counter() - start
        remaining = max(0.1, limit - build_s)
        status, value, obj_units, bound_units = self.run(f, remaining, seed, workers, options)
        wall = time.perf_counter() - start
        extra_info = {"model": f.model.size(), "build_s": build_s, "full_candidates": f.model is not None
                      and (full if full is not None else g.n_ops <= 16)}
        heuristic_time = h_sim.step_time_s if h_sim.fits else float("inf")
        if value is not None:
            codes, schedule = decode(f, value)
            predicted = f.seconds(obj_units)
            bound_s = f.seconds(bound_units) if bound_units is not None else None
            gap = None if bound_s is None or predicted <= 0 else max(0.0, (predicted - bound_s) / predicted)
            exp = expand(g, codes, schedule, hw)
            simulated = run_timeline(g, exp, hw, problem.budget_bytes)
            extra_info["simulated_step_time_s"] = simulated.step_time_s
            extra_info["heuristic_step_time_s"] = heuristic_time
            if simulated.fits and (simulated.step_time_s <= heuristic_time * (1 + 1e-9)
                                   or status == "optimal"):
                info = SolveInfo(solver=self.name, status=status, objective=predicted, bound=bound_s,
                                 gap=gap, wall_s=wall, predicted_step_time_s=predicted,
                                 extra=extra_info)
                return Solution(codes, schedule, info)
        # no solution, or worse than the warm start: the heuristic's plan, said so
        reason = "no solution within the time limit" if value is None else \
            "solver's best was worse than the heuristic"
        info = SolveInfo(solver=self.name, status="timeout" if status != "infeasible" else status,
                         objective=heuristic_time, bound=None, gap=None, wall_s=wall,
                         predicted_step_time_s=heuristic_time,
                         extra={**extra_info, "fallback": "heuristic", "reason": reason})
        return Solution(h_codes, None, info)
