"""The planners' contract: what a planner is given, what it returns, and the registry by name.

Every planner takes a :class:`Problem` and returns a :class:`Solution` (decision codes, the
positions it chose, a :class:`SolveInfo`): the same type whatever the planner, as Checkmate's
strategies return one scheduled result, so comparisons and sweeps are trivial. Planners are
registered as "module:Class" and imported on first use (as cvxpy's solver interfaces are), so a
missing optional package only disables its planner; ``is_available()`` says which are usable.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..core.graph import ActivationGraph
from ..core.hardware import Hardware
from ..core.plan import Schedule, SolveInfo
from .interrupts import reraise_interrupt


@dataclass(frozen=True)
class Problem:
    """What every planner solves: a graph, the hardware, a budget in bytes, and which decisions
    each tensor may take (``mask``: tensors x (keep, swap, recompute); None: all the graph
    allows; core/restrict.py). ``began``: the ``time.perf_counter()`` value at which the caller's
    time limit started (solve()'s entry, before it loaded the planner); None: when the planner
    starts. Only the deadline counts from it, never the work limits."""

    graph: ActivationGraph
    hardware: Hardware
    budget_bytes: int
    mask: np.ndarray | None = None
    began: float | None = None

    def may(self, t: int, code: int) -> bool:
        return self.mask is None or bool(self.mask[t, code])

    @classmethod
    def resolve(
        cls, graph: ActivationGraph, budget, hw, allowed=None, pins=None, mask=None
    ) -> Problem:
        """The problem of the public keyword calls (``lp_bound``, ``departure_bound``): hardware
        by name or object, the budget as ``solve`` reads it, ``allowed``/``pins`` or a ready
        ``mask``, each resolved once."""
        from ..core.budget import parse_budget
        from ..core.hardware import hardware

        hw = hardware(hw)
        if mask is None and (allowed is not None or pins):
            from ..core.restrict import decision_mask

            mask = decision_mask(graph, allowed, pins, hw.min_swap_bytes)
        return cls(graph, hw, parse_budget(budget, graph, hw), mask)


@dataclass(frozen=True)
class Solution:
    """Decision codes per tensor (core.plan.Decision), the positions the planner chose (None or
    partial: solve() closes the plan with the step model's defaults), and how it fared.
    ``simulation``: where the planner simulated these decisions with the default schedule at the
    problem's budget (``simulate_decisions``), that result: solve() closes the plan from its
    expansion rather than expanding the step again (the checker still walks the closed plan on
    its own)."""

    codes: np.ndarray
    schedule: Schedule | None
    info: SolveInfo
    simulation: Any = None  # check.simulate.SimResult


@runtime_checkable
class Planner(Protocol):
    """``options``: the keyword options ``solve`` accepts (solve() refuses any other by name)."""

    name: str
    options: frozenset[str]

    def is_available(self) -> bool: ...

    def solve(self, problem: Problem, **options: Any) -> Solution: ...


_REGISTRY: dict[str, str] = {
    "keep-all": "slackswap.planners.baselines:KeepAll",
    "recompute-all": "slackswap.planners.baselines:RecomputeAll",
    "swap-all": "slackswap.planners.baselines:SwapAll",
    "checkpoint-blocks": "slackswap.planners.baselines:CheckpointBlocks",
    "checkpoint-blocks-sac": "slackswap.planners.baselines:CheckpointBlocksSavingMatmuls",
    "heuristic": "slackswap.planners.heuristic:SlackSwapHeuristic",
    "cpsat": "slackswap.planners.exact.cpsat:CpSatBackend",
    "cbc": "slackswap.planners.exact.pulp_backend:CbcBackend",
    "highs": "slackswap.planners.exact.highs_backend:HighsBackend",
    "scip": "slackswap.planners.exact.scip_backend:ScipBackend",
}


def solver_names() -> list[str]:
    """Every registered planner's name (available or not).

    Returns:
        Every registered planner's name, available here or not.
    """
    return list(_REGISTRY)


def honouring_restrictions() -> list[str]:
    """The available planners that honour ``allowed=`` and pins (``honours_restrictions``),
    for messages that name them."""
    out = []
    for name in _REGISTRY:
        try:
            planner = get_planner(name)
        except (ImportError, ValueError, AttributeError):
            continue
        if getattr(planner, "honours_restrictions", False):
            out.append(name)
    return out


def register_solver(name: str, target: str) -> None:
    """Register a planner as "module:Class" (imported on first use).

    Args:
        name: the name ``solve(solver=...)`` will take.
        target: "module:Class", imported on first use.

    Raises:
        ValueError: a target that is not "module:Class".
    """
    if ":" not in target:
        raise ValueError(f"register_solver: target must be 'module:Class', got {target!r}")
    _REGISTRY[name] = target


def get_planner(name: str) -> Planner:
    """The planner registered as ``name``; ImportError names a missing package."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown solver {name!r}; known: {', '.join(_REGISTRY)}") from None
    module, _, cls = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        reraise_interrupt(exc)
        raise ImportError(f"solver {name!r} needs a package that is not installed: {exc}") from exc
    planner = getattr(mod, cls)()
    available = getattr(planner, "is_available", None)
    if available is not None and not available():
        raise ImportError(f"solver {name!r} is not available here (its solver library is missing)")
    return planner


def installed(module: str) -> bool:
    """Whether ``module`` imports. A Ctrl-C during the import stays a KeyboardInterrupt:
    extension modules built with pybind11 (OR-Tools) turn any error in their initialisation,
    an interrupt included, into ImportError("initialization failed"), which would otherwise
    read as a solver library that is missing."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        reraise_interrupt(exc)
        return False
    return True


def is_available(name: str) -> bool:
    """Whether ``name`` is registered and its packages are installed.

    Args:
        name: a registered planner's name.

    Returns:
        Whether it can run here (its solver is installed).
    """
    try:
        get_planner(name)
    except (ImportError, ValueError, AttributeError):
        return False
    return True
