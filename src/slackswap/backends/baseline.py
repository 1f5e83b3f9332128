"""Baselines behind the solver interface: keep-all, recompute-all, swap-all."""

from __future__ import annotations

import time

from ..baselines import keep_all_codes, recompute_all_codes, swap_all_codes
from ..plan import SolveInfo
from ..solve import Problem, Solution


class _Baseline:
    name = "baseline"
    make = staticmethod(keep_all_codes)

    def solve(self, problem: Problem, **options) -> Solution:
        start = time.perf_counter()
        codes = self.make(problem.graph)
        return Solution(codes, None, SolveInfo(solver=self.name, status="baseline",
                                               wall_s=time.perf_counter() - start))


class KeepAll(_Baseline):
    name = "keep-all"
    make = staticmethod(keep_all_codes)


class RecomputeAll(_Baseline):
    name = "recompute-all"
    make = staticmethod(recompute_all_codes)


class SwapAll(_Baseline):
    name = "swap-all"
    make = staticmethod(swap_all_codes)
