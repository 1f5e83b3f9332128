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
from ..core.units import budget_bytes_from

# relative tolerance when the plan's claimed step time is held against the derived one
CLAIM_TOLERANCE = 1e-9
_MAX_MEMORY_VIOLATIONS = 20


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
    lanes of ``hw`` (the plan's hardware by default)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"validate: plan must be a slackswap.Plan, got {type(plan).__name__}")
    step = _Step(graph)
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
    step_time, stall, recompute = step.timeline(walk, decisions, plan, hw)
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
        if info.status == "optimal":
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
    if info.status == "optimal":
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


@dataclass
class _Walk:
    """The step under one plan: its points and every tensor's residency over them."""

    violations: list[Violation]
    points: list[tuple[int, int, str]] | None = None  # (slot, op, "forward"|"rerun"|"backward")
    slot_points: list[list[int]] | None = None
    intervals: list[tuple[int, int, int]] | None = None  # (tensor, first point, last point)
    reruns: list[list[int]] | None = None
    swap_reads: dict[int, set[int]] | None = None  # by slot, swapped tensors read there


class _Step:
    """The graph's raw fields, indexed; every rule below is written from the step model's text."""

    def __init__(self, graph: ActivationGraph):
        self.graph = graph
        ops = graph.ops
        self.n = len(ops)
        self.op_of = {op.name: i for i, op in enumerate(ops)}
        self.tensor_of = {t.name: j for j, t in enumerate(graph.tensors)}
        self.nbytes = [int(t.bytes) for t in graph.tensors]
        self.producer = [0] * len(graph.tensors)
        for i, op in enumerate(ops):
            for name in op.outputs:
                self.producer[self.tensor_of[name]] = i
        self.reads = [[self.tensor_of[x] for x in op.inputs if x in self.tensor_of] for op in ops]
        self.makes = [[self.tensor_of[x] for x in op.outputs] for op in ops]
        # in-place writes: a tensor written after it was made is rebuilt by its producer and
        # then its writers, in forward order
        self.written_by: list[list[int]] = [[] for _ in graph.tensors]
        for i, op in enumerate(ops):
            for x in op.writes:
                if x in self.tensor_of:
                    self.written_by[self.tensor_of[x]].append(i)
        # ops that run again with an op that runs again (torch's checkpoint reruns its region)
        self.also = [[self.op_of[x] for x in op.rerun_with] for op in ops]
        self.saved = [bool(t.saved_for) for t in graph.tensors]
        self.readers_bwd = [[self.op_of[o] for o in t.saved_for] for t in graph.tensors]
        self.bwd_reads: list[list[int]] = [[] for _ in ops]
        for t, readers in enumerate(self.readers_bwd):
            for i in readers:
                self.bwd_reads[i].append(t)
        self.last_fwd = list(self.producer)
        for i, ins in enumerate(self.reads):
            for t in ins:
                self.last_fwd[t] = max(self.last_fwd[t], i)
        for j, t in enumerate(graph.tensors):
            if t.alive_until is not None:
                self.last_fwd[j] = max(self.last_fwd[j], self.op_of[t.alive_until])
        self._closure: dict[int, tuple[frozenset[int], frozenset[int]]] = {}

    # ------------------------------------------------------------------ rerun closures
    def closure(self, op: int) -> tuple[frozenset[int], frozenset[int]]:
        """Ops that run again to rebuild ``op``'s outputs (it, and the producers of every unsaved
        tensor they read, recursively) and the saved tensors those reruns read (the frontier)."""
        known = self._closure.get(op)
        if known is not None:
            return known
        ops, frontier = {op}, set()
        todo = [op]
        while todo:
            q = todo.pop()
            for t in self.reads[q]:
                if self.saved[t]:
                    frontier.add(t)
                    continue
                # an unsaved tensor as op q read it: its producer, and its writes before q
                for r in [self.producer[t]] + [w for w in self.written_by[t] if w < q]:
                    if r not in ops:
                        ops.add(r)
                        todo.append(r)
        result = (frozenset(ops), frozenset(frontier))
        self._closure[op] = result
        return result

    def rebuild(self, t: int) -> tuple[frozenset[int], frozenset[int]]:
        """Ops that run again to rebuild saved tensor ``t`` (its producer's closure, then every
        write to it with theirs) and the saved tensors they read, ``t`` itself aside."""
        ops, frontier = set(), set()
        for q in [self.producer[t]] + self.written_by[t]:
            more_ops, more = self.closure(q)
            ops |= more_ops
            frontier |= more
        # every op in it brings the ops it reruns with, each with its own closure (once over
        # the set: what those bring is not expanded again)
        for q in list(ops):
            for r in self.also[q]:
                more_ops, more = self.closure(r)
                ops |= more_ops
                frontier |= more
        frontier.discard(t)
        return frozenset(ops), frozenset(frontier)

    # ------------------------------------------------------------------ decisions
    def read_decisions(self, plan: Plan) -> list[str | None]:
        """One decision per saved tensor, None for the others; raises on any that breaks a rule."""
        g = self.graph
        decisions: list[str | None] = [None] * len(g.tensors)
        for name, decision in plan.decisions.items():
            t = self.tensor_of.get(name)
            if t is None:
                raise PlanError(f"plan: tensor {name!r} is not in graph {g.name!r}")
            if not self.saved[t]:
                raise PlanError(
                    f"plan: tensor {name!r} is not saved for backward; it takes no decision"
                )
            if decision not in ("keep", "swap", "recompute"):
                raise PlanError(f"plan: tensor {name!r} has decision {decision!r}")
            decisions[t] = str(decision)
        for t, tensor in enumerate(g.tensors):
            if self.saved[t] and decisions[t] is None:
                raise PlanError(f"plan: no decision for saved tensor {tensor.name!r}")
            if decisions[t] == "recompute":
                ops, _ = self.rebuild(t)
                blocked = sorted(q for q in ops if not g.ops[q].recomputable)
                if blocked:
                    raise PlanError(
                        f"plan: tensor {tensor.name!r} cannot be recomputed: op "
                        f"{g.ops[blocked[0]].name!r} may not run again"
                    )
        groups: dict[str, set[bool]] = {}
        for t, tensor in enumerate(g.tensors):
            if self.saved[t] and tensor.group is not None:
                groups.setdefault(tensor.group, set()).add(decisions[t] == "recompute")
        for group, kinds in groups.items():
            if len(kinds) > 1:
                raise PlanError(
                    f"plan: tensors of RNG group {group!r} must be recomputed all "
                    "together or not at all"
                )
        return decisions

    def keep_all_peak(self) -> int:
        """The keep-all peak, walked by this checker itself (a budget given as a fraction)."""
        keep = ["keep" if s else None for s in self.saved]
        walk = self.walk(keep, None)
        return self.memory(walk, None)[0]

    # ------------------------------------------------------------------ the walk
    def _position(
        self, plan: Plan | None, table: str, t: int, violations: list[Violation]
    ) -> int | None:
        name = self.graph.tensors[t].name
        schedule = None if plan is None else plan.schedule
        entries = {} if schedule is None else getattr(schedule, table)
        if name not in entries:
            violations.append(
                Violation(
                    "schedule",
                    f"schedule: {table} has no position for tensor "
                    f"{name!r}: the plan is not complete",
                    tensor=name,
                )
            )
            return None
        pos = int(entries[name])
        if not 0 <= pos < 2 * self.n:
            violations.append(
                Violation(
                    "schedule",
                    f"schedule: {table}[{name!r}] = {pos} is not a "
                    f"position of the step (0..{2 * self.n - 1})",
                    tensor=name,
                )
            )
            return None
        return pos

    def _label(self, slot: int) -> str:
        if slot < self.n:
            return f"forward of op {self.graph.ops[slot].name!r}"
        return f"backward of op {self.graph.ops[2 * self.n - 1 - slot].name!r}"

    def walk(self, decisions: list[str | None], plan: Plan | None) -> _Walk:
        g, n = self.graph, self.n
        S = 2 * n
        out: list[Violation] = []
        names = [t.name for t in g.tensors]
        # the schedule, complete and naming only tensors with that decision
        free_after: dict[int, int] = {}
        issue_at: dict[int, int] = {}
        rebuild_at: dict[int, int] = {}
        if plan is not None:
            schedule = plan.schedule
            for table, wanted in (
                ("d2h_free", "swap"),
                ("h2d_issue", "swap"),
                ("recompute_at", "recompute"),
            ):
                for name in {} if schedule is None else getattr(schedule, table):
                    t = self.tensor_of.get(name)
                    if t is None or decisions[t] != wanted:
                        out.append(
                            Violation(
                                "schedule",
                                f"schedule: {table} names tensor {name!r}, "
                                f"which the plan does not {wanted}",
                                tensor=name,
                            )
                        )
            for t, d in enumerate(decisions):
                if d == "swap":
                    f = self._position(plan, "d2h_free", t, out)
                    i = self._position(plan, "h2d_issue", t, out)
                    if f is not None and i is not None:
                        free_after[t], issue_at[t] = f, i
                elif d == "recompute":
                    r = self._position(plan, "recompute_at", t, out)
                    if r is not None:
                        rebuild_at[t] = r
            if out:
                return _Walk(out)
        # backward: which ops run again before each backward op, and what each position reads
        rebuilt: dict[int, int] = {}
        first_read: dict[int, int] = {}
        reruns: list[list[int]] = [[]] * S  # (each backward slot gets its own list below)
        swap_reads: dict[int, set[int]] = {}
        planned: dict[int, list[int]] = {}
        for t, slot in rebuild_at.items():
            planned.setdefault(slot, []).append(t)
        for k in range(n, S):
            j = S - 1 - k
            here: set[int] = set()
            todo = list(self.bwd_reads[j]) + planned.get(k, [])
            while todo:
                t = todo.pop()
                first_read.setdefault(t, k)
                if decisions[t] == "swap":
                    swap_reads.setdefault(k, set()).add(t)
                elif decisions[t] == "recompute" and t not in rebuilt:
                    rebuilt[t] = k
                    ops, frontier = self.rebuild(t)
                    here |= ops
                    todo.extend(frontier)
                if not todo:  # what the reruns make that the plan recomputes is rebuilt too
                    todo = [
                        x
                        for q in here
                        for x in self.makes[q]
                        if decisions[x] == "recompute" and x not in rebuilt
                    ]
            reruns[k] = sorted(here)
            # sharded parameters are gathered only for their own unit's backward: a rerun of an
            # op that reads them runs in that unit's backward, or it reads freed memory
            here_unit = g.ops[j].unit
            for q in reruns[k]:
                if g.ops[q].param_unit and g.ops[q].param_unit != here_unit:
                    out.append(
                        Violation(
                            "recompute",
                            f"recompute: op {g.ops[q].name!r} runs again before the "
                            f"backward of {g.ops[j].name!r} (unit {here_unit or 'none'!r}), but reads "
                            f"the parameters of unit {g.ops[q].param_unit!r}, not gathered there",
                            op=g.ops[q].name,
                        )
                    )
        for t, slot in rebuild_at.items():
            if slot < n:
                out.append(
                    Violation(
                        "schedule",
                        f"schedule: recompute_at[{names[t]!r}] = {slot} is in the forward pass",
                        tensor=names[t],
                    )
                )
            elif rebuilt.get(t) != slot:
                out.append(
                    Violation(
                        "schedule",
                        f"schedule: recompute_at[{names[t]!r}] = {slot} is "
                        f"after its first use at position {rebuilt.get(t)} "
                        f"({self._label(rebuilt.get(t, slot))})",
                        tensor=names[t],
                    )
                )
            latest = g.tensors[t].rebuilt_before
            if latest is not None and slot > 2 * n - 1 - self.op_of[latest]:
                # torch's checkpoint reruns the tensor's region before that op's backward: a plan
                # that holds it later would count less memory than the run holds
                out.append(
                    Violation(
                        "schedule",
                        f"schedule: recompute_at[{names[t]!r}] = {slot} is "
                        f"after its latest rebuild position, the backward of op "
                        f"{latest!r} (rebuilt_before)",
                        tensor=names[t],
                    )
                )
        for t in free_after:
            if free_after[t] < self.last_fwd[t]:
                out.append(
                    Violation(
                        "schedule",
                        f"schedule: d2h_free[{names[t]!r}] = {free_after[t]} "
                        f"is before its last forward reader at position "
                        f"{self.last_fwd[t]}",
                        tensor=names[t],
                    )
                )
            if issue_at[t] <= free_after[t]:
                out.append(
                    Violation(
                        "schedule",
                        f"schedule: tensor {names[t]!r} is prefetched at "
                        f"position {issue_at[t]}, before it has left (d2h_free "
                        f"{free_after[t]})",
                        tensor=names[t],
                    )
                )
            if issue_at[t] > first_read[t]:
                out.append(
                    Violation(
                        "schedule",
                        f"schedule: h2d_issue[{names[t]!r}] = {issue_at[t]} "
                        f"is after its first use at position {first_read[t]} "
                        f"({self._label(first_read[t])})",
                        tensor=names[t],
                    )
                )
        if out:
            return _Walk(out)
        # points: forward ops; before each backward op its reruns in forward order, then the op
        points: list[tuple[int, int, str]] = []
        slot_points: list[list[int]] = []
        for k in range(S):
            mine = []
            if k < n:
                mine.append(len(points))
                points.append((k, k, "forward"))
            else:
                for q in reruns[k]:
                    mine.append(len(points))
                    points.append((k, q, "rerun"))
                mine.append(len(points))
                points.append((k, S - 1 - k, "backward"))
            slot_points.append(mine)
        # residency: from where a tensor appears to the last point that reads it
        last_read: dict[int, int] = {}
        comes_back: dict[int, int] = {}  # recomputed tensor -> the rerun point that rebuilds it
        intervals: list[tuple[int, int, int]] = []
        replayed = any(self.also)
        for k in range(n, S):
            made_at: dict[int, int] = {}
            read_last: dict[int, int] = {}
            for p in slot_points[k]:
                _, op, kind = points[p]
                if kind == "backward":
                    for t in self.bwd_reads[op]:
                        last_read[t] = p
                    continue
                for t in self.reads[op]:
                    if self.saved[t]:
                        last_read[t] = p
                    else:
                        read_last[t] = p
                for t in self.makes[op]:
                    if decisions[t] == "recompute" and rebuilt.get(t) == k:
                        comes_back[t] = p
                    else:
                        made_at[t] = p
                        read_last[t] = p
                # a region replayed as its forward ran (its ops name Op.rerun_with) holds the
                # unsaved tensors its forward still held when this op ran
                for t in made_at if replayed else ():
                    if not self.saved[t] and self.also[self.producer[t]] and op <= self.last_fwd[t]:
                        read_last[t] = p
            for t, p in made_at.items():  # rerun by-products live within the position
                intervals.append((t, p, read_last[t]))
        transient = len(intervals)
        for t, d in enumerate(decisions):
            made = self.producer[t]
            if d is None or d == "recompute":
                intervals.append((t, made, self.last_fwd[t]))
                if d == "recompute":
                    intervals.append((t, comes_back[t], last_read[t]))
            elif d == "keep":
                intervals.append((t, made, last_read[t]))
            else:
                gone = free_after[t]
                intervals.append((t, made, slot_points[gone][-1]))
                intervals.append((t, slot_points[issue_at[t]][0], last_read[t]))
        walk = _Walk(out, points, slot_points, intervals, reruns, swap_reads)
        self._check_reads(walk, transient)
        return walk

    def _check_reads(self, walk: _Walk, transient: int) -> None:
        """Every read finds its tensor on the device (forward, rerun and backward reads)."""
        g = self.graph
        spans: dict[int, list[tuple[int, int]]] = {}
        for t, a, b in walk.intervals:
            spans.setdefault(t, []).append((a, b))
        for p, (_, op, kind) in enumerate(walk.points):
            wanted = self.bwd_reads[op] if kind == "backward" else self.reads[op]
            for t in wanted:
                found = False
                for a, b in spans.get(t, ()):
                    if a <= p <= b:
                        found = True
                        break
                if not found:
                    walk.violations.append(
                        Violation(
                            "residency",
                            f"{kind} of op {g.ops[op].name!r} reads tensor "
                            f"{g.tensors[t].name!r}, which is not on the device",
                            g.ops[op].name,
                            g.tensors[t].name,
                        )
                    )

    # ------------------------------------------------------------------ memory
    def memory(self, walk: _Walk, limit: int | None) -> tuple[int, list[Violation]]:
        """Bytes on the device at every point (live tensors and the running op's workspace)."""
        g = self.graph
        n_points = len(walk.points)
        comes = [0] * (n_points + 1)  # bytes that arrive at each point, and leave after it
        goes = [0] * (n_points + 1)
        nbytes = self.nbytes
        for t, a, b in walk.intervals:
            comes[a] += nbytes[t]
            goes[b] += nbytes[t]
        fwd_ws = [int(op.forward_workspace_bytes) for op in g.ops]
        bwd_ws = [int(op.backward_workspace_bytes) for op in g.ops]
        # a rerun also holds the gradients waiting for the backward op of its position
        rerun_ws = [int(op.rerun_workspace_bytes) for op in g.ops]
        back_op = [self.n * 2 - 1 - k for k in range(2 * self.n)]
        live = 0
        peak = 0
        over: list[tuple[int, int]] = []  # (point, bytes) where the budget is topped
        for p, (_, op, kind) in enumerate(walk.points):
            live += comes[p]
            if kind == "backward":
                now = live + bwd_ws[op]
            elif kind == "rerun":
                now = live + fwd_ws[op] + rerun_ws[back_op[walk.points[p][0]]]
            else:
                now = live + fwd_ws[op]
            if now > peak:
                peak = now
            if limit is not None and now > limit and len(over) < _MAX_MEMORY_VIOLATIONS:
                over.append((p, now))
            live -= goes[p]
        out: list[Violation] = []
        for p, now in over:
            _, op, kind = walk.points[p]
            resident = [t for t, a, b in walk.intervals if a <= p <= b]
            top = max(resident, key=lambda t: (self.nbytes[t], -t), default=None)
            tname = None if top is None else g.tensors[top].name
            name = g.ops[op].name
            out.append(
                Violation(
                    "memory",
                    f"{kind} of op {name!r}: {now} bytes on the device, "
                    f"{now - limit} over the budget of {limit} (largest resident tensor {tname!r})",
                    name,
                    tname,
                    now - limit,
                )
            )
        return peak, out

    # ------------------------------------------------------------------ time
    def timeline(
        self, walk: _Walk, decisions: list[str | None], plan: Plan, hw: Hardware
    ) -> tuple[float, float, float]:
        """Step time on one compute stream and the D2H / H2D lanes (one transfer at a time each,
        or one link when not full duplex): the ideal time, plus every stall, plus every rerun."""
        g, n = self.graph, self.n
        S = 2 * n
        schedule = plan.schedule
        swapped = [t for t, d in enumerate(decisions) if d == "swap"]
        free_after = {t: int(schedule.d2h_free[g.tensors[t].name]) for t in swapped}
        issue_at = {t: int(schedule.h2d_issue[g.tensors[t].name]) for t in swapped}
        wait_for_free: dict[int, list[int]] = {}
        prefetch_at: dict[int, list[int]] = {}
        offload_after: dict[int, list[int]] = {}
        for t in swapped:
            wait_for_free.setdefault(free_after[t] + 1, []).append(t)
            prefetch_at.setdefault(issue_at[t], []).append(t)
            offload_after.setdefault(self.producer[t], []).append(t)
        first_reader = {t: max(self.readers_bwd[t]) for t in swapped}
        offloaded: dict[int, float] = {}
        landed: dict[int, float] = {}
        d2h_free_at = h2d_free_at = 0.0
        clock = stall = rerun = 0.0
        # collectives that cross the host link, by the position that issues them
        comms: dict[int, list[tuple[int, int]]] = {}
        if hw.collectives_on_link:
            where = {op.name: i for i, op in enumerate(g.ops)}
            for c in g.collectives:
                at = where[c.op] if c.phase == "forward" else S - 1 - where[c.op]
                comms.setdefault(at, []).append((c.d2h_bytes, c.h2d_bytes))
        for k in range(S):
            issued = clock
            for out_bytes, in_bytes in comms.get(k, ()):  # before this position's prefetches
                if out_bytes:
                    lane = d2h_free_at if hw.duplex else max(h2d_free_at, d2h_free_at)
                    d2h_free_at = max(lane, issued) + hw.latency_s + out_bytes / hw.d2h_bytes_per_s
                    if not hw.duplex:
                        h2d_free_at = d2h_free_at
                if in_bytes:
                    lane = h2d_free_at if hw.duplex else max(h2d_free_at, d2h_free_at)
                    h2d_free_at = max(lane, issued) + hw.latency_s + in_bytes / hw.h2d_bytes_per_s
                    if not hw.duplex:
                        d2h_free_at = h2d_free_at
            # prefetches issued here, in the order of their tensors' first backward reader
            for t in sorted(prefetch_at.get(k, ()), key=lambda t: (S - 1 - first_reader[t], t)):
                lane = h2d_free_at if hw.duplex else max(h2d_free_at, d2h_free_at)
                begin = max(lane, issued, offloaded[t])
                landed[t] = begin + hw.latency_s + self.nbytes[t] / hw.h2d_bytes_per_s
                h2d_free_at = landed[t]
                if not hw.duplex:
                    d2h_free_at = landed[t]
            go = issued
            for t in wait_for_free.get(k, ()):  # offloads that must be done before this op
                go = max(go, offloaded[t])
            for t in walk.swap_reads.get(k, ()):  # prefetches this position reads must have landed
                go = max(go, landed[t])
            stall += go - issued
            clock = go
            if k < n:
                clock += g.ops[k].forward_s
                for t in sorted(offload_after.get(k, ())):
                    lane = d2h_free_at if hw.duplex else max(h2d_free_at, d2h_free_at)
                    begin = max(lane, clock)
                    offloaded[t] = begin + hw.latency_s + self.nbytes[t] / hw.d2h_bytes_per_s
                    d2h_free_at = offloaded[t]
                    if not hw.duplex:
                        h2d_free_at = offloaded[t]
            else:
                for q in walk.reruns[k]:
                    clock += g.ops[q].forward_s
                    rerun += g.ops[q].forward_s
                clock += g.ops[S - 1 - k].backward_s
        if comms and max(d2h_free_at, h2d_free_at) > clock:
            stall += max(d2h_free_at, h2d_free_at) - clock  # the optimizer waits for the lanes
        ideal = sum(op.forward_s + op.backward_s for op in g.ops) + g.optimizer_s
        return ideal + stall + rerun, stall, rerun
