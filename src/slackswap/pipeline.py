"""Plans for the stages of a pipeline schedule (formulations/pipeline.md, "Planning a stage").

A rank holds several micro-batches at once (stage 0 of a 1F1B schedule of P stages holds P), so
its budget binds on what each micro-batch keeps across its forward's end, not on one step's
peak. ``plan_rank`` searches a one-step budget per stage: b_s(x) = smallest_s + x (keep-all_s -
smallest_s), one x for every stage of the rank (one stage, except under an interleaved
schedule); the plans ``solve`` makes at b_s(x) are run through the rank's whole schedule
(``simulate_rank``), and the largest x whose plans fit the rank's budget is kept, the plans
with the least busy time among those that fit. Then each micro-batch, from the last, takes a
faster plan the search found where the rank still fits (a plan each: the micro-batches that
rest least can keep more). The stage plans are checked by ``validate_rank`` before they are
returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .check.simulate_stage import Phases, StageSimResult, simulate_rank
from .check.validate_stage import validate_rank
from .core.budget import keep_all_peak
from .core.errors import InfeasibleBudget, PlanError
from .core.graph import ActivationGraph
from .core.hardware import Hardware
from .core.pipeline import PipelineSchedule, StagePlan
from .core.plan import Plan
from .core.units import budget_bytes_from
from .solve import graph_hardware, smallest_budget, solve

# points of the search between the smallest plans and keep-all
SEARCH_STEPS = 12
HUGE = 1 << 62


class _Rank:
    """One rank's stages while they are planned: their graphs, what each micro-batch holds
    beside them, and the phases of every plan tried (each simulated once)."""

    def __init__(
        self,
        graphs: Sequence[ActivationGraph],
        schedule: PipelineSchedule,
        rank: int,
        hw: Hardware,
        held: Sequence[tuple[int, int]],
    ):
        self.graphs = list(graphs)
        self.schedule = schedule
        self.rank = rank
        self.stages = schedule.stages_of(rank)
        self.hw = hw
        self.held = list(held)
        self.cache: dict[int, tuple[Plan, Phases]] = {}

    def run(
        self, plans: Sequence[Sequence[Plan]], budget: int
    ) -> tuple[list[StagePlan], StageSimResult]:
        """``plans[i][m]``: stage i's plan for micro-batch m; the stage plans and the rank's
        simulation."""
        stage_plans = [
            StagePlan(s, self.schedule, tuple(p), budget, *self.held[i])
            for i, (s, p) in enumerate(zip(self.stages, plans))
        ]
        return stage_plans, simulate_rank(self.graphs, stage_plans, None, self.cache)

    def uniform(self, one: Sequence[Plan], budget: int) -> tuple[list[StagePlan], StageSimResult]:
        """Every micro-batch of stage i on ``one[i]``."""
        return self.run([[p] * self.schedule.micro_batches for p in one], budget)


def _rank_for(
    graphs: Sequence[ActivationGraph],
    schedule: PipelineSchedule,
    rank: int,
    hardware: Hardware | str | None,
    held_bytes: int | Sequence[int],
    returned_bytes: int | Sequence[int],
    what: str,
) -> _Rank:
    stages = schedule.stages_of(rank)
    if len(graphs) != len(stages):
        raise ValueError(
            f"{what}: rank {rank} runs stages {list(stages)}: {len(graphs)} graphs given"
        )
    held = _per(held_bytes, len(stages), "held_bytes", what)
    returned = _per(returned_bytes, len(stages), "returned_bytes", what)
    for name, values in (("held_bytes", held), ("returned_bytes", returned)):
        for value in values:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{what}: {name} must be a non-negative integer, got {value!r}")
    hw, _ = graph_hardware(graphs[0], hardware)
    return _Rank(graphs, schedule, rank, hw, list(zip(held, returned)))


def keep_all_rank_peak(
    graphs: Sequence[ActivationGraph],
    schedule: PipelineSchedule,
    rank: int,
    hardware: Hardware | str | None = None,
    held_bytes: int | Sequence[int] = 0,
    returned_bytes: int | Sequence[int] = 0,
) -> int:
    """What the rank holds at its most when every micro-batch of each of its stages keeps
    everything.

    Args:
        graphs: its stages' steps for one micro-batch, in ``schedule.stages_of(rank)`` order.
        schedule: the pipeline schedule.
        rank: which rank (from 0).
        hardware: the device (default: the first graph's).
        held_bytes, returned_bytes: as for ``StagePlan``, one for all or one per stage.

    Returns:
        The rank's keep-all peak under the schedule, in bytes.
    """
    r = _rank_for(graphs, schedule, rank, hardware, held_bytes, returned_bytes,
                  "keep_all_rank_peak")  # fmt: skip
    keep = [solve(g, 1.0, r.hw, solver="keep-all") for g in r.graphs]
    return r.uniform(keep, HUGE)[1].peak_bytes


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
        schedule: the pipeline schedule (one stage per rank; else ``keep_all_rank_peak``).
        stage: which stage (from 0).
        hardware: the device (default: the graph's).
        held_bytes, returned_bytes: as for ``StagePlan``.

    Returns:
        The stage's keep-all peak under the schedule, in bytes.
    """
    _one_stage_per_rank(schedule, stage, "keep_all_stage_peak", "keep_all_rank_peak")
    return keep_all_rank_peak([graph], schedule, stage, hardware, held_bytes, returned_bytes)


def smallest_rank_peak(
    graphs: Sequence[ActivationGraph],
    schedule: PipelineSchedule,
    rank: int,
    hardware: Hardware | str | None = None,
    held_bytes: int | Sequence[int] = 0,
    returned_bytes: int | Sequence[int] = 0,
) -> int:
    """What the rank holds at its most when every micro-batch runs its stage's smallest
    one-step plan (the heuristic's, at ``smallest_budget``): the least budget ``plan_rank``
    searches from.

    Args:
        graphs: its stages' steps for one micro-batch, in ``schedule.stages_of(rank)`` order.
        schedule: the pipeline schedule.
        rank: which rank (from 0).
        hardware: the device (default: the first graph's).
        held_bytes, returned_bytes: as for ``StagePlan``, one for all or one per stage.

    Returns:
        That peak, in bytes.
    """
    r = _rank_for(graphs, schedule, rank, hardware, held_bytes, returned_bytes,
                  "smallest_rank_peak")  # fmt: skip
    smallest = [_smallest_plan(g, r.hw) for g in r.graphs]
    return r.uniform(smallest, HUGE)[1].peak_bytes


def _smallest_plan(graph: ActivationGraph, hw: Hardware) -> Plan:
    """The heuristic's plan at the smallest budget, that budget searched to its end
    (``smallest_budget`` has no clock): the same floor on a busy machine as on an idle one."""
    return solve(graph, smallest_budget(graph, hw).budget_bytes, hw, solver="heuristic")


def smallest_stage_peak(
    graph: ActivationGraph,
    schedule: PipelineSchedule,
    stage: int,
    hardware: Hardware | str | None = None,
    held_bytes: int = 0,
    returned_bytes: int = 0,
) -> int:
    """What the stage holds at its most when every micro-batch runs the smallest one-step plan
    (the heuristic's, at ``smallest_budget``): the least budget ``plan_stage`` searches from.

    Args:
        graph: the stage's step for one micro-batch.
        schedule: the pipeline schedule (one stage per rank; else ``smallest_rank_peak``).
        stage: which stage (from 0).
        hardware: the device (default: the graph's).
        held_bytes, returned_bytes: as for ``StagePlan``.

    Returns:
        That peak, in bytes.
    """
    _one_stage_per_rank(schedule, stage, "smallest_stage_peak", "smallest_rank_peak")
    return smallest_rank_peak([graph], schedule, stage, hardware, held_bytes, returned_bytes)


def _one_stage_per_rank(schedule: PipelineSchedule, stage: int, what: str, instead: str) -> None:
    schedule.actions(stage)  # (checks the stage)
    if schedule.stages_per_rank != 1:
        raise ValueError(
            f"{what}: stage {stage} shares rank {schedule.rank_of(stage)} with other stages "
            f"under {schedule.kind}: plan them together ({instead})"
        )


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
        schedule: the pipeline schedule (one stage per rank; else ``plan_rank``).
        stage: which stage (from 0).
        hardware: the device (default: the graph's).
        solver: the planner of the final one-step plans ("heuristic", or an exact one: the
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
        InfeasibleBudget: no one-step plans fit the stage's budget through the schedule; its
            ``min_budget_bytes`` is the stage's peak with the smallest one-step plan.
    """
    _one_stage_per_rank(schedule, stage, "plan_stage", "plan_rank")
    return plan_rank(
        [graph], budget, schedule, stage, hardware, solver=solver, time_limit_s=time_limit_s,
        held_bytes=held_bytes, returned_bytes=returned_bytes, **solve_options,
    )[0]  # fmt: skip


def plan_rank(
    graphs: Sequence[ActivationGraph],
    budget: float | int | str,
    schedule: PipelineSchedule,
    rank: int,
    hardware: Hardware | str | None = None,
    *,
    solver: str = "heuristic",
    time_limit_s: float | None = None,
    held_bytes: int | Sequence[int] = 0,
    returned_bytes: int | Sequence[int] = 0,
    **solve_options: Any,
) -> list[StagePlan]:
    """The plans of a rank's stages for its whole schedule within ``budget`` (module
    docstring): one stage under GPipe and 1F1B (rank s runs stage s), several under
    interleaved 1F1B, which share the rank's memory.

    Args:
        graphs: the rank's stages' steps for one micro-batch, in ``schedule.stages_of(rank)``
            order.
        budget: bytes, a string, or a fraction of the rank's keep-all peak under the schedule.
        schedule: the pipeline schedule.
        rank: which rank (from 0).
        hardware, solver, time_limit_s, solve_options: as for ``plan_stage``.
        held_bytes, returned_bytes: as for ``plan_stage``, one for all or one per stage.

    Returns:
        One checked StagePlan per stage of the rank, in its order.

    Raises:
        InfeasibleBudget: no plans fit; ``min_budget_bytes`` is the rank's peak with the
            smallest one-step plans.
    """
    r = _rank_for(graphs, schedule, rank, hardware, held_bytes, returned_bytes, "plan_rank")
    if solver == "heuristic" and solve_options:
        raise ValueError(
            f"plan_rank: {', '.join(sorted(solve_options))} are the exact planner's options; "
            "the heuristic's search takes none (pass solver='cpsat' to use them)"
        )
    keep = [solve(g, 1.0, r.hw, solver="keep-all") for g in r.graphs]
    whole = r.uniform(keep, HUGE)[1].peak_bytes
    limit = budget_bytes_from(budget, lambda: whole)
    best = r.uniform(keep, limit)
    if not best[1].fits:
        best, tried = _search(r, limit)
        if solver != "heuristic":
            best = _exact(r, limit, best, solver, time_limit_s, solve_options)
        best = _a_plan_each(r, limit, best, [[k, *t] for k, t in zip(keep, tried)])
    stage_plans = best[0]
    checked = validate_rank(r.graphs, stage_plans)
    if not checked.ok:
        raise PlanError(f"rank {rank}: the plans do not pass the checker: {checked.violations[0]}")
    return stage_plans


def _search(
    r: _Rank, limit: int
) -> tuple[tuple[list[StagePlan], StageSimResult], list[list[Plan]]]:
    """The heuristic's plans at one-step budgets b_s(x), x from 0 (the smallest plans) to 1
    (keep-all): the largest x whose plans fit the rank, the fastest of those that fit; and
    every plan made, per stage (for ``_a_plan_each``: a plan too large for every micro-batch
    may fit one)."""
    smallest = [_smallest_plan(g, r.hw) for g in r.graphs]
    low = r.uniform(smallest, limit)
    if not low[1].fits:
        s = r.schedule
        what = f"stage {r.stages[0]}" if len(r.stages) == 1 else f"rank {r.rank}"
        raise InfeasibleBudget(
            f"{what} of a {s.kind} schedule ({s.stages} stages, {s.micro_batches} "
            f"micro-batches) cannot fit {limit} bytes: with the smallest one-step plans "
            f"({', '.join(str(p.budget_bytes) for p in smallest)} bytes a micro-batch) it "
            f"holds {low[1].peak_bytes} bytes ({s.in_flight_on_rank(r.rank)} micro-batches in "
            "flight)",
            low[1].peak_bytes,
            limit,
        )
    best = low
    tried = [[p] for p in smallest]
    lows = [p.budget_bytes for p in smallest]
    highs = [keep_all_peak(g, r.hw) for g in r.graphs]
    lo, hi = 0.0, 1.0
    for _ in range(SEARCH_STEPS):
        x = (lo + hi) / 2
        try:
            plans = [
                solve(g, int(a + x * (b - a)), r.hw, solver="heuristic")
                for g, a, b in zip(r.graphs, lows, highs)
            ]
        except InfeasibleBudget:
            lo = x
            continue
        found = r.uniform(plans, limit)
        for i, p in enumerate(plans):
            tried[i].append(p)
        if found[1].fits:
            lo = x
            if found[1].busy_s < best[1].busy_s:
                best = found
        else:
            hi = x
        if max(int((hi - lo) * (b - a)) for a, b in zip(lows, highs)) <= max(1, min(lows) // 1000):
            break
    return best, tried


def _exact(
    r: _Rank, limit: int, best: tuple[list[StagePlan], StageSimResult], solver: str,
    time_limit_s: float | None, options: dict[str, Any],
) -> tuple[list[StagePlan], StageSimResult]:  # fmt: skip
    """The exact planner at the one-step budgets the search's plans need: its plans where they
    fit the rank and are faster."""
    plans = []
    for g, stage_plan in zip(r.graphs, best[0]):
        try:
            plans.append(
                solve(
                    g,
                    stage_plan.plans[0].budget_bytes,
                    r.hw,
                    solver=solver,
                    time_limit_s=time_limit_s,
                    **options,
                )  # fmt: skip
            )
        except InfeasibleBudget:
            return best
    found = r.uniform(plans, limit)
    return found if found[1].fits and found[1].busy_s < best[1].busy_s else best


def _a_plan_each(
    r: _Rank, limit: int, best: tuple[list[StagePlan], StageSimResult], tried: list[list[Plan]]
) -> tuple[list[StagePlan], StageSimResult]:
    """Each micro-batch of each stage, from the last, takes the fastest plan of those made
    (keep-all first) under which the rank still fits and is less busy (formulations/pipeline.md,
    "A plan each")."""
    current = [list(sp.plans) for sp in best[0]]
    for i in range(len(current)):
        faster = sorted(
            {id(p): p for p in tried[i]}.values(),
            key=lambda p: r.cache[id(p)][1].step.step_time_s if id(p) in r.cache else 0.0,
        )
        for m in reversed(range(len(current[i]))):
            for candidate in faster:
                if candidate is current[i][m]:
                    break
                trial = [list(c) for c in current]
                trial[i][m] = candidate
                found = r.run(trial, limit)
                if found[1].fits and found[1].busy_s < best[1].busy_s - 1e-12:
                    best, current = found, trial
                    break
    return best


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
    """Each stage its plan for the schedule (``plan_rank`` on every rank), as
    ``plan_for_ranks`` gives each rank its own: ``graphs[s]`` is stage s's step for one
    micro-batch; ``budget`` one for every rank or one per stage (the stages of one rank, under
    an interleaved schedule, share theirs: they must be given the same); ``held_bytes`` and
    ``returned_bytes`` one for all or one per stage. A graph that names another stage
    (``graph.extra["pipeline_stage"]``) or a schedule of another size is refused.

    Args:
        graphs: each stage's step for one micro-batch, in stage order.
        budget: as for ``plan_rank``, one for all or one per stage.
        schedule: the pipeline schedule.
        hardware: the device (default: each graph's).
        solver, time_limit_s, held_bytes, returned_bytes, solve_options: as for ``plan_rank``.

    Returns:
        One checked StagePlan per stage, in stage order.
    """
    if not isinstance(schedule, PipelineSchedule):
        raise TypeError(f"plan_for_stages: schedule must be a PipelineSchedule, got {schedule!r}")
    if len(graphs) != schedule.stages:
        raise ValueError(
            f"plan_for_stages: {len(graphs)} stage graphs for a schedule of {schedule.stages} "
            "stages"
        )
    budgets = _per(budget, schedule.stages, "budget", "plan_for_stages")
    held = _per(held_bytes, schedule.stages, "held_bytes", "plan_for_stages")
    returned = _per(returned_bytes, schedule.stages, "returned_bytes", "plan_for_stages")
    for s, graph in enumerate(graphs):
        named = graph.extra.get("pipeline_stage")
        if named is not None and named != s:
            raise ValueError(
                f"plan_for_stages: graph {graph.name!r} is stage {named}'s, given as stage {s}"
            )
    out: dict[int, StagePlan] = {}
    for rank in range(schedule.ranks):
        stages = schedule.stages_of(rank)
        if len({repr(budgets[s]) for s in stages}) != 1:
            raise ValueError(
                f"plan_for_stages: stages {list(stages)} share rank {rank}'s memory: give them "
                f"one budget, not {[budgets[s] for s in stages]}"
            )
        planned = plan_rank(
            [graphs[s] for s in stages],
            budgets[stages[0]],
            schedule,
            rank,
            hardware,
            solver=solver,
            time_limit_s=time_limit_s,
            held_bytes=[held[s] for s in stages],
            returned_bytes=[returned[s] for s in stages],
            **solve_options,
        )
        out.update({p.stage: p for p in planned})
    return [out[s] for s in range(schedule.stages)]


def _per(value: Any, count: int, what: str, where: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{where}: {len(value)} {what} values for {count} stages")
        return list(value)
    return [value] * count
