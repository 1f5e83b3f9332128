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


def measured_overhead_bytes(graph: ActivationGraph, measure_step) -> tuple[int, int]:
    """(bytes the plain step measures above the graph's keep-all peak, the measured peak).
    ``measure_step(sample)`` runs one plain step under ``StepMeter(sample=sample)`` and returns
    its peak bytes. Three steps: the first pays the heap's one-time buffers; then one sampled
    after every op and one by a thread, which also sees memory a kernel holds inside an op
    (oneDNN's convolution backward on the CPU; on CUDA the allocator's peak has it anyway)."""
    measure_step("ops")
    measured = max(int(measure_step("ops")), int(measure_step("thread")))
    simulated = keep_all_peak(graph, "cpu")  # keep-all's memory does not depend on the link
    return max(0, measured - simulated), measured


def with_overhead(graph: ActivationGraph, overhead: int, measured: int) -> ActivationGraph:
    """``graph`` with ``overhead`` bytes in every op's forward and backward workspace, and the
    figures in ``graph.extra["overhead"]``."""
    record = {"bytes": int(overhead), "plain_peak_bytes": int(measured)}
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
