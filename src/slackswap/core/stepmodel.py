"""The step model of formulations/step-model.md, turned into positions, lifetimes and reruns.

``expand`` takes a graph, a decision per saved tensor and a (possibly partial) schedule, and
returns every tensor's device-resident intervals over the step's *points* (forward ops, the
reruns before each backward op, backward ops), the reruns, and the complete schedule. The
simulator adds time to it; the validator checks it against the budget with code of its own.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import PlanError
from .graph import ActivationGraph
from .hardware import Hardware
from .plan import DECISIONS, KEEP, RECOMPUTE, SWAP, Schedule
from .schedule_rules import (
    HookPositions,
    check_hook_positions,
    check_swap_schedule,
    enough_to_cover,
    position_label,
)

# per position, the ops rerun there (or the tensors needed there), in forward order
Reruns = Sequence[Sequence[int]]


@dataclass(frozen=True)
class Expansion:
    """Everything about a plan that does not depend on copy timing.

    Points are the step's memory checkpoints in order. Interval arrays (``iv_*``) say which tensor
    is resident from which point to which point (inclusive); ``point_workspace`` adds the running
    op's workspace.
    """

    codes: np.ndarray
    point_position: np.ndarray
    point_op: np.ndarray
    point_kind: np.ndarray  # 0 forward, 1 rerun, 2 backward
    point_workspace: np.ndarray
    position_first_point: np.ndarray
    iv_tensor: np.ndarray
    iv_start: np.ndarray
    iv_end: np.ndarray
    iv_bytes: np.ndarray
    iv_transient: np.ndarray  # True for copies made by reruns and freed within the position
    reruns: tuple[tuple[int, ...], ...]  # per position, ops rerun before that backward op
    first_need: (
        np.ndarray
    )  # per tensor: first backward position it must be on the device (-1 if none)
    needs_at: tuple[tuple[int, ...], ...]  # per position, swapped tensors that must have arrived
    d2h_free: np.ndarray  # per tensor (swap), position after which it leaves the device
    h2d_issue: np.ndarray  # per tensor (swap), position at whose start the prefetch is issued
    materialize_at: np.ndarray  # per tensor (recompute), position where it is rebuilt

    @property
    def n_points(self) -> int:
        return len(self.point_position)

    def memory(self, with_workspace: bool = True) -> np.ndarray:
        """Device bytes at every point (rules 1-3 of the step model)."""
        return interval_memory(self, with_workspace)

    def schedule(self, graph: ActivationGraph) -> Schedule:
        names = [t.name for t in graph.tensors]
        swap = np.flatnonzero(self.codes == SWAP)
        rec = np.flatnonzero(self.codes == RECOMPUTE)
        return Schedule(
            d2h_free={names[t]: int(self.d2h_free[t]) for t in swap},
            h2d_issue={names[t]: int(self.h2d_issue[t]) for t in swap},
            recompute_at={names[t]: int(self.materialize_at[t]) for t in rec},
        )


def interval_memory(exp: Expansion, with_workspace: bool = True) -> np.ndarray:
    bytes_of = exp.iv_bytes
    diff = np.zeros(exp.n_points + 1, dtype=np.int64)
    np.add.at(diff, exp.iv_start, bytes_of)
    np.add.at(diff, exp.iv_end + 1, -bytes_of)
    mem = np.cumsum(diff[:-1])
    if with_workspace:
        mem = mem + exp.point_workspace
    return mem


def _schedule_arrays(
    graph: ActivationGraph, codes: np.ndarray, schedule: Schedule | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    T = len(graph.tensors)
    d2h = np.full(T, -1, dtype=np.int64)
    h2d = np.full(T, -1, dtype=np.int64)
    rec = np.full(T, -1, dtype=np.int64)
    if schedule is None:
        return d2h, h2d, rec
    index = graph.tensor_index
    for field, arr, code in (
        ("d2h_free", d2h, SWAP),
        ("h2d_issue", h2d, SWAP),
        ("recompute_at", rec, RECOMPUTE),
    ):
        for name, pos in getattr(schedule, field).items():
            if name not in index:
                raise PlanError(f"schedule: {field} names unknown tensor {name!r}")
            t = index[name]
            if codes[t] != code:
                raise PlanError(
                    f"schedule: {field} names tensor {name!r}, whose decision is "
                    f"{DECISIONS[codes[t]] if codes[t] >= 0 else 'none (not saved)'}"
                )
            if pos >= graph.n_positions:
                raise PlanError(
                    f"schedule: {field}[{name!r}] = {pos} is past the step's last position "
                    f"{graph.n_positions - 1}"
                )
            arr[t] = pos
    return d2h, h2d, rec


def trace_reruns(
    graph: ActivationGraph, codes: np.ndarray, recompute_at: np.ndarray
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], np.ndarray, np.ndarray]:
    """Walk the backward pass: which ops rerun where, and who needs what (rules for recompute)."""
    n = graph.n_ops
    S = graph.n_positions
    T = len(graph.tensors)
    materialized = np.full(T, -1, dtype=np.int64)
    first_need = np.full(T, -1, dtype=np.int64)
    reruns: list[tuple[int, ...]] = [()] * S
    needs_at: list[tuple[int, ...]] = [()] * S
    scheduled: dict[int, list[int]] = {}
    for t in np.flatnonzero(recompute_at >= 0).tolist():
        if recompute_at[t] < n:
            raise PlanError(
                f"schedule: recompute_at[{graph.tensors[t].name!r}] = {recompute_at[t]} "
                "is in the forward pass; rebuilds run before backward ops"
            )
        scheduled.setdefault(int(recompute_at[t]), []).append(t)
    # a tensor with a latest rebuild position (Tensor.rebuilt_before) and no position of its own
    # is rebuilt there, or earlier where a rebuild that reads it runs first
    forced = graph.rebuild_position
    for t in np.flatnonzero((forced >= 0) & (recompute_at < 0) & (codes == RECOMPUTE)).tolist():
        scheduled.setdefault(int(forced[t]), []).append(t)
    saved_by_op = graph.saved_by_op
    if not scheduled and not (codes == RECOMPUTE).any():
        # nothing reruns (keep and swap only: the budget's keep-all and all-offloaded plans):
        # each saved tensor is first needed where its first backward reader runs
        saved = graph.saved
        first_need[saved] = 2 * n - 1 - graph.first_backward_use[saved]
        swapped = (codes == SWAP).tolist()
        for k in range(n, S):
            here = [x for x in saved_by_op[S - 1 - k] if swapped[x]]
            if here:
                needs_at[k] = tuple(sorted(here))
        return reruns, needs_at, first_need, materialized
    rerun_ops = graph.rerun_ops
    frontier = graph.rerun_frontier
    outputs = graph.op_outputs
    # Python lists in the walk: it visits every backward position, and numpy's per-element
    # access costs more than the work itself
    code_of = codes.tolist()
    made = materialized.tolist()
    need = first_need.tolist()
    for k in range(n, S):
        stack = list(scheduled.get(k, ())) + list(saved_by_op[S - 1 - k])
        if not stack:
            continue
        ops: set[int] = set()
        swaps: set[int] = set()
        while stack:
            while stack:
                x = stack.pop()
                if need[x] < 0:
                    need[x] = k
                c = code_of[x]
                if c == SWAP:
                    swaps.add(x)
                elif c == RECOMPUTE and made[x] < 0:
                    made[x] = k
                    ops.update(rerun_ops[x])
                    stack.extend(frontier[x])
            # outputs of rerun ops that are recomputed tensors come for free: materialize them now
            for q in ops:
                for t in outputs[q]:
                    if code_of[t] == RECOMPUTE and made[t] < 0:
                        stack.append(t)
        if ops:
            reruns[k] = tuple(sorted(ops))
        if swaps:
            needs_at[k] = tuple(sorted(swaps))
    materialized = np.array(made, dtype=np.int64)
    first_need = np.array(need, dtype=np.int64)
    for t in np.flatnonzero(recompute_at >= 0).tolist():
        if materialized[t] != recompute_at[t]:
            raise PlanError(
                f"schedule: recompute_at[{graph.tensors[t].name!r}] = {recompute_at[t]} is after its "
                f"first use at position {materialized[t]} ({position_label(graph, int(materialized[t]))})"
            )
    return reruns, needs_at, first_need, materialized


def first_backward_need(
    graph: ActivationGraph, codes: np.ndarray, schedule: Schedule
) -> np.ndarray:
    """Per tensor, the first backward position at which it must be on the device (-1 if never):
    its first reader, or the first rebuild that reads it, under the schedule's rebuild positions."""
    _, _, rec = _schedule_arrays(graph, codes, schedule)
    return trace_reruns(graph, codes, rec)[2]


def nominal_position_times(graph: ActivationGraph, reruns: Reruns) -> tuple[np.ndarray, np.ndarray]:
    """Start and end time of every position if nothing stalls (reruns included)."""
    n = graph.n_ops
    dur = np.empty(graph.n_positions)
    dur[:n] = graph.forward_s
    dur[n:] = graph.backward_s[::-1]
    fwd = graph.forward_s
    for k in range(n, graph.n_positions):
        if reruns[k]:
            dur[k] += sum(fwd[q] for q in reruns[k])
    end = np.cumsum(dur)
    return end - dur, end


def default_swap_schedule(
    graph: ActivationGraph,
    hw: Hardware,
    codes: np.ndarray,
    first_need: np.ndarray,
    reruns: Reruns,
    d2h: np.ndarray,
    h2d: np.ndarray,
) -> None:
    """Fill missing swap positions: free a tensor once its offload is done (estimated on the
    no-stall timeline, lane in production order); issue its prefetch as late as still arrives in
    time (lane filled backwards from the uses)."""
    start, end = nominal_position_times(graph, reruns)
    swapped = np.flatnonzero(codes == SWAP)
    if swapped.size == 0:
        return
    nbytes = graph.tensor_bytes.astype(float)
    last_fwd = graph.last_forward_use
    producer = graph.producer
    # collectives on the link occupy the lanes from their positions (step-model.md): they are
    # jobs of the same lanes here, with fixed issue times, never given a position themselves
    comms = (
        [(graph.collective_position(c), c) for c in graph.collectives]
        if hw.collectives_on_link
        else []
    )
    n = graph.n_ops
    # D2H lane, FIFO in production order: done_i = max_{j<=i}(issue_j + sum_{k=j..i} p_k)
    order = swapped[np.lexsort((swapped, producer[swapped]))]
    p = hw.latency_s + nbytes[order] / hw.d2h_bytes_per_s
    issue = end[producer[order]]
    fwd_comms = [(k, c) for k, c in comms if c.d2h_bytes and k < n]
    if fwd_comms:
        keys = np.concatenate([producer[order] + 0.5, [k for k, _ in fwd_comms]])
        p_all = np.concatenate([p, [hw.d2h_time(c.d2h_bytes) for _, c in fwd_comms]])
        issue_all = np.concatenate([issue, [start[k] for k, _ in fwd_comms]])
        merged = np.argsort(keys, kind="stable")
        csum = np.cumsum(p_all[merged])
        done_all = np.empty_like(csum)
        done_all[merged] = csum + np.maximum.accumulate(issue_all[merged] - (csum - p_all[merged]))
        done = done_all[: len(order)]
    else:
        csum = np.cumsum(p)
        done = csum + np.maximum.accumulate(issue - (csum - p))
    position = np.searchsorted(end, done - 1e-15)
    free = np.minimum(np.maximum(position, last_fwd[order]), first_need[order] - 1)
    # where a hook runs after (step-model.md, "Hook positions"): the first such position, no
    # later than the one before the first use (which is one: the use is a hook position)
    hooks = HookPositions(graph)
    free = np.minimum(hooks.free_later(free), hooks.free_earlier(first_need[order] - 1))
    unset = d2h[order] < 0
    d2h[order[unset]] = free[unset]
    # H2D lane filled backwards from the uses: begin_i = min_{j>=i}(need_j - sum_{k=i..j} p_k)
    order = swapped[np.lexsort((-swapped, -first_need[swapped]))][::-1]  # by first use, then index
    p = hw.latency_s + nbytes[order] / hw.h2d_bytes_per_s
    need = start[first_need[order]]
    bwd_comms = [(k, c) for k, c in comms if c.h2d_bytes and k >= n]
    if bwd_comms:
        # a collective must be done p_c after its issue: prefetches needed later that would
        # share its time go before it (issued earlier)
        p_c = np.array([hw.h2d_time(c.h2d_bytes) for _, c in bwd_comms])
        need_c = np.array([start[k] for k, _ in bwd_comms]) + p_c
        keys = np.concatenate([need, need_c])
        merged = np.argsort(keys, kind="stable")
        p_m = np.concatenate([p, p_c])[merged]
        need_m = keys[merged]
        suffix = np.cumsum(p_m[::-1])[::-1]
        after = np.append(suffix[1:], 0.0)
        begin_m = -suffix + np.minimum.accumulate((need_m + after)[::-1])[::-1]
        begin_all = np.empty_like(begin_m)
        begin_all[merged] = begin_m
        begin = begin_all[: len(order)]
    else:
        suffix = np.cumsum(p[::-1])[::-1]  # sum_{k>=i} p_k
        after = np.append(suffix[1:], 0.0)  # sum_{k>j} p_k
        begin = -suffix + np.minimum.accumulate((need + after)[::-1])[::-1]
    g = np.searchsorted(start, begin + 1e-15, side="right") - 1
    g = np.minimum(np.maximum(g, d2h[order] + 1), first_need[order])
    # at a hook position: the last at or before it, or, if that is not after the tensor has
    # left, the first after it (the first use at the latest)
    g_hook = hooks.start_earlier(g)
    g = np.where(g_hook > d2h[order], g_hook, hooks.start_later(d2h[order] + 1))
    unset = h2d[order] < 0
    h2d[order[unset]] = g[unset]


def _monotone_issue(
    graph: ActivationGraph,
    codes: np.ndarray,
    first_need: np.ndarray,
    h2d: np.ndarray,
    movable: np.ndarray,
) -> None:
    """Prefetches are issued in the order of their tensors' first backward reader: a movable
    issue position is never before that of a tensor read earlier (it is moved later, never past
    the tensor's first use)."""
    swapped = np.flatnonzero(codes == SWAP)
    key = graph.first_backward_use
    latest = -1
    for t in sorted(swapped, key=lambda t: (-key[t], t)):
        if movable[t] and h2d[t] < latest:
            h2d[t] = min(latest, int(first_need[t]))
        latest = max(latest, int(h2d[t]))


def expand(
    graph: ActivationGraph,
    codes: np.ndarray,
    schedule: Schedule | None,
    hw: Hardware,
    budget_bytes: int | None = None,
) -> Expansion:
    """Lifetimes of every tensor under a plan. Missing schedule entries take the defaults of the
    step model; with ``budget_bytes`` the default swap positions also yield to the budget
    (free earlier, prefetch later, at the cost of waiting on copies)."""
    return expand_positions(
        graph, codes, *_schedule_arrays(graph, codes, schedule), hw, budget_bytes
    )


def expand_positions(
    graph: ActivationGraph,
    codes: np.ndarray,
    d2h: np.ndarray,
    h2d: np.ndarray,
    rec: np.ndarray,
    hw: Hardware,
    budget_bytes: int | None = None,
) -> Expansion:
    """``expand`` with the schedule as per-tensor position arrays (-1: the default), as
    ``_schedule_arrays`` makes them from a Schedule (no names to look up on large graphs)."""
    d2h, h2d, rec = d2h.copy(), h2d.copy(), rec.copy()
    given_d2h, given_h2d = d2h >= 0, h2d >= 0
    reruns, needs_at, first_need, materialized = trace_reruns(graph, codes, rec)
    default_swap_schedule(graph, hw, codes, first_need, reruns, d2h, h2d)
    _monotone_issue(graph, codes, first_need, h2d, ~given_h2d)
    check_swap_schedule(graph, codes, first_need, d2h, h2d)
    check_hook_positions(graph, codes, d2h, h2d, materialized)
    exp = _intervals(graph, codes, reruns, needs_at, first_need, d2h, h2d, materialized)
    if budget_bytes is not None:
        exp = _yield_to_budget(graph, exp, budget_bytes, given_d2h, given_h2d)
    return exp


def _lives(
    graph: ActivationGraph,
    codes: np.ndarray,
    last_use: np.ndarray,
    mat_point: np.ndarray,
    d2h: np.ndarray,
    h2d: np.ndarray,
    position_first: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every tensor's lives over the points, in tensor order: one (unsaved, keep) or two
    (recompute: made, then rebuilt; swap: until it has left, then from its prefetch), as
    (tensor, first point, last point) columns."""
    n, T = graph.n_ops, len(graph.tensors)
    producer = graph.producer.astype(np.int64)
    last_fwd = graph.last_forward_use.astype(np.int64)
    is_rec, is_swap, is_keep = codes == RECOMPUTE, codes == SWAP, codes == KEEP
    two = is_rec | is_swap
    count = 1 + two.astype(np.int64)
    first = np.cumsum(count) - count
    lives_t = np.repeat(np.arange(T, dtype=np.int64), count)
    lives_s = np.empty(len(lives_t), dtype=np.int64)
    lives_e = np.empty(len(lives_t), dtype=np.int64)
    lives_s[first] = producer
    end_first = last_fwd.copy()
    end_first[is_keep] = last_use[is_keep]
    sw = np.flatnonzero(is_swap)
    free_position = d2h[sw].astype(np.int64)
    end_first[sw] = free_position  # freed after a forward position: that op's point
    late = free_position >= n  # after a backward position: its last point (reruns come first)
    end_first[sw[late]] = position_first[free_position[late] + 1] - 1
    lives_e[first] = end_first
    rec = np.flatnonzero(is_rec)
    lives_s[first[rec] + 1] = mat_point[rec]
    lives_e[first[rec] + 1] = last_use[rec]
    lives_s[first[sw] + 1] = position_first[h2d[sw]]
    lives_e[first[sw] + 1] = last_use[sw]
    return lives_t, lives_s, lives_e


def _intervals(
    graph: ActivationGraph,
    codes: np.ndarray,
    reruns: Reruns,
    needs_at: Reruns,
    first_need: np.ndarray,
    d2h: np.ndarray,
    h2d: np.ndarray,
    materialized: np.ndarray,
) -> Expansion:
    """The points (forward ops, then per backward position its reruns and its backward op) and
    the lives of tensors over them. Numpy over every position and tensor; Python only over the
    positions that rerun something (a 50,000-op step expands in a fraction of a second)."""
    n = graph.n_ops
    S = graph.n_positions
    T = len(graph.tensors)
    codes = np.asarray(codes)
    n_reruns = np.array([len(reruns[k]) for k in range(n, S)], dtype=np.int64)
    per_position = n_reruns + 1  # reruns, then the backward op
    position_first = np.zeros(S, dtype=np.int64)
    position_first[:n] = np.arange(n)
    position_first[n:] = n + np.concatenate([[0], np.cumsum(per_position)[:-1]])
    main = position_first[n:] + n_reruns  # the backward op's point at each backward position
    P = n + int(per_position.sum())
    point_position = np.empty(P, dtype=np.int64)
    point_op = np.empty(P, dtype=np.int64)
    point_kind = np.empty(P, dtype=np.int8)
    point_ws = np.empty(P, dtype=np.int64)
    point_position[:n] = np.arange(n)
    point_op[:n] = np.arange(n)
    point_kind[:n] = 0
    point_ws[:n] = graph.forward_ws
    back = np.arange(n, S)
    ops_back = S - 1 - back
    point_position[main] = back
    point_op[main] = ops_back
    point_kind[main] = 2
    point_ws[main] = graph.backward_ws[ops_back]
    # a saved tensor is last read at its last backward reader's point (or a later rerun's)
    last_use = np.full(T, -1, dtype=np.int64)
    saved = graph.is_saved
    saved_idx = np.flatnonzero(saved)
    last_use[saved_idx] = main[(S - 1 - graph.last_backward_use[saved_idx]) - n]
    mat_point = np.full(T, -1, dtype=np.int64)
    iv_t: list[int] = []
    iv_s: list[int] = []
    iv_e: list[int] = []
    op_inputs = graph.op_inputs
    outputs = graph.op_outputs
    fwd_ws = graph.forward_ws
    rerun_ws = graph.rerun_ws
    replays = graph.op_rerun_with
    last_fwd_use = graph.last_forward_use
    for k in (np.flatnonzero(n_reruns) + n).tolist():
        transient_start: dict[int, int] = {}
        transient_end: dict[int, int] = {}
        p = int(position_first[k])
        first_p = p
        for q in reruns[k]:
            point_position[p] = k
            point_op[p] = q
            point_kind[p] = 1
            # the rerun op's workspace, and the gradients waiting for the backward op here
            point_ws[p] = fwd_ws[q] + rerun_ws[S - 1 - k]
            for t in op_inputs[q]:
                if saved[t]:
                    if p > last_use[t]:
                        last_use[t] = p
                else:
                    transient_end[t] = p
            for t in outputs[q]:
                if codes[t] == RECOMPUTE and materialized[t] == k:
                    mat_point[t] = p
                else:
                    transient_start[t] = p
                    transient_end[t] = p
            p += 1
        for t, start in transient_start.items():
            q0 = int(graph.producer[t])
            if replays[q0] and not saved[t]:
                # a replayed region (Op.rerun_with) holds its unsaved outputs as its forward did:
                # until the last op rerun here that ran while the forward still held them
                last = bisect_right(reruns[k], int(last_fwd_use[t])) - 1
                transient_end[t] = max(transient_end[t], first_p + last)
            iv_t.append(t)
            iv_s.append(start)
            iv_e.append(transient_end[t])
    n_transient = len(iv_t)
    lives_t, lives_s, lives_e = _lives(graph, codes, last_use, mat_point, d2h, h2d, position_first)
    iv_tensor = np.concatenate([np.array(iv_t, dtype=np.int64), lives_t])
    exp = Expansion(
        codes=codes,
        point_position=point_position,
        point_op=point_op,
        point_kind=point_kind,
        point_workspace=point_ws,
        position_first_point=position_first,
        iv_tensor=iv_tensor,
        iv_start=np.concatenate([np.array(iv_s, dtype=np.int64), lives_s]),
        iv_end=np.concatenate([np.array(iv_e, dtype=np.int64), lives_e]),
        iv_bytes=graph.tensor_bytes[iv_tensor],
        iv_transient=np.arange(len(iv_tensor)) < n_transient,
        reruns=tuple(tuple(r) for r in reruns),
        first_need=first_need,
        needs_at=tuple(tuple(x) for x in needs_at),
        d2h_free=d2h,
        h2d_issue=h2d,
        materialize_at=np.where(codes == RECOMPUTE, materialized, -1),
    )
    return exp


def _yield_to_budget(
    graph: ActivationGraph,
    exp: Expansion,
    budget: int,
    given_d2h: np.ndarray,
    given_h2d: np.ndarray,
) -> Expansion:
    """Free offloaded tensors earlier and prefetch later where memory tops the budget."""
    d2h = exp.d2h_free.copy()
    h2d = exp.h2d_issue.copy()
    last_fwd = graph.last_forward_use
    swapped = np.flatnonzero(exp.codes == SWAP)
    movable_free = swapped[~given_d2h[swapped]]
    movable_issue = swapped[~given_h2d[swapped]]
    hooks = HookPositions(graph)
    for _ in range(graph.n_positions + swapped.size + 1):
        mem = exp.memory()
        over = np.flatnonzero(mem > budget)
        if over.size == 0:
            return exp
        positions = np.unique(exp.point_position[over])
        excess = np.zeros(graph.n_positions + 1, dtype=np.int64)
        np.maximum.at(excess, exp.point_position[over], mem[over] - budget)
        changed = False
        # free earlier: the first over-budget position after a tensor's last forward reader,
        # if it is still resident there, is where it must already be gone
        lf = last_fwd[movable_free]
        i = np.searchsorted(positions, lf, side="right")
        has = i < positions.size
        first_over = np.where(has, positions[np.minimum(i, positions.size - 1)], -1)
        # (a hook must run after the new position: the last such before the first over)
        target = hooks.free_earlier(first_over - 1)
        late = has & (first_over <= d2h[movable_free]) & (target >= lf)
        # only as many as the excess there needs, those whose offloads end first (the lane
        # carries them in production order: the earliest produced wait least, or not at all)
        rank = graph.producer[movable_free]
        late &= enough_to_cover(
            first_over, late, rank, movable_free, graph, excess, d2h[movable_free]
        )
        if late.any():
            d2h[movable_free[late]] = target[late]
            changed = True
        # prefetch later: the last over-budget position before a tensor's first use, if its
        # prefetch is issued by then, is where it must not yet be resident
        need = exp.first_need[movable_issue]
        j = np.searchsorted(positions, need, side="left") - 1
        has = j >= 0
        last_over = np.where(has, positions[np.maximum(j, 0)], -1)
        early = has & (last_over >= h2d[movable_issue])
        # only as many as the excess there needs, those read last first (the most time left)
        early &= enough_to_cover(
            last_over, early, -need, movable_issue, graph, excess, h2d[movable_issue]
        )
        if early.any():
            h2d[movable_issue[early]] = np.minimum(
                hooks.start_later(last_over[early] + 1), need[early]
            )
            changed = True
        if not changed:
            return exp
        _monotone_issue(graph, exp.codes, exp.first_need, h2d, ~given_h2d)
        clash = swapped[d2h[swapped] >= h2d[swapped]]
        d2h[clash] = h2d[clash] - 1
        exp = _intervals(
            graph,
            exp.codes,
            list(exp.reruns),
            exp.needs_at,
            exp.first_need,
            d2h,
            h2d,
            exp.materialize_at,
        )
    return exp
