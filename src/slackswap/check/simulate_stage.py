"""A stage under a pipeline schedule, simulated (formulations/pipeline.md): each micro-batch's
step is simulated alone (``simulate``), split at its forward's end into a forward phase, a
backward phase and what it holds at rest between them; the stage's actions compose them, each
action's memory being its micro-batch's phase plus what every other micro-batch in flight holds.
Whole pipelines are timed by their dependencies: a forward follows the previous stage's
forward of its micro-batch, a backward the next stage's backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..core.graph import ActivationGraph
from ..core.hardware import Hardware, hardware
from ..core.pipeline import FORWARD, Action, StagePlan
from ..core.plan import Plan
from ..core.stepmodel import Expansion
from .simulate import SimResult, simulate


@dataclass(frozen=True)
class Phases:
    """One micro-batch's step split at its forward's end."""

    forward_peak_bytes: int  # the most its forward points hold (tensors and workspaces)
    backward_peak_bytes: int
    rest_bytes: int  # its tensors resident across the forward's end
    forward_s: float  # to its last forward op's end, its offloads' and forward messages' (P3)
    backward_s: float  # the rest of the step
    step: SimResult
    # parameter gradients the step makes (a graph profiled with gradients="made"): once a
    # stage's first backward has made them they stay, and a later backward adds into them
    grad_bytes: int = 0
    backward_peak_later_bytes: int = 0  # the backward's most when the gradients exist already
    # the same peaks of its tensors alone (no workspace): what the executor tracks
    forward_tensor_peak_bytes: int = 0
    backward_tensor_peak_bytes: int = 0


@dataclass(frozen=True)
class ActionResult:
    action: Action  # (naming its stage)
    peak_bytes: int  # the rank's most during the action
    duration_s: float


@dataclass(frozen=True)
class StageSimResult:
    """A rank's whole schedule (one stage's, or several under an interleaved schedule): its
    peak against its budget, its busy time, each action."""

    stage: int  # the rank's first stage
    peak_bytes: int
    budget_bytes: int
    fits: bool
    busy_s: float  # the actions' time, back to back (no wait for other ranks)
    ideal_busy_s: float  # the same with every step at its ideal time
    actions: tuple[ActionResult, ...]
    rest_bytes: tuple[int, ...]  # per micro-batch (of the first stage)
    violations: tuple[str, ...]
    # the rank's most of tensors alone (the micro-batches' tensors and what each holds beside
    # them, no workspace, no parameter gradient): what the executor tracks across its steps
    tensor_peak_bytes: int = 0
    rank: int = 0
    stages: tuple[int, ...] = ()  # the stages the rank runs

    def summary(self) -> str:
        return (
            f"stage {self.stage}: peak {self.peak_bytes / 2**30:.3f} GiB of "
            f"{self.budget_bytes / 2**30:.3f} GiB, busy {self.busy_s * 1e3:.2f} ms (ideal "
            f"{self.ideal_busy_s * 1e3:.2f} ms)"
        )


def phases(graph: ActivationGraph, sim: SimResult) -> Phases:
    """``sim`` (one micro-batch's step) split at its forward's end."""
    exp = sim.expansion
    first_backward = int(exp.position_first_point[graph.n_ops])
    mem = sim.memory_bytes
    live = ~exp.iv_transient
    crossing = live & (exp.iv_start < first_backward) & (exp.iv_end >= first_backward)
    kinds = sim.compute_intervals[:, 3] if len(sim.compute_intervals) else np.zeros(0)
    forward_end = float(sim.compute_intervals[kinds == 0, 1].max()) if (kinds == 0).any() else 0.0
    # the next action finds the copy lanes empty: the forward's offloads drain within it, and
    # the collectives it issued (the activations sent on) end within it
    drained = float(sim.d2h_intervals[:, 1].max()) if len(sim.d2h_intervals) else 0.0
    drained = max(drained, sim.forward_collectives_end_s)
    grads, later = _gradients(graph, exp, mem, first_backward)
    tensors = exp.memory(with_workspace=False)
    return Phases(
        forward_peak_bytes=int(mem[:first_backward].max()) if first_backward else 0,
        backward_peak_bytes=int(mem[first_backward:].max()) if len(mem) > first_backward else 0,
        rest_bytes=int(exp.iv_bytes[crossing].sum()),
        forward_s=max(forward_end, drained),
        # the optimizer runs once per pipeline step, not per micro-batch
        backward_s=float(sim.step_time_s - graph.optimizer_s - forward_end),
        step=sim,
        grad_bytes=grads,
        backward_peak_later_bytes=later,
        forward_tensor_peak_bytes=int(tensors[:first_backward].max()) if first_backward else 0,
        backward_tensor_peak_bytes=(
            int(tensors[first_backward:].max()) if len(tensors) > first_backward else 0
        ),
    )


def _gradients(
    graph: ActivationGraph, exp: Expansion, mem: np.ndarray, first_backward: int
) -> tuple[int, int]:
    """(G, the backward's peak once G exists) for a graph whose backward makes its parameter
    gradients (``parameter_gradients == "made"``: each backward point's workspace holds those
    made by then): in a later backward they exist already (G beside everything) and the point
    holds, of them, only what its own op adds before it is summed in. (0, 0) otherwise."""
    if graph.extra.get("parameter_gradients") != "made":
        return 0, 0
    n = graph.n_ops
    own = np.array([int(op.extra.get("param_grad_bytes", 0)) for op in graph.ops], dtype=np.int64)
    total = int(own.sum())
    if not total:
        return 0, 0
    # made before op i's backward: every op after i (the backward runs them in reverse)
    before = np.concatenate([np.cumsum(own[::-1])[::-1][1:], [0]])
    positions = exp.point_position[first_backward:]
    ops = 2 * n - 1 - positions
    later = mem[first_backward:] - before[ops]
    return total, int(later.max()) + total if len(later) else total


def simulate_stage(
    graph: ActivationGraph, stage_plan: StagePlan, hw: Hardware | str | None = None
) -> StageSimResult:
    """The stage's schedule under its plans (one per micro-batch), on the plans' hardware (or
    ``hw``): the peak of every action against the stage's budget, and its busy time. A stage
    that shares its rank with others (an interleaved schedule) is simulated with them:
    ``simulate_rank``.

    Args:
        graph: the stage's step for one micro-batch.
        stage_plan: its plans under the schedule.
        hw: the hardware (default: each plan's own).

    Returns:
        The StageSimResult.
    """
    schedule = stage_plan.schedule
    if schedule.stages_per_rank != 1:
        rank = schedule.rank_of(stage_plan.stage)
        raise ValueError(
            f"simulate_stage: stage {stage_plan.stage} shares rank {rank} with stages "
            f"{', '.join(map(str, schedule.stages_of(rank)))}: simulate them together "
            "(simulate_rank)"
        )
    return simulate_rank([graph], [stage_plan], hw)


def rank_plans_in_order(
    graphs: Sequence[ActivationGraph], stage_plans: Sequence[StagePlan], what: str
) -> tuple[int, dict[int, tuple[ActivationGraph, StagePlan]]]:
    """(the rank, its stages' graphs and plans by stage), refusing plans of different
    schedules or budgets, missing stages of the rank, or a graph another plan's."""
    if len(graphs) != len(stage_plans) or not stage_plans:
        raise ValueError(f"{what}: {len(graphs)} graphs for {len(stage_plans)} stage plans")
    schedule = stage_plans[0].schedule
    rank = schedule.rank_of(stage_plans[0].stage)
    by_stage = {p.stage: (g, p) for g, p in zip(graphs, stage_plans)}
    if sorted(by_stage) != sorted(schedule.stages_of(rank)) or len(by_stage) != len(stage_plans):
        raise ValueError(
            f"{what}: rank {rank} runs stages {list(schedule.stages_of(rank))}; given plans "
            f"for {[p.stage for p in stage_plans]}"
        )
    for g, p in zip(graphs, stage_plans):
        if p.schedule != schedule or p.budget_bytes != stage_plans[0].budget_bytes:
            raise ValueError(f"{what}: the rank's stage plans must share one schedule and budget")
        p.plans[0].check_graph(g)
    return rank, by_stage


def simulate_rank(
    graphs: Sequence[ActivationGraph],
    stage_plans: Sequence[StagePlan],
    hw: Hardware | str | None = None,
    phases_cache: dict[int, tuple[Plan, Phases]] | None = None,
) -> StageSimResult:
    """A rank's schedule under its stages' plans (rule P1 over the rank: each action holds its
    micro-batch's phase on its stage and what every other micro-batch in flight on any of the
    rank's stages holds): its peak against the budget its stage plans share, and its busy
    time.

    Args:
        graphs: the rank's stages' steps for one micro-batch.
        stage_plans: their plans, for one schedule and one budget (the rank's memory).
        hw: the hardware (default: each plan's own).
        phases_cache: a dict the caller keeps across calls on the same graphs and hardware
            (a planner trying plans): each plan's phases are simulated once.

    Returns:
        The StageSimResult.
    """
    rank, by_stage = rank_plans_in_order(graphs, stage_plans, "simulate_rank")
    schedule = stage_plans[0].schedule
    budget = stage_plans[0].budget_bytes
    per_batch: dict[int, list[Phases]] = {}
    cache = {} if phases_cache is None else phases_cache
    for s, (graph, stage_plan) in by_stage.items():
        per_batch[s] = []
        for plan in stage_plan.plans:
            if id(plan) not in cache:  # (the plan is held beside: its id is not reused)
                cache[id(plan)] = (plan, phases(graph, simulate(graph, plan, hw)))
            per_batch[s].append(cache[id(plan)][1])
    in_flight: set[tuple[int, int]] = set()
    finished: set[tuple[int, int]] = set()
    grads_made: set[int] = set()  # stages whose first backward has ended: gradients exist
    results: list[ActionResult] = []
    violations: list[str] = []
    busy = 0.0
    tensor_peak = 0
    for action in schedule.rank_actions(rank):
        assert action.stage is not None
        s, m = action.stage, action.micro_batch
        mine = per_batch[s][m]
        plan_of = by_stage[s][1]
        resting = [k for k in in_flight if k != (s, m)]
        if action.phase == FORWARD:
            running, duration = mine.forward_peak_bytes, mine.forward_s
            running += mine.grad_bytes if s in grads_made else 0
            in_flight.add((s, m))
        else:
            later = s in grads_made and mine.grad_bytes
            running = mine.backward_peak_later_bytes if later else mine.backward_peak_bytes
            duration = mine.backward_s
            in_flight.discard((s, m))
            grads_made.add(s)
        # the running micro-batch's output is the graph's own tensor during its forward; the
        # schedule's hold on it counts from the forward's end
        beside = sum(per_batch[k][j].rest_bytes + by_stage[k][1].held_bytes for k, j in resting)
        beside += plan_of.held_bytes if action.phase != FORWARD else 0
        beside += sum(by_stage[k][1].returned_bytes for k, j in finished)
        others_grads = sum(per_batch[k][0].grad_bytes for k in grads_made if k != s)
        peak = running + beside + others_grads
        tensors = (
            mine.forward_tensor_peak_bytes
            if action.phase == FORWARD
            else mine.backward_tensor_peak_bytes
        )
        tensor_peak = max(tensor_peak, tensors + beside)
        if action.phase != FORWARD:
            finished.add((s, m))
        results.append(ActionResult(action, int(peak), float(duration)))
        busy += duration
        if peak > budget:
            where = f"stage {s}" if len(by_stage) == 1 else f"rank {rank}, stage {s}"
            violations.append(
                f"{where}, {action.phase} of micro-batch {m}: {peak} bytes, "
                f"{peak - budget} over the budget of {budget} "
                f"({len(resting)} other micro-batches at rest)"
            )
    ideal = sum(
        (g.ideal_step_time_s - g.optimizer_s) * schedule.micro_batches for g, _ in by_stage.values()
    )
    first = min(by_stage)
    return StageSimResult(
        stage=first,
        peak_bytes=max((r.peak_bytes for r in results), default=0),
        budget_bytes=budget,
        fits=not violations,
        busy_s=busy,
        ideal_busy_s=ideal,
        actions=tuple(results),
        rest_bytes=tuple(p.rest_bytes for p in per_batch[first]),
        violations=tuple(violations),
        tensor_peak_bytes=tensor_peak,
        rank=rank,
        stages=tuple(sorted(by_stage)),
    )


@dataclass(frozen=True)
class PipelineSimResult:
    """Every rank's schedule (one stage each, or several under an interleaved schedule), and
    the pipeline's step: when each action starts and ends."""

    step_s: float
    ideal_step_s: float
    stages: tuple[StageSimResult, ...]  # per rank
    starts: tuple[tuple[float, ...], ...]  # per rank, per action
    ends: tuple[tuple[float, ...], ...]

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)


def simulate_pipeline(
    graphs: Sequence[ActivationGraph],
    stage_plans: Sequence[StagePlan],
    hw: Hardware | str | None = None,
) -> PipelineSimResult:
    """The pipeline's step: each rank runs its actions in order; a forward starts once the
    previous stage's forward of that micro-batch has ended, a backward once the next stage's
    backward of it has (an action ends once the messages it sends are sent, where they cross
    the link: formulations/pipeline.md, "Messages between stages").

    Args:
        graphs: each stage's step for one micro-batch, in stage order.
        stage_plans: each stage's plans, for one schedule.
        hw: the hardware (default: each plan's own).

    Returns:
        The PipelineSimResult: the step's time, its ideal, and every rank's result.
    """
    if len(graphs) != len(stage_plans):
        raise ValueError(f"{len(graphs)} graphs for {len(stage_plans)} stage plans")
    hw = hardware(hw) if hw is not None else None
    schedule = stage_plans[0].schedule
    if (
        any(p.schedule != schedule for p in stage_plans)
        or schedule.stages != len(graphs)
        or [p.stage for p in stage_plans] != list(range(len(graphs)))
    ):
        raise ValueError(
            "simulate_pipeline: every stage plan must be for one schedule of "
            f"{len(graphs)} stages, in stage order"
        )
    ranks = [
        simulate_rank(
            [graphs[s] for s in schedule.stages_of(r)],
            [stage_plans[s] for s in schedule.stages_of(r)],
            hw,
        )
        for r in range(schedule.ranks)
    ]
    actions = [schedule.rank_actions(r) for r in range(schedule.ranks)]
    durations = [[a.duration_s for a in rank.actions] for rank in ranks]
    starts, ends = _timeline(actions, durations, schedule.stages)
    ideal = [
        [
            float(graphs[a.stage].forward_s.sum())  # type: ignore[index]
            if a.phase == FORWARD
            else float(graphs[a.stage].backward_s.sum())  # type: ignore[index]
            for a in acts
        ]
        for acts in actions
    ]
    _, ideal_ends = _timeline(actions, ideal, schedule.stages)
    return PipelineSimResult(
        step_s=max(e[-1] for e in ends),
        ideal_step_s=max(e[-1] for e in ideal_ends),
        stages=tuple(ranks),
        starts=tuple(tuple(x) for x in starts),
        ends=tuple(tuple(x) for x in ends),
    )


def _timeline(
    actions: list[tuple[Action, ...]], durations: list[list[float]], stages: int
) -> tuple[list[list[float]], list[list[float]]]:
    """When each rank's actions start and end: in order on their rank, a forward after the
    previous stage's forward of its micro-batch, a backward after the next stage's backward of
    it (the last stage's after its own forward)."""
    R = len(actions)
    starts = [[0.0] * len(a) for a in actions]
    ends = [[0.0] * len(a) for a in actions]
    done: dict[tuple[int, str, int], float] = {}
    cursor = [0] * R
    free_at = [0.0] * R
    left = sum(len(a) for a in actions)
    while left:
        progressed = False
        for r in range(R):
            while cursor[r] < len(actions[r]):
                j = cursor[r]
                action = actions[r][j]
                s, m = action.stage, action.micro_batch
                assert s is not None
                if action.phase == FORWARD:
                    before = (s - 1, FORWARD, m) if s > 0 else None
                else:
                    before = (s + 1, action.phase, m) if s < stages - 1 else (s, FORWARD, m)
                if before is not None and before not in done:
                    break
                start = max(free_at[r], done[before] if before is not None else 0.0)
                starts[r][j], ends[r][j] = start, start + durations[r][j]
                done[(s, action.phase, m)] = ends[r][j]
                free_at[r] = ends[r][j]
                cursor[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise ValueError("pipeline schedule deadlocks: a rank waits for itself")
    return starts, ends
