"""solve(): one entry point for every planner, a registry of backends keyed by name.

Backends are imported lazily, take a :class:`Problem` and return decisions, an optional schedule
and a :class:`SolveInfo`. Whatever the backend, the plan is checked by the independent validator
before it is returned: a plan that does not fit raises :class:`InfeasibleBudget`, never escapes.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .budget import min_budget, parse_budget
from .errors import InfeasibleBudget
from .graph import ActivationGraph
from .hardware import Hardware
from .hardware import hardware as get_hardware
from .plan import Plan, Schedule, SolveInfo
from .stepmodel import codes_to_decisions

DEFAULT_SOLVER = "cpsat"


@dataclass(frozen=True)
class Problem:
    """What every backend solves: a graph, the hardware, a budget in bytes."""

    graph: ActivationGraph
    hardware: Hardware
    budget_bytes: int


@dataclass(frozen=True)
class Solution:
    codes: np.ndarray
    schedule: Schedule | None
    info: SolveInfo


class Backend(Protocol):
    name: str

    def solve(self, problem: Problem, **options: Any) -> Solution: ...


_REGISTRY: dict[str, str] = {
    "keep-all": "slackswap.backends.baseline:KeepAll",
    "recompute-all": "slackswap.backends.baseline:RecomputeAll",
    "swap-all": "slackswap.backends.baseline:SwapAll",
    "heuristic": "slackswap.heuristic:SlackSwapHeuristic",
    "cpsat": "slackswap.milp.cpsat:CpSatBackend",
    "cbc": "slackswap.milp.pulp_backend:CbcBackend",
    "highs": "slackswap.milp.pulp_backend:HighsBackend",
}


def solver_names() -> list[str]:
    return list(_REGISTRY)


def register_solver(name: str, target: str) -> None:
    """Register a backend as "module:Class" (imported on first use)."""
    _REGISTRY[name] = target


def get_backend(name: str) -> Backend:
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown solver {name!r}; known: {', '.join(_REGISTRY)}") from None
    module, _, cls = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"solver {name!r} needs a package that is not installed: {exc}") from exc
    return getattr(mod, cls)()


def make_plan(graph: ActivationGraph, budget_bytes: int, solution: Solution) -> Plan:
    return Plan(
        graph_name=graph.name,
        graph_digest=graph.digest,
        budget_bytes=int(budget_bytes),
        decisions=codes_to_decisions(graph, solution.codes),
        schedule=solution.schedule,
        info=solution.info,
    )


def solve(graph: ActivationGraph, budget: float | int | str, hardware: Hardware | str = "a100-80gb-pcie4",
          solver: str = DEFAULT_SOLVER, time_limit_s: float | None = None, *,
          strict: bool = True, **options: Any) -> Plan:
    """The best plan ``solver`` finds for ``graph`` under ``budget`` on ``hardware``.

    budget: a fraction of the keep-all peak in (0, 1], bytes (int), or a string ("12GiB", "50%").
    Raises InfeasibleBudget (with ``min_budget_bytes``) when no plan can fit, or when the solver's
    plan does not fit and ``strict`` is true.
    """
    from .simulate import simulate
    from .validate import validate

    hw = get_hardware(hardware)
    budget_bytes = parse_budget(budget, graph, hw)
    floor = min_budget(graph, hw)
    if budget_bytes < floor:
        raise InfeasibleBudget(
            f"graph {graph.name!r} cannot fit {budget_bytes} bytes: even with every saved tensor "
            f"offloaded it needs {floor} bytes",
            min_budget_bytes=floor, budget_bytes=budget_bytes)
    backend = get_backend(solver)
    start = time.perf_counter()
    solution = backend.solve(Problem(graph, hw, budget_bytes), time_limit_s=time_limit_s, **options)
    wall = time.perf_counter() - start
    plan = make_plan(graph, budget_bytes, solution)
    if not plan.info.wall_s:
        plan = plan.with_info(wall_s=wall)
    check = validate(graph, plan, hw)
    sim = simulate(graph, plan, hw)
    if plan.info.predicted_step_time_s is None:
        plan = plan.with_info(predicted_step_time_s=sim.step_time_s)
    if strict and not (check.ok and sim.fits):
        first = check.violations[0] if check.violations else sim.violations[0]
        raise InfeasibleBudget(
            f"solver {solver!r} found no plan for graph {graph.name!r} within {budget_bytes} bytes: "
            f"{first}", min_budget_bytes=floor, budget_bytes=budget_bytes)
    return plan


COMPARE_FIELDS = ("solver", "status", "fits", "retention", "step_time_s", "peak_bytes", "stall_s",
                  "recompute_s", "wall_s", "objective", "bound", "gap")


def compare(graph: ActivationGraph, budget: float | int | str, hardware: Hardware | str = "a100-80gb-pcie4",
            solvers: tuple[str, ...] = ("heuristic", "cpsat", "cbc", "highs"),
            time_limit_s: float | None = None, **options: Any) -> list[dict[str, Any]]:
    """One row per solver: retention, step time, peak, stall, solve time, status, gap."""
    from .simulate import simulate

    hw = get_hardware(hardware)
    rows = []
    for name in solvers:
        try:
            plan = solve(graph, budget, hw, solver=name, time_limit_s=time_limit_s,
                         strict=False, **options)
        except InfeasibleBudget as exc:
            rows.append({"solver": name, "status": "infeasible", "fits": False, "error": str(exc),
                         "min_budget_bytes": exc.min_budget_bytes})
            continue
        sim = simulate(graph, plan, hw)
        rows.append({
            "solver": name, "status": plan.info.status, "fits": sim.fits,
            "retention": sim.retention, "step_time_s": sim.step_time_s,
            "peak_bytes": sim.peak_bytes, "stall_s": sim.stall_s, "recompute_s": sim.recompute_s,
            "wall_s": plan.info.wall_s, "objective": plan.info.objective,
            "bound": plan.info.bound, "gap": plan.info.gap, "budget_bytes": plan.budget_bytes,
        })
    return rows
