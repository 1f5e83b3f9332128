"""The independent checker: a plan's feasibility and step time, from the rules alone.

It reads the graph's raw fields (ops, tensors, names, bytes, times), the plan's decisions and its
complete schedule, and the hardware's figures, and walks the step as formulations/step-model.md
describes it: positions and points, rerun closures and their frontiers, residency of every read,
memory at every point against the budget, and the copy lanes. It imports the core data types
only (graph, plan, hardware, budget, errors), never the step model, the simulator or a planner:
code shared with what it checks would share its bugs (tests/test_checker.py patches
bugs into the step model and shows that this module still catches the plans they let through).
It evaluates one complete assignment, as CP-SAT's solution checker does, and searches nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..core.errors import PlanError
from ..core.graph import ActivationGraph
from ..core.hardware import Hardware, hardware
from ..core.plan import Plan
from ..core.status import Status
from ..core.units import budget_bytes_from
from .timeline import step_timeline
from .violation import Violation
from .walk import StepWalk

# relative tolerance when the plan's claimed step time is held against the derived one
CLAIM_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Validation:
    """The checker's verdict, with what it derived: the peak and the step's time."""

    ok: bool
    violations: tuple[Violation, ...]
    peak_bytes: int
    budget_bytes: int
    step_time_s: float | None = None
    stall_s: float | None = None
    recompute_s: float | None = None

    def __bool__(self) -> bool:
        return self.ok

    def report(self) -> str:
        if self.ok:
            return (
                f"ok: peak {self.peak_bytes} bytes within budget {self.budget_bytes}, "
                f"step {self.step_time_s:.6g} s"
            )
        return "\n".join(str(v) for v in self.violations)


def validate(
    graph: ActivationGraph,
    plan: Plan,
    hw: Hardware | str | None = None,
    budget: int | float | str | None = None,
) -> Validation:
    """Check ``plan`` against ``graph``: decisions, its complete schedule, every read, memory at
    every point against the budget (the plan's, or ``budget``), and the step time on the copy
    lanes of ``hw`` (the plan's hardware by default).

    Args:
        graph: the step the plan is for.
        plan: the plan, closed.
        hw: the hardware (default: the plan's own).
        budget: the budget to hold it to (default: the plan's own).

    Returns:
        The Validation: ok or every violation, with the peak and step time it derived.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"validate: plan must be a slackswap.Plan, got {type(plan).__name__}")
    step = StepWalk(graph)
    if budget is None:
        limit = plan.budget_bytes
    else:
        limit = budget_bytes_from(budget, lambda: step.keep_all_peak())
    if plan.graph_digest != graph.digest:
        msg = (
            f"plan was made for graph {plan.graph_name!r} (digest {plan.graph_digest[:12]}), "
            f"not for graph {graph.name!r} (digest {graph.digest[:12]})"
        )
        return Validation(False, (Violation("graph", msg),), 0, limit)
    if hw is None:
        if plan.hardware is None:
            return Validation(
                False,
                (
                    Violation(
                        "plan",
                        "plan names no hardware: it is not closed; complete it once with "
                        "slackswap.complete(plan, graph, hw)",
                    ),
                ),
                0,
                limit,
            )
        hw = plan.hardware
    hw = hardware(hw)
    try:
        decisions = step.read_decisions(plan)
    except PlanError as exc:
        return Validation(False, (Violation("plan", str(exc)),), 0, limit)
    walk = step.walk(decisions, plan)
    violations = list(walk.violations) + restriction_violations(
        plan, {t.name: t.bytes for t in graph.tensors}
    )
    if walk.points is None:  # the schedule could not be walked at all
        return Validation(False, tuple(violations), 0, limit)
    peak, over = step.memory(walk, limit)
    violations.extend(over)
    violations.extend(_host_memory(graph, plan, hw))
    step_time, stall, recompute = step_timeline(step, walk, decisions, plan, hw)
    claimed = plan.info.predicted_step_time_s
    same_hw = plan.hardware is None or plan.hardware == hw
    if (
        claimed is not None
        and same_hw
        and step_time > 0
        and abs(claimed - step_time) > CLAIM_TOLERANCE * step_time
    ):
        violations.append(
            Violation(
                "claim",
                f"plan claims a step time of {claimed!r} s; its schedule gives {step_time!r} s",
            )
        )
    if same_hw:
        violations.extend(_proof_claims(graph, plan, step_time, fits=not over))
    return Validation(not violations, tuple(violations), peak, limit, step_time, stall, recompute)


def _host_memory(graph: ActivationGraph, plan: Plan, hw: Hardware) -> list[Violation]:
    """What the plan holds on the host: the executor's pool keeps a buffer for every swapped
    tensor through the step, so the swapped tensors' bytes together, against the hardware's
    ``host_memory_bytes`` (0: no limit)."""
    limit = hw.host_memory_bytes
    if not limit:
        return []
    sizes = {t.name: t.bytes for t in graph.tensors}
    held = sum(sizes[name] for name, d in plan.decisions.items() if d == "swap" and name in sizes)
    if held <= limit:
        return []
    return [
        Violation(
            "host_memory",
            f"the plan swaps {held} bytes of tensors; hardware {hw.name!r} has "
            f"{limit} bytes of host memory for them (host_memory_bytes)",
            bytes_over=held - limit,
        )
    ]


def _proof_claims(
    graph: ActivationGraph, plan: Plan, step_s: float, fits: bool = True
) -> list[Violation]:
    """What the plan says of its proof, against the step the walk derived: a bound is never
    above the step (no plan beats a bound, this one included); gap and overhead gap are what
    the step and the bound make them; "optimal" means the step is within 1% of its overhead
    (or 1e-5 of the step) of the bound (core/plan.py's definition, recomputed here)."""
    from ..core.plan import OVERHEAD_TARGET, STEP_FLOOR

    info = plan.info
    out: list[Violation] = []
    if not fits:  # a bound holds for the plans that fit; one that does not is no optimum
        if info.status == Status.OPTIMAL:
            out.append(
                Violation("claim", "plan claims status 'optimal' but does not fit its budget")
            )
        return out
    bound, slack = info.bound, 1e-9 * max(step_s, 1e-300) + 1e-12
    if bound is not None and bound > step_s + slack:
        out.append(
            Violation(
                "claim",
                f"plan claims a bound of {bound!r} s, above its own step "
                f"of {step_s!r} s: no plan beats a valid bound",
            )
        )
        return out
    if info.gap is not None:
        if bound is None:
            out.append(Violation("claim", f"plan claims a gap of {info.gap!r} without a bound"))
        elif step_s > 0 and abs(info.gap - (step_s - bound) / step_s) > 1e-6:
            out.append(
                Violation(
                    "claim",
                    f"plan claims a gap of {info.gap!r}; its step and bound "
                    f"make it {(step_s - bound) / step_s!r}",
                )
            )
    ideal = float(sum(op.forward_s + op.backward_s for op in graph.ops)) + graph.optimizer_s
    overhead = max(step_s - ideal, STEP_FLOOR * step_s)
    if info.overhead_gap is not None and bound is not None and overhead > 0:
        derived = max(0.0, step_s - bound) / overhead
        if abs(info.overhead_gap - derived) > 1e-6 * max(1.0, derived):
            out.append(
                Violation(
                    "claim",
                    f"plan claims an overhead gap of {info.overhead_gap!r};"
                    f" its step and bound make it {derived!r}",
                )
            )
    if info.status == Status.OPTIMAL:
        tolerance = max(OVERHEAD_TARGET * max(step_s - ideal, 0.0), STEP_FLOOR * step_s)
        if bound is None or step_s - bound > tolerance * (1 + 1e-9) + 1e-15:
            out.append(
                Violation(
                    "claim",
                    "plan claims status 'optimal', but "
                    + (
                        "names no bound"
                        if bound is None
                        else f"its step ({step_s!r} s) is {step_s - bound!r} s above its bound, more than the "
                        f"{tolerance!r} s that 'optimal' allows (1% of the overhead, or 1e-5 of the step)"
                    ),
                )
            )
    return out


def restriction_violations(plan: Plan, sizes: Mapping[str, int] | None = None) -> list[Violation]:
    """The decisions the plan says it was restricted to (``allowed``, ``pins`` in its extras)
    and its hardware's (no host; no swap under ``min_swap_bytes``, by ``sizes`` or the plan's
    own tensor sizes), checked against its decisions."""
    out: list[Violation] = []
    allowed = plan.extra.get("allowed")
    if allowed is not None:
        for name, decision in plan.decisions.items():
            if decision not in allowed:
                out.append(
                    Violation(
                        "restriction",
                        f"restriction: tensor {name!r} is "
                        f"{decision!r}, but the plan allows only {list(allowed)}",
                        tensor=name,
                    )
                )
    hw = plan.hardware
    if hw is not None and hw.host_is_device:
        swapped = sorted(n for n, d in plan.decisions.items() if d == "swap")
        if swapped:
            out.append(
                Violation(
                    "restriction",
                    f"restriction: tensor {swapped[0]!r} is 'swap', "
                    f"but hardware {hw.name!r} has no host to swap to (its device "
                    "memory is host memory)",
                    tensor=swapped[0],
                )
            )
    if hw is not None and hw.min_swap_bytes:
        sizes = sizes if sizes is not None else plan.extra.get("tensor_bytes") or {}
        small = sorted(
            n
            for n, d in plan.decisions.items()
            if d == "swap" and n in sizes and sizes[n] < hw.min_swap_bytes
        )
        if small:
            out.append(
                Violation(
                    "restriction",
                    f"restriction: tensor {small[0]!r} "
                    f"({sizes[small[0]]} bytes) is 'swap', but hardware {hw.name!r} "
                    f"swaps no tensor under {hw.min_swap_bytes} bytes "
                    "(min_swap_bytes)",
                    tensor=small[0],
                )
            )
    for name, decision in (plan.extra.get("pins") or {}).items():
        if plan.decisions.get(name) != decision:
            out.append(
                Violation(
                    "restriction",
                    f"restriction: tensor {name!r} is pinned to "
                    f"{decision!r} but the plan makes it "
                    f"{plan.decisions.get(name)!r}",
                    tensor=name,
                )
            )
    return out
