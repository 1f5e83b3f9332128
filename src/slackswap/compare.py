"""Solvers side by side: one row per plan (result_row: its status, step time, bound and gaps, in
the columns of RESULT_FIELDS), a row for a budget no plan fits (infeasible_row), and compare()
over solvers and budgets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .check.simulate import SimResult, simulate
from .core.errors import InfeasibleBudget
from .core.graph import ActivationGraph
from .core.hardware import Hardware
from .core.plan import Plan
from .core.restrict import restricted
from .core.status import Status
from .planners.base import (
    get_planner,
)
from .solve import graph_hardware, solve
from .solve_options import host_allowed, restriction_mask

# one row schema for compare(), the CLI's sweep and the benchmarks' tables
RESULT_FIELDS = (
    "solver",
    "status",
    "fits",
    "retention",
    "step_time_s",
    "peak_bytes",
    "stall_s",
    "recompute_s",
    "wall_s",
    "objective",
    "bound",
    "gap",
    "overhead_gap",
    "budget_bytes",
)


def result_row(
    graph: ActivationGraph, plan: Plan, sim: SimResult | None = None, **context: Any
) -> dict[str, Any]:
    """One row: the plan's status and proof, and its simulated step on its own schedule.
    ``context`` (workload, budget fraction, ...) is put first.

    Args:
        graph: the step the plan is for.
        plan: the plan.
        sim: its simulation (default: simulated here).
        context: more columns (solver, budget, ...).

    Returns:
        The row: RESULT_FIELDS' columns.
    """
    sim = simulate(graph, plan) if sim is None else sim
    row: dict[str, Any] = dict(context)
    row.update(
        solver=plan.info.solver,
        status=plan.info.status,
        fits=sim.fits,
        retention=sim.retention,
        step_time_s=sim.step_time_s,
        peak_bytes=sim.peak_bytes,
        stall_s=sim.stall_s,
        recompute_s=sim.recompute_s,
        wall_s=plan.info.wall_s,
        objective=plan.info.objective,
        bound=plan.info.bound,
        gap=plan.info.gap,
        overhead_gap=plan.info.overhead_gap,
        budget_bytes=plan.budget_bytes,
    )
    return row


def infeasible_row(solver: str, exc: InfeasibleBudget, **context: Any) -> dict[str, Any]:
    """The row of a planner that found no plan within the budget (same fields, no figures)."""
    row: dict[str, Any] = dict(context)
    row.update({k: None for k in RESULT_FIELDS})
    row.update(
        solver=solver,
        status=Status.INFEASIBLE,
        fits=False,
        wall_s=0.0,
        error=str(exc),
        budget_bytes=exc.budget_bytes,
        min_budget_bytes=exc.min_budget_bytes,
    )
    return row


def compare(
    graph: ActivationGraph,
    budget: float | int | str,
    hardware: Hardware | str | None = None,
    solvers: tuple[str, ...] = ("heuristic", "cpsat", "cbc", "highs"),
    time_limit_s: float | None = None,
    allowed=None,
    pins: Mapping[str, str] | None = None,
    work_s: float | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """One row per solver (:func:`result_row`): retention, step time, peak, stall, solve time,
    status, gap. Each option goes to the solvers that take it; one that none takes is refused.
    ``allowed`` and ``pins`` go to every solver (see :func:`solve`).

    Args:
        graph: the step to plan.
        budget: a fraction of the keep-all peak, bytes, or a string ("12GiB", "50%").
        hardware: the hardware (default: the graph's own, else the default preset).
        solvers: the planners to run, by registered name.
        time_limit_s: each exact planner's hard cap on the clock.
        options: passed to every planner that takes them.

    Returns:
        One row per planner (result_row's columns; an infeasible budget gives infeasible_row's).
    """
    hw, _ = graph_hardware(graph, hardware)
    accepted = {name: getattr(get_planner(name), "options", None) for name in solvers}
    known = set().union(*(a or set(options) for a in accepted.values())) if accepted else set()
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"compare: no solver of {', '.join(solvers)} takes option(s) {', '.join(unknown)}"
        )
    rows = []
    if host_allowed(hw, allowed)[1]:  # no host to swap to: the planners that always swap sit out
        solvers = tuple(n for n in solvers if n != "swap-all")
    if allowed is not None or pins:  # the planners that cannot honour a restriction sit out
        mask = restriction_mask(graph, hw, host_allowed(hw, allowed)[0], pins)
        if restricted(mask, graph):
            solvers = tuple(
                n for n in solvers if getattr(get_planner(n), "honours_restrictions", False)
            )
    for name in solvers:
        takes = accepted[name]
        mine = options if takes is None else {k: v for k, v in options.items() if k in takes}
        try:
            plan = solve(
                graph,
                budget,
                hw,
                solver=name,
                time_limit_s=time_limit_s,
                work_s=work_s,
                strict=False,
                allowed=allowed,
                pins=pins,
                **mine,
            )
        except InfeasibleBudget as exc:
            rows.append(infeasible_row(name, exc))
            continue
        rows.append(result_row(graph, plan))
    return rows
