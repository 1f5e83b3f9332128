"""Discrete-event simulation of one step: the compute stream and the D2H / H2D copy lanes.

Memory follows the step model's points (stepmodel.expand); time follows the plan's own schedule:
an op waits for the offloads that must leave before it and the prefetches it reads. A plan is
simulated as it is: an open plan (no complete schedule or no hardware) is refused, never planned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.codes import decision_codes
from ..core.errors import PlanError
from ..core.graph import ActivationGraph, Collective
from ..core.hardware import Hardware, hardware
from ..core.plan import RECOMPUTE, SWAP, Plan
from ..core.stepmodel import Expansion, expand, interval_memory


@dataclass(frozen=True)
class SimResult:
    """What one simulated step costs. Timelines are numpy arrays for plotting."""

    step_time_s: float
    ideal_step_time_s: float
    retention: float
    peak_bytes: int
    stall_s: float
    budget_bytes: int
    fits: bool
    violations: tuple[str, ...]
    recompute_s: float
    swapped_bytes: int
    recomputed_bytes: int
    memory_time_s: np.ndarray = field(repr=False)
    memory_bytes: np.ndarray = field(repr=False)
    compute_intervals: np.ndarray = field(
        repr=False
    )  # (start, end, op, kind) kind 0 fwd 1 rerun 2 bwd
    d2h_intervals: np.ndarray = field(repr=False)  # (start, end, tensor)
    h2d_intervals: np.ndarray = field(repr=False)
    expansion: Expansion = field(repr=False)
    # the tensors alone, without workspaces (a profiled graph's backward workspace is its
    # activation gradients): what the executor tracks as its activation peak
    tensor_peak_bytes: int
    # the hardware it was simulated on (solve() reuses a planner's simulation only on its own)
    hardware: Hardware | None = field(default=None, repr=False, compare=False)
    # when the last transfer of a collective issued in the forward ends (0 with none on the
    # link): a pipeline stage's forward action ends no earlier (formulations/pipeline.md)
    forward_collectives_end_s: float = 0.0

    def summary(self) -> str:
        return (
            f"step {self.step_time_s * 1e3:.2f} ms (ideal {self.ideal_step_time_s * 1e3:.2f} ms), "
            f"retention {100 * self.retention:.2f}%, peak {self.peak_bytes / 2**30:.3f} GiB "
            f"of {self.budget_bytes / 2**30:.3f} GiB, stall {self.stall_s * 1e3:.2f} ms, "
            f"recompute {self.recompute_s * 1e3:.2f} ms"
        )


def simulate(graph: ActivationGraph, plan: Plan, hw: Hardware | str | None = None) -> SimResult:
    """Simulate one step under ``plan`` on its own schedule, on the plan's hardware (or on ``hw``:
    the same schedule on other copy lanes, a what-if).

    Args:
        graph: the step the plan is for.
        plan: a closed plan.
        hw: the hardware to simulate on (default: the plan's own).

    Returns:
        The SimResult: step time, stalls, reruns, memory at every point, each copy's interval.

    Raises:
        PlanError: the plan is for another graph, or names no hardware and none is given.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"simulate: plan must be a slackswap.Plan, got {type(plan).__name__}")
    plan.check_graph(graph)
    plan.require_complete("simulate")
    on = hardware(hw) if hw is not None else plan.hardware
    assert on is not None  # a complete plan names its hardware
    exp = expand(graph, decision_codes(graph, plan), plan.schedule, on)
    return run_timeline(graph, exp, on, plan.budget_bytes)


def simulate_decisions(
    graph: ActivationGraph, codes: np.ndarray, hw: Hardware, budget: int
) -> SimResult:
    """Decision codes with the default schedule (yielding to ``budget``), simulated: how planners
    compare candidate decisions. The schedule used is ``result.expansion``'s."""
    return run_timeline(graph, expand(graph, codes, None, hw, budget_bytes=budget), hw, budget)


def lane_start(lane_free_at: float, earliest: float) -> float:
    """A copy starts when its lane is free and it may start: one transfer at a time per lane."""
    return max(lane_free_at, earliest)


def host_violations(hw: Hardware, host: int) -> tuple[str, ...]:
    """The swapped tensors' bytes (the executor's pool holds each for the step) against the
    hardware's ``host_memory_bytes`` (0: no limit)."""
    if not hw.host_memory_bytes or host <= hw.host_memory_bytes:
        return ()
    return (
        f"host memory: the swapped tensors need {host} bytes of host memory, "
        f"hardware {hw.name!r} has {hw.host_memory_bytes} (host_memory_bytes)",
    )


def run_timeline(graph: ActivationGraph, exp: Expansion, hw: Hardware, budget: int) -> SimResult:
    """The step of an expansion (decisions with their complete schedule) on one compute stream
    and the copy lanes (formulations/step-model.md): when each point runs, every stall and rerun,
    each copy's interval, and memory at every point against ``budget``."""
    _refuse_swaps_without_host(graph, exp, hw)
    n, S = graph.n_ops, graph.n_positions
    codes = exp.codes
    fwd = graph.forward_s
    bwd = graph.backward_s
    nbytes = graph.tensor_bytes
    T = len(graph.tensors)
    d2h_done = np.zeros(T)
    arrival = np.zeros(T)
    swapped = np.flatnonzero(codes == SWAP)
    free_after, issue_at, outputs_swapped = _swap_events(graph, exp, swapped)
    h2d_key = np.array(
        [graph.bwd_position(int(u)) if u >= 0 else 0 for u in graph.first_backward_use]
    )
    point_time = np.zeros(exp.n_points)
    compute: list[tuple[float, float, int, int]] = []
    d2h_iv: list[tuple[float, float, int]] = []
    h2d_iv: list[tuple[float, float, int]] = []
    d2h_lane = 0.0
    h2d_lane = 0.0
    now = 0.0
    stall = 0.0
    recompute_s = 0.0
    collectives_at = _collectives_by_position(graph, hw)
    forward_collectives_end = 0.0
    for k in range(S):
        arrive = now
        # collectives issued here enter the lanes first (step-model.md, "Collectives")
        for c in collectives_at.get(k, ()):
            d2h_lane, h2d_lane = _collective_on_lanes(c, hw, arrive, d2h_lane, h2d_lane)
            if k < n:  # (a pipeline stage's forward action ends after them)
                ends = (d2h_lane if c.d2h_bytes else 0.0, h2d_lane if c.h2d_bytes else 0.0)
                forward_collectives_end = max(forward_collectives_end, *ends)
        for t in sorted(issue_at.get(k, ()), key=lambda t: (h2d_key[t], t)):
            lane = h2d_lane if hw.duplex else max(h2d_lane, d2h_lane)
            start = lane_start(lane, max(arrive, d2h_done[t]))
            end = start + hw.h2d_time(nbytes[t])
            h2d_iv.append((start, end, t))
            arrival[t] = end
            h2d_lane = end
            if not hw.duplex:
                d2h_lane = end
        ready = arrive
        for t in free_after.get(k - 1, ()):
            ready = max(ready, d2h_done[t])
        for t in exp.needs_at[k]:
            ready = max(ready, arrival[t])
        stall += ready - arrive
        now = ready
        first = exp.position_first_point[k]
        if k < n:
            point_time[first] = now
            compute.append((now, now + fwd[k], k, 0))
            now += fwd[k]
            for t in outputs_swapped.get(k, ()):
                lane = d2h_lane if hw.duplex else max(h2d_lane, d2h_lane)
                start = lane_start(lane, now)
                end = start + hw.d2h_time(nbytes[t])
                d2h_iv.append((start, end, t))
                d2h_done[t] = end
                d2h_lane = end
                if not hw.duplex:
                    h2d_lane = end
        else:
            p = first
            for q in exp.reruns[k]:
                point_time[p] = now
                compute.append((now, now + fwd[q], q, 1))
                now += fwd[q]
                recompute_s += fwd[q]
                p += 1
            j = S - 1 - k
            point_time[p] = now
            compute.append((now, now + bwd[j], j, 2))
            now += bwd[j]
    if collectives_at:
        # the optimizer waits for the last collective (the gradients' reduce-scatter)
        lanes_done = max(d2h_lane, h2d_lane)
        if lanes_done > now:
            stall += lanes_done - now
    # the same sum as the ideal time plus the extra time, so a plan with none has retention 1.0
    step = graph.ideal_step_time_s + stall + recompute_s
    mem = exp.memory()
    peak = int(mem.max()) if mem.size else 0
    tensors_only = interval_memory(exp, with_workspace=False)
    host = int(nbytes[swapped].sum())
    violations = tuple(memory_violations(graph, exp, mem, budget)) + host_violations(hw, host)
    ideal = graph.ideal_step_time_s
    recomputed = np.flatnonzero(codes == RECOMPUTE)
    return SimResult(
        step_time_s=float(step),
        ideal_step_time_s=ideal,
        retention=float(ideal / step) if step > 0 else 1.0,
        peak_bytes=peak,
        stall_s=float(stall),
        budget_bytes=int(budget),
        fits=not violations,
        violations=violations,
        recompute_s=float(recompute_s),
        swapped_bytes=host,
        recomputed_bytes=int(nbytes[recomputed].sum()),
        memory_time_s=point_time,
        memory_bytes=mem,
        compute_intervals=np.array(compute, dtype=float).reshape(-1, 4),
        d2h_intervals=np.array(d2h_iv, dtype=float).reshape(-1, 3),
        h2d_intervals=np.array(h2d_iv, dtype=float).reshape(-1, 3),
        expansion=exp,
        tensor_peak_bytes=int(tensors_only.max()) if tensors_only.size else 0,
        hardware=hw,
        forward_collectives_end_s=float(forward_collectives_end),
    )


def _refuse_swaps_without_host(graph: ActivationGraph, exp: Expansion, hw: Hardware) -> None:
    """A swap on hardware whose device memory is host memory is not simulated: the copy would
    run on the compute thread and free nothing."""
    if hw.host_is_device and (exp.codes == SWAP).any():
        first = graph.tensors[int(np.flatnonzero(exp.codes == SWAP)[0])].name
        raise PlanError(
            f"simulate: tensor {first!r} is swapped, but hardware {hw.name!r} has no "
            "host to swap to (its device memory is host memory): the copy would run "
            "on the compute thread and free nothing, so it is not simulated"
        )


def _swap_events(
    graph: ActivationGraph, exp: Expansion, swapped: np.ndarray
) -> tuple[dict[int, list[int]], dict[int, list[int]], dict[int, list[int]]]:
    """The swapped tensors by the position after which each is freed, by the position that
    issues its prefetch, and by the op that makes it (its offload follows that op)."""
    free_after: dict[int, list[int]] = {}
    issue_at: dict[int, list[int]] = {}
    outputs_swapped: dict[int, list[int]] = {}
    for t in swapped.tolist():
        free_after.setdefault(int(exp.d2h_free[t]), []).append(t)
        issue_at.setdefault(int(exp.h2d_issue[t]), []).append(t)
        outputs_swapped.setdefault(int(graph.producer[t]), []).append(t)
    return free_after, issue_at, outputs_swapped


def _collectives_by_position(graph: ActivationGraph, hw: Hardware) -> dict[int, list[Collective]]:
    """The collectives that cross the host link, by the position that issues them."""
    out: dict[int, list[Collective]] = {}
    if hw.collectives_on_link:
        for c in graph.collectives:
            out.setdefault(graph.collective_position(c), []).append(c)
    return out


def _collective_on_lanes(
    c: Collective, hw: Hardware, arrive: float, d2h_lane: float, h2d_lane: float
) -> tuple[float, float]:
    """A collective issued at ``arrive`` enters the lanes (one link when not full duplex);
    returns when each lane is free again."""
    if c.d2h_bytes:
        lane = d2h_lane if hw.duplex else max(h2d_lane, d2h_lane)
        d2h_lane = lane_start(lane, arrive) + hw.d2h_time(c.d2h_bytes)
        if not hw.duplex:
            h2d_lane = d2h_lane
    if c.h2d_bytes:
        lane = h2d_lane if hw.duplex else max(h2d_lane, d2h_lane)
        h2d_lane = lane_start(lane, arrive) + hw.h2d_time(c.h2d_bytes)
        if not hw.duplex:
            d2h_lane = h2d_lane
    return d2h_lane, h2d_lane


def memory_violations(
    graph: ActivationGraph, exp: Expansion, mem: np.ndarray, budget: int, limit: int = 20
) -> list[str]:
    """Where memory tops the budget: the op, the largest resident tensor there, and by how much."""
    over = np.flatnonzero(mem > budget)
    out = []
    for p in over[:limit]:
        op = graph.ops[int(exp.point_op[p])].name
        kind = ("forward", "rerun (forward again)", "backward")[int(exp.point_kind[p])]
        live = (exp.iv_start <= p) & (exp.iv_end >= p)
        biggest = ""
        if live.any():
            idx = np.flatnonzero(live)
            top = idx[np.argmax(exp.iv_bytes[idx])]
            biggest = f"; largest resident tensor {graph.tensors[int(exp.iv_tensor[top])].name!r}"
        out.append(
            f"{kind} of op {op!r}: {int(mem[p])} bytes resident, "
            f"{int(mem[p] - budget)} bytes over the budget of {budget}{biggest}"
        )
    if over.size > limit:
        out.append(f"... and {over.size - limit} more points over the budget")
    return out
