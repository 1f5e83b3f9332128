"""What an exact planner's backend returns for one solve of a formulation (the same type for
CP-SAT, CBC, HiGHS and SCIP), so the driver reads every backend the same way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...core.status import Status


@dataclass(frozen=True)
class BackendResult:
    """``value(v)``: variable ``v``'s value in the solution (None: no solution); ``objective`` and
    ``bound`` in the formulation's units (None where the backend has none)."""

    status: Status
    value: Callable[[int], float] | None = None
    objective: float | None = None
    bound: float | None = None
