"""What an exact planner's backend returns for one solve of a formulation (the same type for
CP-SAT, CBC, HiGHS and SCIP), so the driver reads every backend the same way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class BackendStatus(Enum):
    """How a backend's solve ended."""

    OPTIMAL = "optimal"  # a solution proven optimal (within the gap asked for)
    FEASIBLE = "feasible"  # a solution, its search ended by the work limit
    TIMEOUT = "timeout"  # stopped by the clock (a solution or none)
    INFEASIBLE = "infeasible"  # proven to have no solution
    FAILED = "failed"  # the solver failed (a crash in its child process)


@dataclass(frozen=True)
class BackendResult:
    """``value(v)``: variable ``v``'s value in the solution (None: no solution); ``objective`` and
    ``bound`` in the formulation's units (None where the backend has none)."""

    status: BackendStatus
    value: Callable[[int], float] | None = None
    objective: float | None = None
    bound: float | None = None
