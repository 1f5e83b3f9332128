"""What a training step holds beside the tensors its graph names, measured once by the profiler
and counted in every op's workspaces, so that a plan's budget covers it.

On the CPU the meter is the C heap: autograd's own records of the graph (a node and saved-variable
entries per op, about 0.1 MiB for a 200-op transformer), the allocator's rounding and the model's
Python objects sit there beside the tensors. On CUDA the caching allocator rounds every block. No
op or tensor of the graph carries them. The profiler measures a plain step's peak with
``StepMeter`` (after every op, and from a thread, which also sees memory a kernel holds inside one
op: oneDNN's convolution backward) against the keep-all simulation of the graph it just made; what is
above is added to every op's forward and backward workspace (a rerun's point takes its op's
forward workspace): a constant at every point of the step, which is at or above what each point
holds (formulations/step-model.md, "Workspaces").
"""

from __future__ import annotations

from dataclasses import replace

from ..core.budget import keep_all_peak
from ..core.graph import ActivationGraph

# thread-sampled steps, always this many: under DDP or FSDP each plain step runs collectives,
# so every rank must run as many (a count that depended on what one rank saw would hang them)
THREAD_STEPS = 3
METHOD = (
    "the maximum over plain steps metered after every op (one) and by a thread every 50 us "
    "({steps})"
)


def measured_overhead_bytes(graph: ActivationGraph, measure_step) -> tuple[int, int, dict]:
    """(bytes the plain step measures above the graph's keep-all peak, the measured peak, how it
    was measured). ``measure_step(sample)`` runs one plain step under
    ``StepMeter(sample=sample)`` and returns its peak bytes. The first step pays the heap's
    one-time buffers; then one sampled after every op, and thread-sampled steps, which also see
    memory a kernel holds inside an op (oneDNN's convolution backward on the CPU; on CUDA the
    allocator's peak has it anyway). A thread sees such memory only when it is scheduled while
    the kernel runs, which on a busy machine it may not be in one step: THREAD_STEPS steps are
    sampled and the maximum taken, so one unlucky step does not decide the graph."""
    measure_step("ops")
    at_ops = int(measure_step("ops"))
    threads = [int(measure_step("thread")) for _ in range(THREAD_STEPS)]
    measured = max(at_ops, *threads)
    simulated = keep_all_peak(graph, "cpu")  # keep-all's memory does not depend on the link
    how = {
        "method": METHOD.format(steps=THREAD_STEPS),
        "after_every_op_bytes": at_ops,
        "thread_bytes": threads,
    }
    return max(0, measured - simulated), measured, how


def with_overhead(
    graph: ActivationGraph, overhead: int, measured: int, how: dict | None = None
) -> ActivationGraph:
    """``graph`` with ``overhead`` bytes in every op's forward and backward workspace, and the
    figures (and how they were measured) in ``graph.extra["overhead"]``."""
    record = {"bytes": int(overhead), "plain_peak_bytes": int(measured), **(how or {})}
    if overhead <= 0:
        return replace(graph, extra={**graph.extra, "overhead": record})
    ops = tuple(
        replace(
            op,
            forward_workspace_bytes=op.forward_workspace_bytes + overhead,
            backward_workspace_bytes=op.backward_workspace_bytes + overhead,
        )
        for op in graph.ops
    )
    return replace(graph, ops=ops, extra={**graph.extra, "overhead": record})


def without_overhead(graph: ActivationGraph) -> ActivationGraph:
    """``graph`` as profiled before its overhead was counted (``with_overhead`` undone): the
    graph a fake profile of the same step has, which measures nothing."""
    overhead = int(graph.extra.get("overhead", {}).get("bytes", 0))
    extra = {k: v for k, v in graph.extra.items() if k != "overhead"}
    if overhead <= 0:
        return replace(graph, extra=extra)
    ops = tuple(
        replace(
            op,
            forward_workspace_bytes=op.forward_workspace_bytes - overhead,
            backward_workspace_bytes=op.backward_workspace_bytes - overhead,
        )
        for op in graph.ops
    )
    return replace(graph, ops=ops, extra=extra)
