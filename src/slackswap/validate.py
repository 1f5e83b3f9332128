"""The independent validator: checks a plan against the step model's rules alone.

It imports no planner or solver code and recomputes residency and memory itself, so a wrong
plan from any planner (or a wrong expansion) is caught here rather than trusted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import PlanError
from .graph import ActivationGraph
from .hardware import Hardware, hardware
from .plan import KEEP, RECOMPUTE, SWAP, Plan
from .stepmodel import decision_codes, expand


@dataclass(frozen=True)
class Violation:
    """One broken rule: which op (position), which tensor, and by how many bytes if memory."""

    kind: str
    message: str
    op: str | None = None
    tensor: str | None = None
    bytes_over: int = 0

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Validation:
    ok: bool
    violations: tuple[Violation, ...]
    peak_bytes: int
    budget_bytes: int

    def __bool__(self) -> bool:
        return self.ok

    def report(self) -> str:
        if self.ok:
            return f"ok: peak {self.peak_bytes} bytes within budget {self.budget_bytes}"
        return "\n".join(str(v) for v in self.violations)


def validate(graph: ActivationGraph, plan: Plan, hw: Hardware | str,
             budget: int | float | str | None = None) -> Validation:
    """Check ``plan`` for ``graph``: decisions, schedule, residency rules, and memory <= budget."""
    from .budget import parse_budget

    hw = hardware(hw)
    budget_bytes = plan.budget_bytes if budget is None else parse_budget(budget, graph, hw)
    if plan.graph_digest != graph.digest:
        msg = (f"plan was made for graph {plan.graph_name!r} (digest {plan.graph_digest[:12]}), "
               f"not for graph {graph.name!r} (digest {graph.digest[:12]})")
        return Validation(False, (Violation("graph", msg),), 0, budget_bytes)
    try:
        codes = decision_codes(graph, plan)
        exp = expand(graph, codes, plan.schedule, hw,
                     budget_bytes=budget_bytes if plan.schedule is None else None)
    except PlanError as exc:
        return Validation(False, (Violation("plan", str(exc)),), 0, budget_bytes)
    violations = _residency_rules(graph, codes, exp)
    peak, memory_violations = _memory(graph, exp, budget_bytes)
    violations.extend(memory_violations)
    return Validation(not violations, tuple(violations), peak, budget_bytes)


def _point_name(graph: ActivationGraph, exp, p: int) -> str:
    kind = ("forward", "rerun", "backward")[int(exp.point_kind[p])]
    return f"{kind} of op {graph.ops[int(exp.point_op[p])].name!r}"


def _residency_rules(graph: ActivationGraph, codes: np.ndarray, exp) -> list[Violation]:
    """Every read finds its tensor resident; kept tensors never leave; swaps and recomputes
    leave the device only after their last forward reader."""
    out: list[Violation] = []
    T = len(graph.tensors)
    intervals: list[list[tuple[int, int]]] = [[] for _ in range(T)]
    lives: list[list[tuple[int, int]]] = [[] for _ in range(T)]
    for t, s, e, tr in zip(exp.iv_tensor, exp.iv_start, exp.iv_end, exp.iv_transient):
        intervals[int(t)].append((int(s), int(e)))
        if not tr:
            lives[int(t)].append((int(s), int(e)))

    def resident(t: int, p: int) -> bool:
        return any(s <= p <= e for s, e in intervals[t])

    # reads in forward
    for i, ins in enumerate(graph.op_inputs):
        for t in ins:
            if not resident(t, i):
                out.append(Violation("residency", f"forward of op {graph.ops[i].name!r} reads tensor "
                           f"{graph.tensors[t].name!r}, which is not on the device",
                           graph.ops[i].name, graph.tensors[t].name))
    # reads in backward: saved tensors at their readers, rerun inputs at reruns
    for p in range(graph.n_ops, exp.n_points):
        op = int(exp.point_op[p])
        reads = graph.saved_by_op[op] if exp.point_kind[p] == 2 else graph.op_inputs[op]
        for t in reads:
            if not resident(t, p):
                out.append(Violation("residency", f"{_point_name(graph, exp, p)} reads tensor "
                           f"{graph.tensors[t].name!r}, which is not on the device",
                           graph.ops[op].name, graph.tensors[t].name))
    producer = graph.producer
    last_fwd = graph.last_forward_use
    for t in graph.saved:
        name = graph.tensors[t].name
        ivs = sorted(lives[t])
        if not ivs or ivs[0][0] != producer[t]:
            out.append(Violation("residency", f"tensor {name!r} is not resident from its producer on",
                                 tensor=name))
            continue
        if codes[t] == KEEP and len(ivs) != 1:
            out.append(Violation("residency", f"kept tensor {name!r} leaves the device", tensor=name))
        if codes[t] in (SWAP, RECOMPUTE) and ivs[0][1] < last_fwd[t]:
            out.append(Violation("residency", f"tensor {name!r} leaves before its last forward reader",
                                 tensor=name))
        if codes[t] == RECOMPUTE and len(ivs) == 2:
            rebuilt_at = ivs[1][0]
            if exp.point_kind[rebuilt_at] != 1 or t not in graph.op_outputs[int(exp.point_op[rebuilt_at])]:
                out.append(Violation("rerun", f"recomputed tensor {name!r} reappears without its "
                                     "producer running again", tensor=name))
        if codes[t] == SWAP and exp.d2h_free[t] >= exp.h2d_issue[t]:
            out.append(Violation("schedule", f"tensor {name!r} is prefetched before it has left",
                                 tensor=name))
    return out


def _memory(graph: ActivationGraph, exp, budget: int) -> tuple[int, list[Violation]]:
    """Memory at every point by an event sweep (allocations at a point, frees after it)."""
    n_points = exp.n_points
    alloc: list[list[int]] = [[] for _ in range(n_points)]
    free: list[list[int]] = [[] for _ in range(n_points)]
    nbytes = graph.tensor_bytes
    for t, s, e in zip(exp.iv_tensor, exp.iv_start, exp.iv_end):
        alloc[int(s)].append(int(t))
        free[int(e)].append(int(t))
    live = 0
    peak = 0
    out: list[Violation] = []
    resident: dict[int, int] = {}
    for p in range(n_points):
        for t in alloc[p]:
            live += int(nbytes[t])
            resident[t] = resident.get(t, 0) + 1
        now = live + int(exp.point_workspace[p])
        peak = max(peak, now)
        if now > budget:
            op = graph.ops[int(exp.point_op[p])].name
            top = max(resident, key=lambda t: nbytes[t]) if resident else None
            tname = graph.tensors[top].name if top is not None else None
            out.append(Violation(
                "memory",
                f"{_point_name(graph, exp, p)}: {now} bytes on the device, {now - budget} over the "
                f"budget of {budget} (largest resident tensor {tname!r})",
                op, tname, now - budget))
        for t in free[p]:
            live -= int(nbytes[t])
            resident[t] -= 1
            if not resident[t]:
                del resident[t]
    return peak, out
