"""The checker's walk of one step (formulations/step-model.md), from the graph's raw fields, the
decisions and the complete schedule alone: positions and points, rerun closures, residency of
every read, memory at every point, and the copy lanes' timeline. Each broken rule is a Violation
naming the op or tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import PlanError
from ..core.graph import ActivationGraph
from ..core.plan import Plan
from .schedule_checks import check_hooks, check_rebuilds, check_swaps
from .violation import Violation

_MAX_MEMORY_VIOLATIONS = 20


@dataclass
class Walk:
    """The step under one plan: its points and every tensor's residency over them."""

    violations: list[Violation]
    points: list[tuple[int, int, str]] | None = None  # (position, op, "forward"|"rerun"|"backward")
    position_points: list[list[int]] | None = None
    intervals: list[tuple[int, int, int]] | None = None  # (tensor, first point, last point)
    reruns: list[list[int]] | None = None
    swap_reads: dict[int, set[int]] | None = None  # by position, swapped tensors read there


class StepWalk:
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
        for j, tensor in enumerate(graph.tensors):
            if tensor.alive_until is not None:
                self.last_fwd[j] = max(self.last_fwd[j], self.op_of[tensor.alive_until])
        self._closure: dict[int, tuple[frozenset[int], frozenset[int]]] = {}
        # where a hook runs at the start of a position: the forward's start, after an op whose
        # hook_after is set, the backward's start, the backward of an op whose hook_backward is
        self.hooked_start = (
            [True]
            + [op.hook_after for op in ops[:-1]]
            + [True]
            + [op.hook_backward for op in reversed(ops[:-1])]
        )

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
        ops: set[int] = set()
        frontier: set[int] = set()
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

    def label(self, position: int) -> str:
        if position < self.n:
            return f"forward of op {self.graph.ops[position].name!r}"
        return f"backward of op {self.graph.ops[2 * self.n - 1 - position].name!r}"

    def walk(self, decisions: list[str | None], plan: Plan | None) -> Walk:
        """The step under ``decisions`` and the plan's schedule: its points, what each holds,
        and every violation of the schedule or of a read."""
        out: list[Violation] = []
        free_after, issue_at, rebuild_at = self._schedule(decisions, plan, out)
        if out:
            return Walk(out)
        check_hooks(self, free_after, issue_at, rebuild_at, out)
        rebuilt, first_read, reruns, swap_reads = self._backward(decisions, rebuild_at, out)
        check_rebuilds(self, rebuild_at, rebuilt, out)
        check_swaps(self, free_after, issue_at, first_read, out)
        if out:
            return Walk(out)
        points, position_points = self._points(reruns)
        intervals, transient = self._residency(
            decisions, points, position_points, rebuilt, free_after, issue_at
        )
        walk = Walk(out, points, position_points, intervals, reruns, swap_reads)
        self._check_reads(walk, transient)
        return walk

    def _schedule(
        self, decisions: list[str | None], plan: Plan | None, out: list[Violation]
    ) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
        """The schedule's positions per tensor (d2h_free, h2d_issue, recompute_at), complete and
        naming only tensors with that decision."""
        free_after: dict[int, int] = {}
        issue_at: dict[int, int] = {}
        rebuild_at: dict[int, int] = {}
        if plan is None:
            return free_after, issue_at, rebuild_at
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
        return free_after, issue_at, rebuild_at

    def _backward(
        self, decisions: list[str | None], rebuild_at: dict[int, int], out: list[Violation]
    ) -> tuple[dict[int, int], dict[int, int], list[list[int]], dict[int, set[int]]]:
        """Which ops run again before each backward op, and what each position reads: per
        tensor where it is rebuilt and first read; per position its reruns and swapped reads."""
        g, n = self.graph, self.n
        S = 2 * n
        rebuilt: dict[int, int] = {}
        first_read: dict[int, int] = {}
        reruns: list[list[int]] = [[]] * S  # (each backward position gets its own list below)
        swap_reads: dict[int, set[int]] = {}
        planned: dict[int, list[int]] = {}
        for t, position in rebuild_at.items():
            planned.setdefault(position, []).append(t)
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
        return rebuilt, first_read, reruns, swap_reads

    def _points(
        self, reruns: list[list[int]]
    ) -> tuple[list[tuple[int, int, str]], list[list[int]]]:
        """The step's points: forward ops; before each backward op its reruns in forward order,
        then the op. Returns (points as (position, op, kind), each position's points)."""
        n = self.n
        S = 2 * n
        points: list[tuple[int, int, str]] = []
        position_points: list[list[int]] = []
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
            position_points.append(mine)
        return points, position_points

    def _residency(
        self,
        decisions: list[str | None],
        points: list[tuple[int, int, str]],
        position_points: list[list[int]],
        rebuilt: dict[int, int],
        free_after: dict[int, int],
        issue_at: dict[int, int],
    ) -> tuple[list[tuple[int, int, int]], int]:
        """Each tensor's residency intervals (tensor, first point, last point): from where it
        appears to the last point that reads it. Returns them and how many come first that are
        a rerun's by-products (transient, within one position)."""
        n = self.n
        S = 2 * n
        last_read: dict[int, int] = {}
        comes_back: dict[int, int] = {}  # recomputed tensor -> the rerun point that rebuilds it
        intervals: list[tuple[int, int, int]] = []
        replayed = any(self.also)
        for k in range(n, S):
            made_at: dict[int, int] = {}
            read_last: dict[int, int] = {}
            for p in position_points[k]:
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
                intervals.append((t, made, position_points[gone][-1]))
                intervals.append((t, position_points[issue_at[t]][0], last_read[t]))
        return intervals, transient

    def _check_reads(self, walk: Walk, transient: int) -> None:
        """Every read finds its tensor on the device (forward, rerun and backward reads)."""
        g = self.graph
        points, intervals = walk.points, walk.intervals
        assert points is not None and intervals is not None  # a walked step has both
        spans: dict[int, list[tuple[int, int]]] = {}
        for t, a, b in intervals:
            spans.setdefault(t, []).append((a, b))
        for p, (_, op, kind) in enumerate(points):
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
    def point_memory(self, walk: Walk) -> list[int]:
        """Bytes on the device at every point of a walked step."""
        return self._point_memory(walk, None)[0]

    def rest_bytes(self, walk: Walk) -> int:
        """The bytes of the tensors resident across the forward's end (from a forward point to
        a backward one): what the step holds between its forward and its backward."""
        points, intervals = walk.points, walk.intervals
        assert points is not None and intervals is not None  # a walked step has both
        first_backward = next(p for p, (k, _, _) in enumerate(points) if k >= self.n)
        return sum(self.nbytes[t] for t, a, b in intervals if a < first_backward <= b)

    def memory(self, walk: Walk, limit: int | None) -> tuple[int, list[Violation]]:
        """Bytes on the device at every point (live tensors and the running op's workspace):
        the peak, and a violation for each point over ``limit``."""
        now_at, over = self._point_memory(walk, limit)
        return max(now_at, default=0), self._memory_violations(walk, over, limit)

    def _point_memory(
        self, walk: Walk, limit: int | None
    ) -> tuple[list[int], list[tuple[int, int]]]:
        g = self.graph
        points, intervals = walk.points, walk.intervals
        assert points is not None and intervals is not None  # a walked step has both
        n_points = len(points)
        comes = [0] * (n_points + 1)  # bytes that arrive at each point, and leave after it
        goes = [0] * (n_points + 1)
        nbytes = self.nbytes
        for t, a, b in intervals:
            comes[a] += nbytes[t]
            goes[b] += nbytes[t]
        fwd_ws = [int(op.forward_workspace_bytes) for op in g.ops]
        bwd_ws = [int(op.backward_workspace_bytes) for op in g.ops]
        # a rerun also holds the gradients waiting for the backward op of its position
        rerun_ws = [int(op.rerun_workspace_bytes) for op in g.ops]
        back_op = [self.n * 2 - 1 - k for k in range(2 * self.n)]
        live = 0
        now_at: list[int] = []
        over: list[tuple[int, int]] = []  # (point, bytes) where the budget is topped
        for p, (_, op, kind) in enumerate(points):
            live += comes[p]
            if kind == "backward":
                now = live + bwd_ws[op]
            elif kind == "rerun":
                now = live + fwd_ws[op] + rerun_ws[back_op[points[p][0]]]
            else:
                now = live + fwd_ws[op]
            now_at.append(now)
            if limit is not None and now > limit and len(over) < _MAX_MEMORY_VIOLATIONS:
                over.append((p, now))
            live -= goes[p]
        return now_at, over

    def _memory_violations(
        self, walk: Walk, over: list[tuple[int, int]], limit: int | None
    ) -> list[Violation]:
        g = self.graph
        points, intervals = walk.points, walk.intervals
        assert points is not None and intervals is not None  # a walked step has both
        out: list[Violation] = []
        for p, now in over:
            assert limit is not None  # only a limit is topped
            _, op, kind = points[p]
            resident = [t for t, a, b in intervals if a <= p <= b]
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
        return out
