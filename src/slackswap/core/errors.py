"""Errors raised on bad input. All subclass ValueError so callers can catch any broadly."""

from __future__ import annotations


class GraphError(ValueError):
    """A graph (or plan) is malformed; the message names the op, tensor or field at fault."""


class InfeasibleBudget(ValueError):
    """No plan can fit the budget. ``min_budget_bytes`` is the smallest budget the graph fits."""

    def __init__(self, message: str, min_budget_bytes: int, budget_bytes: int | None = None):
        super().__init__(message)
        self.min_budget_bytes = int(min_budget_bytes)
        self.budget_bytes = None if budget_bytes is None else int(budget_bytes)


class PlanError(GraphError):
    """A plan does not belong to the graph it is used with, or is malformed."""


class ProfileError(ValueError):
    """The model, its inputs or its loss cannot be profiled (the message says why).
    ``user_error``: the exception the user's model or loss function raised, if that is why."""

    user_error: BaseException | None = None
