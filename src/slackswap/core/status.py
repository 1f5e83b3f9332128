"""How a solve ended: one type from a solver backend's answer through the bounds to
``Plan.info.status``. A ``StrEnum``, so a status reads and writes as its word in JSON and
compares equal to it (``plan.info.status == "optimal"``)."""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    """How a solve, a bound or a plan ended (formulations/glossary.md)."""

    # the plan's step is proven within core.plan.OVERHEAD_TARGET of its overhead of a valid
    # bound (for a bound: the relaxation was solved)
    OPTIMAL = "optimal"
    FEASIBLE = "feasible"  # a solution; the search ended by its work limit, unproven
    TIMEOUT = "timeout"  # the clock stopped a phase (a solution or none)
    HEURISTIC = "heuristic"  # made by the heuristic's rules, with no proof attempted
    BASELINE = "baseline"  # a fixed strategy's decisions (checkpointing, offload-all, ...)
    INFEASIBLE = "infeasible"  # proven to have no solution at the budget
    FAILED = "failed"  # the solver failed (a crash in its child process)
    UNSOLVED = "unsolved"  # a bound's solver returned no answer it could trust
    SKIPPED = "skipped"  # a bound or phase not run (no time or work left for it)
    TRIVIAL = "trivial"  # a bound with nothing to bound: keeping everything fits (the ideal step)
    STOPPED = "stopped"  # a phase the planner stopped itself once its answer was no longer needed


# the statuses a plan can carry: a plan exists, so none of the failures
PLAN_STATUSES = (
    Status.OPTIMAL,
    Status.FEASIBLE,
    Status.TIMEOUT,
    Status.HEURISTIC,
    Status.BASELINE,
)
