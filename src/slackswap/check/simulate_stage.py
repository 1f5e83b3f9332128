"""A stage under a pipeline schedule, simulated (formulations/pipeline.md): each micro-batch's
step is simulated alone (``simulate``), split at its forward's end into a forward phase, a
backward phase and what it holds at rest between them; the stage's actions compose them, each
action's memory being its micro-batch's phase plus what every other micro-batch in flight holds.
Whole pipelines are timed by their dependencies: a forward follows the previous stage's
forward of its micro-batch, a backward the next stage's backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.graph import ActivationGraph
from ..core.hardware import Hardware, hardware
from ..core.pipeline import FORWARD, Action, StagePlan
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
    action: Action
    peak_bytes: int  # the stage's most during the action
    duration_s: float


@dataclass(frozen=True)
class StageSimResult:
    """A stage's whole schedule: its peak against its budget, its busy time, each action."""

    stage: int
    peak_bytes: int
    budget_bytes: int
    fits: bool
    busy_s: float  # the actions' time, back to back (no wait for other stages)
    ideal_busy_s: float  # the same with every step at its ideal time
    actions: tuple[ActionResult, ...]
    rest_bytes: tuple[int, ...]  # per micro-batch
    violations: tuple[str, ...]
    # the stage's most of tensors alone (the micro-batches' tensors and what each holds beside
    # them, no workspace, no parameter gradient): what the executor tracks across its steps
    tensor_peak_bytes: int = 0

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
    ``hw``): the peak of every action against the stage's budget, and its busy time.

    Args:
        graph: the stage's step for one micro-batch.
        stage_plan: its plans under the schedule.
        hw: the hardware (default: each plan's own).

    Returns:
        The StageSimResult.
    """
    cache: dict[int, Phases] = {}
    per_batch: list[Phases] = []
    for plan in stage_plan.plans:
        if id(plan) not in cache:
            cache[id(plan)] = phases(graph, simulate(graph, plan, hw))
        per_batch.append(cache[id(plan)])
    held = stage_plan.held_bytes
    forward_done: set[int] = set()
    backward_started: set[int] = set()
    grads_made = False  # a backward has ended: the parameter gradients exist from then on
    results: list[ActionResult] = []
    violations: list[str] = []
    busy = 0.0
    tensor_peak = 0
    for action in stage_plan.schedule.actions(stage_plan.stage):
        m = action.micro_batch
        mine = per_batch[m]
        resting = [k for k in forward_done if k not in backward_started and k != m]
        if action.phase == FORWARD:
            running, duration = mine.forward_peak_bytes, mine.forward_s
            running += mine.grad_bytes if grads_made else 0
            forward_done.add(m)
        else:
            later = grads_made and mine.grad_bytes
            running = mine.backward_peak_later_bytes if later else mine.backward_peak_bytes
            duration = mine.backward_s
            backward_started.add(m)
            grads_made = True
        # the running micro-batch's output is the graph's own tensor during its forward; the
        # schedule's hold on it counts from the forward's end
        holding = len(resting) + (0 if action.phase == FORWARD else 1)
        beside = sum(per_batch[k].rest_bytes for k in resting) + held * holding
        beside += stage_plan.returned_bytes * len(backward_started - {m})
        peak = running + beside
        tensors = (
            mine.forward_tensor_peak_bytes
            if action.phase == FORWARD
            else mine.backward_tensor_peak_bytes
        )
        tensor_peak = max(tensor_peak, tensors + beside)
        results.append(ActionResult(action, int(peak), float(duration)))
        busy += duration
        if peak > stage_plan.budget_bytes:
            violations.append(
                f"stage {stage_plan.stage}, {action.phase} of micro-batch {m}: {peak} bytes, "
                f"{peak - stage_plan.budget_bytes} over the budget of {stage_plan.budget_bytes} "
                f"({len(resting)} other micro-batches at rest)"
            )
    ideal = (graph.ideal_step_time_s - graph.optimizer_s) * stage_plan.schedule.micro_batches
    peak_bytes = max((r.peak_bytes for r in results), default=0)
    return StageSimResult(
        stage=stage_plan.stage,
        peak_bytes=peak_bytes,
        budget_bytes=stage_plan.budget_bytes,
        fits=not violations,
        busy_s=busy,
        ideal_busy_s=ideal,
        actions=tuple(results),
        rest_bytes=tuple(p.rest_bytes for p in per_batch),
        violations=tuple(violations),
        tensor_peak_bytes=tensor_peak,
    )


@dataclass(frozen=True)
class PipelineSimResult:
    """Every stage's schedule, and the pipeline's step: when each action starts and ends."""

    step_s: float
    ideal_step_s: float
    stages: tuple[StageSimResult, ...]
    starts: tuple[tuple[float, ...], ...]  # per stage, per action
    ends: tuple[tuple[float, ...], ...]

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)


def simulate_pipeline(
    graphs: list[ActivationGraph],
    stage_plans: list[StagePlan],
    hw: Hardware | str | None = None,
) -> PipelineSimResult:
    """The pipeline's step: each stage runs its actions in order; a forward starts once the
    previous stage's forward of that micro-batch has ended, a backward once the next stage's
    backward of it has (an action ends once the messages it sends are sent, where they cross
    the link: formulations/pipeline.md, "Messages between stages").

    Args:
        graphs: each stage's step for one micro-batch, in stage order.
        stage_plans: each stage's plans, for one schedule.
        hw: the hardware (default: each plan's own).

    Returns:
        The PipelineSimResult: the step's time, its ideal, and every stage's result.
    """
    if len(graphs) != len(stage_plans):
        raise ValueError(f"{len(graphs)} graphs for {len(stage_plans)} stage plans")
    hw = hardware(hw) if hw is not None else None
    stages = [simulate_stage(g, p, hw) for g, p in zip(graphs, stage_plans)]
    schedule = stage_plans[0].schedule
    if any(p.schedule != schedule for p in stage_plans) or schedule.stages != len(graphs):
        raise ValueError(
            f"simulate_pipeline: every stage plan must be for one schedule of {len(graphs)} stages"
        )
    actions = [schedule.actions(s) for s in range(len(graphs))]
    durations = [[a.duration_s for a in stage.actions] for stage in stages]
    starts, ends = _timeline(actions, durations)
    ideal = [
        [
            float(g.forward_s.sum()) if a.phase == FORWARD else float(g.backward_s.sum())
            for a in acts
        ]
        for g, acts in zip(graphs, actions)
    ]
    _, ideal_ends = _timeline(actions, ideal)
    return PipelineSimResult(
        step_s=max(e[-1] for e in ends),
        ideal_step_s=max(e[-1] for e in ideal_ends),
        stages=tuple(stages),
        starts=tuple(tuple(x) for x in starts),
        ends=tuple(tuple(x) for x in ends),
    )


def _timeline(
    actions: list[tuple[Action, ...]], durations: list[list[float]]
) -> tuple[list[list[float]], list[list[float]]]:
    """When each stage's actions start and end: in order on their stage, a forward after the
    previous stage's forward of its micro-batch, a backward after the next stage's backward of
    it (the last stage's after its own forward)."""
    P = len(actions)
    starts = [[0.0] * len(a) for a in actions]
    ends = [[0.0] * len(a) for a in actions]
    done: dict[tuple[int, str, int], float] = {}
    cursor = [0] * P
    free_at = [0.0] * P
    left = sum(len(a) for a in actions)
    while left:
        progressed = False
        for s in range(P):
            while cursor[s] < len(actions[s]):
                j = cursor[s]
                action = actions[s][j]
                m = action.micro_batch
                if action.phase == FORWARD:
                    before = (s - 1, FORWARD, m) if s > 0 else None
                else:
                    before = (s + 1, action.phase, m) if s < P - 1 else (s, FORWARD, m)
                if before is not None and before not in done:
                    break
                start = max(free_at[s], done[before] if before is not None else 0.0)
                starts[s][j], ends[s][j] = start, start + durations[s][j]
                done[(s, action.phase, m)] = ends[s][j]
                free_at[s] = ends[s][j]
                cursor[s] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise ValueError("pipeline schedule deadlocks: a stage waits for itself")
    return starts, ends
