"""The checker for a pipeline stage (formulations/pipeline.md): every micro-batch's plan checked
as one step is (``validate``), then the stage's schedule walked from the checker's own memory at
every point of each step: an action holds its micro-batch's phase, and every other micro-batch
in flight holds what it keeps across its forward's end. Shares no code with the simulator's
composition (check/simulate_stage.py)."""

from __future__ import annotations

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
    """Check a stage's plans against its graph and its whole schedule against its budget.

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
    budget = stage_plan.budget_bytes
    step = StepWalk(graph)
    n = step.n
    # per distinct plan: (forward peak, backward peak, rest bytes, forward time, backward time,
    # the backward's peak once the parameter gradients exist)
    seen: dict[int, tuple[int, int, int, float, float, int]] = {}
    grads, made_before = _gradients_made(graph)
    violations: list[Violation] = []
    for m, plan in enumerate(stage_plan.plans):
        if id(plan) in seen:
            continue
        checked = validate(graph, plan, hw, budget=budget)
        violations.extend(
            Violation(v.kind, f"micro-batch {m}: {v.message}", v.op, v.tensor, v.bytes_over)
            for v in checked.violations
        )
        if not checked.ok:
            return StageValidation(False, tuple(violations), checked.peak_bytes, budget)
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
    phases = [seen[id(p)] for p in stage_plan.plans]
    in_flight: list[int] = []  # micro-batches whose forward ran and whose backward has not
    peak = 0
    busy = 0.0
    gradients_exist = False  # from the end of the stage's first backward
    finished: list[int] = []  # micro-batches whose backward has run: their output returned
    for action in stage_plan.schedule.actions(stage_plan.stage):
        m = action.micro_batch
        forward_peak, backward_peak, _, forward_s, backward_s, backward_later = phases[m]
        others = [k for k in in_flight if k != m]
        at_rest = sum(phases[k][2] for k in others)
        # during its own forward a micro-batch's output is among its graph's tensors
        held = stage_plan.held_bytes * (len(others) + (0 if action.phase == FORWARD else 1))
        held += stage_plan.returned_bytes * len(finished)
        if action.phase == FORWARD:
            now = forward_peak + (grads if gradients_exist else 0) + at_rest + held
            busy += forward_s
            in_flight.append(m)
        else:
            now = (backward_later if gradients_exist and grads else backward_peak) + at_rest
            now += held
            busy += backward_s
            in_flight.remove(m)
            finished.append(m)
            gradients_exist = True
        peak = max(peak, now)
        if now > budget:
            violations.append(
                Violation(
                    "memory",
                    f"stage {stage_plan.stage}: the {action.phase} of micro-batch {m} holds "
                    f"{now} bytes with {len(others)} other micro-batches in flight, "
                    f"{now - budget} over the budget of {budget}",
                    None,
                    None,
                    now - budget,
                )
            )
    return StageValidation(not violations, tuple(violations), peak, budget, busy)


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
