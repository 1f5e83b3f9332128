"""The checker for a pipeline stage (formulations/pipeline.md): every micro-batch's plan checked
as one step is (``validate``), then the stage's schedule walked from the checker's own memory at
every point of each step: an action holds its micro-batch's phase, and every other micro-batch
in flight holds what it keeps across its forward's end. Shares no code with the simulator's
composition (check/simulate_stage.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core.graph import ActivationGraph
from ..core.hardware import Hardware, hardware
from ..core.pipeline import FORWARD, StagePlan
from .timeline import step_timeline
from .validate import validate
from .violation import Violation
from .walk import StepWalk


@dataclass(frozen=True)
class StageValidation:
    """``ok`` or every violation, with the stage's peak and busy time as the checker derives
    them."""

    ok: bool
    violations: tuple[Violation, ...]
    peak_bytes: int
    budget_bytes: int
    busy_s: float = 0.0

    def __bool__(self) -> bool:
        return self.ok


def validate_stage(
    graph: ActivationGraph, stage_plan: StagePlan, hw: Hardware | str | None = None
) -> StageValidation:
    """Check a stage's plans against its graph and its whole schedule against its budget (a
    stage sharing its rank with others, under an interleaved schedule: ``validate_rank``).

    Args:
        graph: the stage's step for one micro-batch.
        stage_plan: the stage's plans under the schedule.
        hw: the hardware (default: each plan's own).

    Returns:
        The StageValidation.
    """
    if not isinstance(stage_plan, StagePlan):
        raise TypeError(
            f"validate_stage: stage_plan must be a StagePlan, got {type(stage_plan).__name__}"
        )
    if stage_plan.schedule.stages_per_rank != 1:
        raise ValueError(
            f"validate_stage: stage {stage_plan.stage} shares its rank with other stages: "
            "check them together (validate_rank)"
        )
    return validate_rank([graph], [stage_plan], hw)


def validate_rank(
    graphs: Sequence[ActivationGraph],
    stage_plans: Sequence[StagePlan],
    hw: Hardware | str | None = None,
) -> StageValidation:
    """Check every plan of a rank's stages against its graph, and the rank's whole schedule
    (every stage it runs, in the order it runs them) against the budget they share.

    Args:
        graphs: the rank's stages' steps for one micro-batch.
        stage_plans: their plans under one schedule, with one budget.
        hw: the hardware (default: each plan's own).

    Returns:
        The StageValidation.
    """
    if len(graphs) != len(stage_plans) or not stage_plans:
        raise ValueError(f"validate_rank: {len(graphs)} graphs for {len(stage_plans)} plans")
    for p in stage_plans:
        if not isinstance(p, StagePlan):
            raise TypeError(f"validate_rank: a stage plan, not {type(p).__name__}")
    schedule = stage_plans[0].schedule
    budget = stage_plans[0].budget_bytes
    rank = schedule.rank_of(stage_plans[0].stage)
    graph_of = {p.stage: g for g, p in zip(graphs, stage_plans)}
    plan_of = {p.stage: p for p in stage_plans}
    mine = set(schedule.stages_of(rank))
    if set(plan_of) != mine or len(plan_of) != len(stage_plans):
        raise ValueError(
            f"validate_rank: rank {rank} runs stages {sorted(mine)}, given "
            f"{[p.stage for p in stage_plans]}"
        )
    if any(p.schedule != schedule or p.budget_bytes != budget for p in stage_plans):
        raise ValueError("validate_rank: the stage plans must share one schedule and budget")
    violations: list[Violation] = []
    # per stage, per micro-batch: (forward peak, backward peak, rest bytes, forward time,
    # backward time, the backward's peak once the parameter gradients exist)
    phases: dict[int, list[_Phases]] = {}
    grads_of: dict[int, int] = {}
    for s in sorted(mine):
        checked = _stage_phases(graph_of[s], plan_of[s], budget, hw)
        if isinstance(checked, StageValidation):
            return checked
        phases[s], grads_of[s] = checked
    in_flight: list[tuple[int, int]] = []  # (stage, micro-batch): forward run, backward not
    peak = 0
    busy = 0.0
    gradients_exist: set[int] = set()  # stages, from the end of their first backward
    finished: list[tuple[int, int]] = []  # backward run: a last stage's output returned
    for action in schedule.rank_actions(rank):
        assert action.stage is not None
        s, m = action.stage, action.micro_batch
        forward_peak, backward_peak, _, forward_s, backward_s, backward_later = phases[s][m]
        others = [k for k in in_flight if k != (s, m)]
        at_rest = sum(phases[k][j][2] + plan_of[k].held_bytes for k, j in others)
        # during its own forward a micro-batch's output is among its graph's tensors
        held = at_rest + (0 if action.phase == FORWARD else plan_of[s].held_bytes)
        held += sum(plan_of[k].returned_bytes for k, _ in finished)
        held += sum(grads_of[k] for k in gradients_exist if k != s)
        if action.phase == FORWARD:
            now = forward_peak + (grads_of[s] if s in gradients_exist else 0) + held
            busy += forward_s
            in_flight.append((s, m))
        else:
            own = backward_later if s in gradients_exist and grads_of[s] else backward_peak
            now = own + held
            busy += backward_s
            in_flight.remove((s, m))
            finished.append((s, m))
            gradients_exist.add(s)
        peak = max(peak, now)
        if now > budget:
            where = f"stage {s}" if len(mine) == 1 else f"rank {rank}, stage {s}"
            violations.append(
                Violation(
                    "memory",
                    f"{where}: the {action.phase} of micro-batch {m} holds "
                    f"{now} bytes with {len(others)} other micro-batches in flight, "
                    f"{now - budget} over the budget of {budget}",
                    None,
                    None,
                    now - budget,
                )
            )
    return StageValidation(not violations, tuple(violations), peak, budget, busy)


_Phases = tuple[int, int, int, float, float, int]


def _stage_phases(
    graph: ActivationGraph, stage_plan: StagePlan, budget: int, hw: Hardware | str | None
) -> tuple[list[_Phases], int] | StageValidation:
    """Each micro-batch's plan checked as one step, and its phases from the checker's own walk
    (per micro-batch; with the stage's parameter gradients' bytes), or the failed check."""
    step = StepWalk(graph)
    n = step.n
    seen: dict[int, _Phases] = {}
    grads, made_before = _gradients_made(graph)
    for m, plan in enumerate(stage_plan.plans):
        if id(plan) in seen:
            continue
        checked = validate(graph, plan, hw, budget=budget)
        if not checked.ok:
            where = f"stage {stage_plan.stage}, micro-batch {m}"
            return StageValidation(
                False,
                tuple(
                    Violation(v.kind, f"{where}: {v.message}", v.op, v.tensor, v.bytes_over)
                    for v in checked.violations
                ),
                checked.peak_bytes,
                budget,
            )
        decisions = step.read_decisions(plan)
        walk = step.walk(decisions, plan)
        assert walk.points is not None
        memory = step.point_memory(walk)
        first_backward = next(p for p, (k, _, _) in enumerate(walk.points) if k >= n)
        marks: dict[str, float] = {}
        on = hw if hw is not None else plan.hardware
        assert on is not None  # validate() refused a plan that names no hardware
        total, _, _ = step_timeline(step, walk, decisions, plan, hardware(on), marks)
        forward_end = marks.get("forward_end", 0.0)
        # a later backward adds into gradients that exist: of those made by then, a point
        # holds only what its own op adds (the rest is the whole G, beside)
        later = max(
            (
                memory[p] - made_before[2 * n - 1 - k]
                for p, (k, _, _) in enumerate(walk.points)
                if k >= n
            ),
            default=0,
        )
        seen[id(plan)] = (
            max(memory[:first_backward], default=0),
            max(memory[first_backward:], default=0),
            step.rest_bytes(walk),
            max(
                forward_end,
                marks.get("offloads_end", 0.0),
                marks.get("forward_comms_end", 0.0),
            ),
            total - graph.optimizer_s - forward_end,
            later + grads,
        )
    return [seen[id(p)] for p in stage_plan.plans], grads


def _gradients_made(graph: ActivationGraph) -> tuple[int, list[int]]:
    """For a graph whose backward makes the parameter gradients (``parameter_gradients`` is
    "made"): their bytes G, and per op those made before its backward (by the ops after it).
    (0, zeros) otherwise."""
    n = len(graph.ops)
    if graph.extra.get("parameter_gradients") != "made":
        return 0, [0] * n
    own = [int(op.extra.get("param_grad_bytes", 0)) for op in graph.ops]
    before = [0] * n
    running = 0
    for i in range(n - 1, -1, -1):
        before[i] = running
        running += own[i]
    return running, before
