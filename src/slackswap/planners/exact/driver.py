"""What every exact backend shares: the options it accepts, the solve strategy (strategy.py)
and the rule that a search the clock stopped is "timeout". A backend subclasses
:class:`ExactBackend`, implements ``run`` and joins the registry in planners/base.py with one
line (scip_backend.py is the smallest example).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ...core.status import Status
from ..base import Problem, Solution
from .formulation import Formulation
from .result import BackendResult
from .strategy import SearchSettings, search


class ExactBackend:
    """Subclasses implement ``run(formulation, time_limit_s, seed, workers, options, fixed)``,
    returning a :class:`BackendResult` (result.py)."""

    name = "exact"
    honours_restrictions = True  # Problem.mask: fixed in the MILP, the bound and every start
    # what the backend can do, which the strategy (strategy.py) asks before it gives it anything:
    # integers solved exactly (CP-SAT), not in floating point with tolerances (HiGHS, CBC): the
    # model may then use a finer time unit (formulations/milp.md, "Scaling and rounding")
    exact_arithmetic = False
    # which variables it keeps integer: "all" (CP-SAT), or "marked", those Var.lp_integral marks
    # (an LP-based solver: times, lanes and memory sums continuous)
    integer_variables = "marked"
    # its work limit: "deterministic_time" (CP-SAT's) or "nodes" (branch and bound)
    work_limit = "nodes"
    # it starts from a value for every variable (hint.complete_hint), not only the decisions'
    takes_complete_hint = False
    options = SearchSettings.names()

    def is_available(self) -> bool:
        return True

    def run(
        self,
        f: Formulation,
        time_limit_s: float,
        seed: int,
        workers: int,
        options: dict[str, Any],
        fixed: dict[int, int] | None = None,
    ) -> BackendResult:
        raise NotImplementedError

    def solve(
        self,
        problem: Problem,
        time_limit_s: float | None = None,
        **options: Any,
    ) -> Solution:
        """The best plan found within the work allowed (``work_s``, default the time limit;
        limits.py) and the time limit (a hard cap), by the phases of strategy.py. By default a
        plan whose search the clock stopped anywhere is "timeout", whatever it proved: another
        machine, or this one idle, could return another plan (``extra["clock_stopped"]`` names
        the phases).

        Args:
            problem: the graph, hardware, budget and restrictions (planners/base.py).
            time_limit_s: the hard cap on the wall clock, from solve()'s entry.
            options: SearchSettings' fields (strategy.py), and the backend's own (``gap``,
                ``log``, ``linearization_level``).

        Returns:
            A :class:`Solution`: decisions, schedule (None: the warm start's, simulated) and
            the :class:`SolveInfo` with the status, bound and gap that are true of it.
        """
        settings = SearchSettings.of(time_limit_s, options)
        solution = search(self, problem, settings)
        extra = solution.info.extra
        if (
            not extra.get("anytime")
            and extra.get("clock_stopped")
            and solution.info.status != Status.TIMEOUT
        ):
            info = replace(
                solution.info,
                status=Status.TIMEOUT,
                extra={**extra, "status_before_clock": solution.info.status},
            )
            solution = replace(solution, info=info)
        return solution
