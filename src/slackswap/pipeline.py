"""Plans for the stages of a pipeline schedule (formulations/pipeline.md, "Planning a stage").

A stage holds several micro-batches at once (stage 0 of a 1F1B schedule of P stages holds P), so
its budget binds on what each micro-batch keeps across its forward's end, not on one step's
peak. ``plan_stage`` searches the one-step budget b: the plan ``solve`` makes at b is run through
the stage's whole schedule (``simulate_stage``), and the largest b whose plan fits the stage's
budget is kept, the plan with the least busy time among those that fit. Every micro-batch runs
that plan (the formulation allows a plan each; this planner gives them one). The stage plan is
checked by ``validate_stage`` before it is returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .check.simulate_stage import StageSimResult, simulate_stage
from .check.validate_stage import validate_stage
from .core.budget import keep_all_peak
from .core.errors import InfeasibleBudget, PlanError
from .core.graph import ActivationGraph
from .core.hardware import Hardware
from .core.pipeline import PipelineSchedule, StagePlan
from .core.plan import Plan
from .core.units import budget_bytes_from
from .solve import graph_hardware, solve

# one-step budgets the search tries between the smallest and the keep-all peak
SEARCH_STEPS = 12


def _stage(
    graph: ActivationGraph, plan: Plan, schedule: PipelineSchedule, stage: int, budget: int,
    held: tuple[int, int],
) -> tuple[StagePlan, StageSimResult]:  # fmt: skip
    """``plan`` for every micro-batch, and its simulation; ``held``: (held_bytes,
    returned_bytes)."""
    stage_plan = StagePlan(stage, schedule, (plan,) * schedule.micro_batches, budget, *held)
    return stage_plan, simulate_stage(graph, stage_plan)


def keep_all_stage_peak(
    graph: ActivationGraph,
    schedule: PipelineSchedule,
    stage: int,
    hardware: Hardware | str | None = None,
    held_bytes: int = 0,
    returned_bytes: int = 0,
) -> int:
    """What the stage holds at its most when every micro-batch keeps everything.

    Args:
        graph: the stage's step for one micro-batch.
        schedule: the pipeline schedule.
        stage: which stage (from 0).
        hardware: the device (default: the graph's).
        held_bytes, returned_bytes: as for ``StagePlan``.

    Returns:
        The stage's keep-all peak under the schedule, in bytes.
    """
    hw, _ = graph_hardware(graph, hardware)
    keep = solve(graph, 1.0, hw, solver="keep-all")
    huge = 1 << 62
    return _stage(graph, keep, schedule, stage, huge, (held_bytes, returned_bytes))[1].peak_bytes


def smallest_stage_peak(
    graph: ActivationGraph,
    schedule: PipelineSchedule,
    stage: int,
    hardware: Hardware | str | None = None,
    held_bytes: int = 0,
    returned_bytes: int = 0,
) -> int:
    """What the stage holds at its most when every micro-batch runs the smallest one-step plan
    (``solve(graph, "smallest")``): the least budget ``plan_stage`` searches from.

    Args:
        graph: the stage's step for one micro-batch.
        schedule: the pipeline schedule.
        stage: which stage (from 0).
        hardware: the device (default: the graph's).
        held_bytes, returned_bytes: as for ``StagePlan``.

    Returns:
        That peak, in bytes.
    """
    hw, _ = graph_hardware(graph, hardware)
    smallest = solve(graph, "smallest", hw, solver="heuristic")
    held = (held_bytes, returned_bytes)
    return _stage(graph, smallest, schedule, stage, 1 << 62, held)[1].peak_bytes


def plan_stage(
    graph: ActivationGraph,
    budget: float | int | str,
    schedule: PipelineSchedule,
    stage: int,
    hardware: Hardware | str | None = None,
    *,
    solver: str = "heuristic",
    time_limit_s: float | None = None,
    held_bytes: int = 0,
    returned_bytes: int = 0,
    **solve_options: Any,
) -> StagePlan:
    """The stage's plan for its whole schedule within ``budget`` (module docstring).

    Args:
        graph: the stage's step for one micro-batch.
        budget: bytes (int), a string ("40GiB"), or a fraction of the stage's keep-all peak
            under the schedule (every micro-batch in flight keeping everything).
        schedule: the pipeline schedule.
        stage: which stage (from 0).
        hardware: the device (default: the graph's).
        solver: the planner of the final one-step plan ("heuristic", or an exact one: the
            search runs the heuristic, the exact planner then plans at the budget it found).
        time_limit_s: the exact planner's cap (the heuristic's search needs none).
        held_bytes: what each micro-batch in flight holds beside the graph's tensors (the
            stage's output, kept by torch's schedule for the backward).
        returned_bytes: what each holds from its backward's end to the step's end (the last
            stage's output, returned by ``schedule.step()``).
        solve_options: passed to ``solve``.

    Returns:
        The StagePlan, checked.

    Raises:
        InfeasibleBudget: no one-step plan fits the stage's budget through the schedule; its
            ``min_budget_bytes`` is the stage's peak with the smallest one-step plan.
    """
    hw, _ = graph_hardware(graph, hardware)
    schedule.actions(stage)  # (checks the stage)
    if solver == "heuristic" and solve_options:
        raise ValueError(
            f"plan_stage: {', '.join(sorted(solve_options))} are the exact planner's options; "
            "the heuristic's search takes none (pass solver='cpsat' to use them)"
        )
    for name, value in (("held_bytes", held_bytes), ("returned_bytes", returned_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"plan_stage: {name} must be a non-negative integer, got {value!r}")
    held = (held_bytes, returned_bytes)
    keep = solve(graph, 1.0, hw, solver="keep-all")
    whole = _stage(graph, keep, schedule, stage, 1 << 62, held)[1].peak_bytes
    limit = budget_bytes_from(budget, lambda: whole)
    best = _stage(graph, keep, schedule, stage, limit, held)
    if not best[1].fits:
        best = _search(graph, schedule, stage, hw, limit, held)
        if solver != "heuristic":
            best = _exact(graph, schedule, stage, hw, limit, held, best, solver,
                          time_limit_s, solve_options)  # fmt: skip
    stage_plan = best[0]
    checked = validate_stage(graph, stage_plan)
    if not checked.ok:
        raise PlanError(
            f"stage {stage}: the plan does not pass the checker: {checked.violations[0]}"
        )
    return stage_plan


def _search(
    graph: ActivationGraph, schedule: PipelineSchedule, stage: int, hw: Hardware, limit: int,
    held: tuple[int, int],
) -> tuple[StagePlan, StageSimResult]:  # fmt: skip
    """The heuristic's plans at one-step budgets from the smallest to the keep-all peak: the
    largest whose plan fits the stage, the fastest of those that fit."""
    smallest = solve(graph, "smallest", hw, solver="heuristic")
    low = _stage(graph, smallest, schedule, stage, limit, held)
    if not low[1].fits:
        raise InfeasibleBudget(
            f"stage {stage} of a {schedule.kind} schedule ({schedule.stages} stages, "
            f"{schedule.micro_batches} micro-batches) cannot fit {limit} bytes: with the "
            f"smallest one-step plan ({smallest.budget_bytes} bytes a micro-batch) it holds "
            f"{low[1].peak_bytes} bytes ({schedule.in_flight(stage)} micro-batches in flight)",
            low[1].peak_bytes,
            limit,
        )
    best = low
    lo, hi = smallest.budget_bytes, keep_all_peak(graph, hw)
    for _ in range(SEARCH_STEPS):
        if hi - lo <= max(1, lo // 1000):
            break
        mid = (lo + hi) // 2
        try:
            plan = solve(graph, mid, hw, solver="heuristic")
        except InfeasibleBudget:
            lo = mid
            continue
        found = _stage(graph, plan, schedule, stage, limit, held)
        if found[1].fits:
            lo = mid
            if found[1].busy_s < best[1].busy_s:
                best = found
        else:
            hi = mid
    return best


def _exact(
    graph: ActivationGraph, schedule: PipelineSchedule, stage: int, hw: Hardware, limit: int,
    held: tuple[int, int], best: tuple[StagePlan, StageSimResult], solver: str, time_limit_s: float | None,
    options: dict[str, Any],
) -> tuple[StagePlan, StageSimResult]:  # fmt: skip
    """The exact planner at the one-step budget the search's plan needs: its plan where it
    fits the stage and is faster."""
    budget = best[0].plans[0].budget_bytes
    try:
        plan = solve(graph, budget, hw, solver=solver, time_limit_s=time_limit_s, **options)
    except InfeasibleBudget:
        return best
    found = _stage(graph, plan, schedule, stage, limit, held)
    return found if found[1].fits and found[1].busy_s < best[1].busy_s else best


def plan_for_stages(
    graphs: Sequence[ActivationGraph],
    budget: float | int | str | Sequence[float | int | str],
    schedule: PipelineSchedule,
    hardware: Hardware | str | None = None,
    *,
    solver: str = "heuristic",
    time_limit_s: float | None = None,
    held_bytes: int | Sequence[int] = 0,
    returned_bytes: int | Sequence[int] = 0,
    **solve_options: Any,
) -> list[StagePlan]:
    """Each stage its plan for the schedule (``plan_stage``), as ``plan_for_ranks`` gives each
    rank its own: ``graphs[s]`` is stage s's step for one micro-batch; ``budget`` one for every
    stage or one per stage; ``held_bytes`` likewise. A graph that names another stage
    (``graph.extra["pipeline_stage"]``) or a schedule of another size is refused.

    Args:
        graphs: each stage's step for one micro-batch, in stage order.
        budget: as for ``plan_stage``, one for all stages or one per stage.
        schedule: the pipeline schedule.
        hardware: the device (default: each graph's).
        solver, time_limit_s, held_bytes, returned_bytes, solve_options: as for
            ``plan_stage``, the last two one for every stage or one per stage.

    Returns:
        One checked StagePlan per stage.
    """
    if not isinstance(schedule, PipelineSchedule):
        raise TypeError(f"plan_for_stages: schedule must be a PipelineSchedule, got {schedule!r}")
    if len(graphs) != schedule.stages:
        raise ValueError(
            f"plan_for_stages: {len(graphs)} stage graphs for a schedule of {schedule.stages} "
            "stages"
        )
    budgets = _per_stage(budget, schedule.stages, "budget")
    held = _per_stage(held_bytes, schedule.stages, "held_bytes")
    returned = _per_stage(returned_bytes, schedule.stages, "returned_bytes")
    out = []
    for s, graph in enumerate(graphs):
        named = graph.extra.get("pipeline_stage")
        if named is not None and named != s:
            raise ValueError(
                f"plan_for_stages: graph {graph.name!r} is stage {named}'s, given as stage {s}"
            )
        out.append(
            plan_stage(
                graph,
                budgets[s],
                schedule,
                s,
                hardware,
                solver=solver,
                time_limit_s=time_limit_s,
                held_bytes=held[s],
                returned_bytes=returned[s],
                **solve_options,
            )  # fmt: skip
        )
    return out


def _per_stage(value: Any, stages: int, what: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != stages:
            raise ValueError(f"plan_for_stages: {len(value)} {what} values for {stages} stages")
        return list(value)
    return [value] * stages
