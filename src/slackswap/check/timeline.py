"""The checker's clock (formulations/step-model.md, "Copy lanes"): the step's time on one
compute stream and the D2H / H2D lanes, from the walk's reruns and swapped reads and the plan's
schedule alone. Returns the step time, its stalls and its reruns."""

from __future__ import annotations

from ..core.hardware import Hardware
from ..core.plan import Plan
from .walk import StepWalk, Walk


def step_timeline(
    step: StepWalk,
    walk: Walk,
    decisions: list[str | None],
    plan: Plan,
    hw: Hardware,
    marks: dict[str, float] | None = None,
) -> tuple[float, float, float]:
    """Step time on one compute stream and the D2H / H2D lanes (one transfer at a time each,
    or one link when not full duplex): the ideal time, plus every stall, plus every rerun.
    ``marks`` (a dict) gets "forward_end" (the clock when the last forward op ends),
    "offloads_end" (when the last offload ends) and "forward_comms_end" (when the last
    transfer of a collective issued in the forward ends), for a pipeline stage's phases."""
    g, n = step.graph, step.n
    S = 2 * n
    schedule = plan.schedule
    # a walk that reached here was complete: its reruns and reads are there, and the schedule
    # names every swapped tensor (a plan of keeps alone may have none)
    assert walk.reruns is not None and walk.swap_reads is not None
    reruns, swap_reads = walk.reruns, walk.swap_reads
    d2h_free = {} if schedule is None else schedule.d2h_free
    h2d_issue = {} if schedule is None else schedule.h2d_issue
    swapped = [t for t, d in enumerate(decisions) if d == "swap"]
    free_after = {t: int(d2h_free[g.tensors[t].name]) for t in swapped}
    issue_at = {t: int(h2d_issue[g.tensors[t].name]) for t in swapped}
    wait_for_free: dict[int, list[int]] = {}
    prefetch_at: dict[int, list[int]] = {}
    offload_after: dict[int, list[int]] = {}
    for t in swapped:
        wait_for_free.setdefault(free_after[t] + 1, []).append(t)
        prefetch_at.setdefault(issue_at[t], []).append(t)
        offload_after.setdefault(step.producer[t], []).append(t)
    first_reader = {t: max(step.readers_bwd[t]) for t in swapped}
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
    comms_in_forward = 0.0
    for k in range(S):
        issued = clock
        for out_bytes, in_bytes in comms.get(k, ()):  # before this position's prefetches
            if out_bytes:
                lane = d2h_free_at if hw.duplex else max(h2d_free_at, d2h_free_at)
                d2h_free_at = max(lane, issued) + hw.latency_s + out_bytes / hw.d2h_bytes_per_s
                if not hw.duplex:
                    h2d_free_at = d2h_free_at
                if k < n:
                    comms_in_forward = max(comms_in_forward, d2h_free_at)
            if in_bytes:
                lane = h2d_free_at if hw.duplex else max(h2d_free_at, d2h_free_at)
                h2d_free_at = max(lane, issued) + hw.latency_s + in_bytes / hw.h2d_bytes_per_s
                if not hw.duplex:
                    d2h_free_at = h2d_free_at
                if k < n:
                    comms_in_forward = max(comms_in_forward, h2d_free_at)
        # prefetches issued here, in the order of their tensors' first backward reader
        for t in sorted(prefetch_at.get(k, ()), key=lambda t: (S - 1 - first_reader[t], t)):
            lane = h2d_free_at if hw.duplex else max(h2d_free_at, d2h_free_at)
            begin = max(lane, issued, offloaded[t])
            landed[t] = begin + hw.latency_s + step.nbytes[t] / hw.h2d_bytes_per_s
            h2d_free_at = landed[t]
            if not hw.duplex:
                d2h_free_at = landed[t]
        go = issued
        for t in wait_for_free.get(k, ()):  # offloads that must be done before this op
            go = max(go, offloaded[t])
        for t in swap_reads.get(k, ()):  # prefetches this position reads must have landed
            go = max(go, landed[t])
        stall += go - issued
        clock = go
        if k < n:
            clock += g.ops[k].forward_s
            for t in sorted(offload_after.get(k, ())):
                lane = d2h_free_at if hw.duplex else max(h2d_free_at, d2h_free_at)
                begin = max(lane, clock)
                offloaded[t] = begin + hw.latency_s + step.nbytes[t] / hw.d2h_bytes_per_s
                d2h_free_at = offloaded[t]
                if not hw.duplex:
                    h2d_free_at = offloaded[t]
            if k == n - 1 and marks is not None:
                marks["forward_end"] = clock
        else:
            for q in reruns[k]:
                clock += g.ops[q].forward_s
                rerun += g.ops[q].forward_s
            clock += g.ops[S - 1 - k].backward_s
    if comms and max(d2h_free_at, h2d_free_at) > clock:
        stall += max(d2h_free_at, h2d_free_at) - clock  # the optimizer waits for the lanes
    if marks is not None:
        marks["offloads_end"] = max(offloaded.values(), default=0.0)
        marks["forward_comms_end"] = comms_in_forward
    ideal = sum(op.forward_s + op.backward_s for op in g.ops) + g.optimizer_s
    return ideal + stall + rerun, stall, rerun
