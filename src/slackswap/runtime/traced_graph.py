"""A graph from a traced step: the profiler's traces (ops, autograd nodes, saved tensors) become an
ActivationGraph, with each backward op's activation and parameter gradients counted, and
optionally ops grouped by module.
"""

from __future__ import annotations

import statistics
from typing import Any

from ..core.errors import GraphError, ProfileError
from ..core.graph import ActivationGraph, Op, Tensor


def _saved_for(first) -> tuple[dict[str, list[str]], int]:
    """Per tensor, the ops that save it for backward (by the saving node's sequence number), and
    how many saves no op could be found for."""
    seq_to_op: dict[int, int] = {}
    for k, rec in enumerate(first.ops):
        seq_to_op.setdefault(rec.seq, k)
    saved_for: dict[str, list[str]] = {n: [] for n in first.tensors}
    reads = {k: set(rec.inputs) | set(rec.outputs) for k, rec in enumerate(first.ops)}
    unattributed = 0
    for seq, tensor in first.saved:
        i = seq_to_op.get(seq)
        if i is None or tensor not in reads[i]:
            # saved by a node whose op did not read or produce it (a view chain): the latest
            # op that read it before that node stands in
            candidates = [
                j for j in range(len(first.ops)) if tensor in reads[j] and (i is None or j <= i)
            ]
            if not candidates:
                unattributed += 1
                continue
            i = candidates[-1]
        op_name = first.ops[i].name
        if op_name not in saved_for[tensor]:
            saved_for[tensor].append(op_name)
    return saved_for, unattributed


def _stale_ops(first) -> set[int]:
    """Ops that may not run again: run again, they would read a tensor written in place after
    them, its later version (a writer reading what it writes is replayed in order)."""
    written_at: dict[str, list[int]] = {}
    for i, rec in enumerate(first.ops):
        for n in rec.writes:
            written_at.setdefault(n, []).append(i)
    stale = {
        i
        for i, rec in enumerate(first.ops)
        if any(w > i for n in rec.inputs if n not in rec.writes for w in written_at.get(n, ()))
    }
    return stale


def graph_from_traces(
    traces, graph_name: str, extra: dict[str, Any] | None = None
) -> ActivationGraph:
    """Median times over the traces; structure from the first (they must all agree)."""
    first = traces[0]
    for other in traces[1:]:
        if [o.name for o in other.ops] != [o.name for o in first.ops]:
            raise ProfileError(
                "the model ran different ops in different steps; slackswap plans "
                "steps whose op sequence repeats (data-dependent control flow?)"
            )
    saved_for, unattributed = _saved_for(first)
    # sequence numbers run on across steps: each trace maps its own
    seq_maps = []
    for t in traces:
        mapping: dict[int, int] = {}
        for i, rec in enumerate(t.ops):
            mapping.setdefault(rec.seq, i)
        seq_maps.append(mapping)
    grad_bytes = backward_gradient_bytes(traces, seq_maps, len(first.ops))
    param_grads = parameter_gradient_bytes(traces, seq_maps, len(first.ops))
    param_waiting = waiting_parameter_gradient_bytes(traces, seq_maps, len(first.ops))
    entry_grads = _per_op_max(traces, seq_maps, len(first.ops), "backward_entry_grad_bytes")
    stale = _stale_ops(first)
    # hook positions (formulations/step-model.md): a save between op i and op i+1, and a node
    # that unpacks a saved tensor when its backward begins
    savers = {op for names in saved_for.values() for op in names}
    ops = []
    for i, rec in enumerate(first.ops):
        fwd = statistics.median(t.ops[i].forward_s for t in traces)
        bwd_samples = [
            t.backward_s.get(t.ops[i].seq, 0.0) if mp.get(t.ops[i].seq) == i else 0.0
            for t, mp in zip(traces, seq_maps)
        ]
        # a node off the loss's path never runs: what it saved is never read back
        ran = any(
            mp.get(t.ops[i].seq) == i and t.ops[i].seq in t.backward_s
            for t, mp in zip(traces, seq_maps)
        )
        ops.append(
            Op(
                name=rec.name,
                forward_s=float(fwd),
                backward_s=float(statistics.median(bwd_samples)),
                inputs=tuple(rec.inputs),
                outputs=tuple(rec.outputs),
                backward_workspace_bytes=grad_bytes[i],
                rerun_workspace_bytes=entry_grads[i],
                # a tensor written in place after it was made is rebuilt by its producer, then its
                # writers (Op.writes); an op that writes anything else may not run again
                recomputable=not rec.mutates and i not in stale,
                unit=rec.unit,
                writes=tuple(dict.fromkeys(n for n in rec.writes if n in first.tensors)),
                param_unit=rec.param_unit,
                hook_after=i in first.pack_after or i == len(first.ops) - 1,
                hook_backward=rec.name in savers,
                extra={
                    "aten": rec.aten,
                    "module": rec.module,
                    **({"random": True} if rec.random else {}),
                    **({} if ran else {"backward_ran": False}),
                    **({"param_grad_bytes": param_grads[i]} if param_grads[i] else {}),
                    **({"param_grad_waiting_bytes": param_waiting[i]} if param_waiting[i] else {}),
                },
            )
        )
    random_saved: dict[int, list[str]] = {}
    for name, rec in first.tensors.items():
        if first.ops[rec.producer].random and saved_for[name]:
            random_saved.setdefault(rec.producer, []).append(name)
    last_read = {name: rec.producer for name, rec in first.tensors.items()}
    for i, rec in enumerate(first.ops):
        for name in rec.inputs:
            if name in last_read:
                last_read[name] = max(last_read[name], i)
    end = len(first.ops) - 1
    tensors = []
    for name, rec in first.tensors.items():
        # the model may hold a tensor past its last reader (a variable alive to the end of a
        # function); the latest release over the traces bounds when any plan can free it
        released = max(t.released_after.get(name, end) for t in traces)
        alive_until = first.ops[released].name if released > last_read[name] else None
        group = None
        if first.ops[rec.producer].random and len(random_saved.get(rec.producer, [])) > 1:
            group = f"rng:{first.ops[rec.producer].name}"
        tensors.append(
            Tensor(
                name=name,
                bytes=rec.bytes,
                saved_for=tuple(saved_for[name]),
                group=group,
                alive_until=alive_until,
                extra={"shape": list(rec.shape), "dtype": rec.dtype},
            )
        )
    info = dict(extra or {})
    if unattributed:
        info["unattributed_saves"] = unattributed
    try:
        return ActivationGraph(
            name=graph_name, ops=tuple(ops), tensors=tuple(tensors), optimizer_s=0.0, extra=info
        )
    except GraphError as exc:
        raise ProfileError(f"the traced step does not form a valid graph: {exc}") from exc


def backward_gradient_bytes(traces, seq_maps, n_ops: int) -> list[int]:
    """Per op, the activation gradients alive during its backward (backward_trace.GradientLedger) and
    the temporaries its backward formula holds above them (backward_trace.BackwardTransients), the
    largest over the traces: the op's backward workspace in the step model, so that plans count
    the memory backward adds to the saved tensors. An autograd node with no op of its
    own (a view's) counts for the op whose backward ran last before it."""
    out = [0] * n_ops
    for trace, mapping in zip(traces, seq_maps):
        current = None
        for seq in trace.backward_order:
            current = mapping.get(seq, current)
            if current is not None:
                out[current] = max(
                    out[current],
                    int(trace.backward_grad_bytes.get(seq, 0))
                    + int(trace.backward_transient_bytes.get(seq, 0)),
                )
    return out


def _per_op_max(traces, seq_maps, n_ops: int, field: str) -> list[int]:
    """Per op, the largest of a per-node figure of the traces (``field`` of StepTrace, by
    sequence nr), attributed as ``backward_gradient_bytes`` does."""
    out = [0] * n_ops
    for trace, mapping in zip(traces, seq_maps):
        figures = getattr(trace, field)
        current = None
        for seq in trace.backward_order:
            current = mapping.get(seq, current)
            if current is not None:
                out[current] = max(out[current], int(figures.get(seq, 0)))
    return out


def waiting_parameter_gradient_bytes(traces, seq_maps, n_ops: int) -> list[int]:
    """Per op, the parameter gradients made earlier in the backward that wait in their
    AccumulateGrad's buffer while its backward runs (backward_trace.GradientLedger: a parameter with
    readers whose backward has not run yet, as a tied embedding's LM head), the largest over the
    traces, attributed as ``backward_gradient_bytes`` does."""
    return _per_op_max(traces, seq_maps, n_ops, "param_grad_waiting_bytes")


def parameter_gradient_bytes(traces, seq_maps, n_ops: int) -> list[int]:
    """Per op, the parameter gradients its backward makes (sent to AccumulateGrad; the largest
    over the traces), attributed as ``backward_gradient_bytes`` does. Eager autograd adds each
    into ``.grad`` at once; a torch.compile'd backward returns them all at its end
    (``checkpoint_graph(compiled=True)`` counts them)."""
    out = [0] * n_ops
    for trace, mapping in zip(traces, seq_maps):
        current = None
        mine = [0] * n_ops
        for seq in trace.backward_order:
            current = mapping.get(seq, current)
            if current is not None:
                mine[current] += int(trace.param_grad_bytes.get(seq, 0))
        out = [max(a, b) for a, b in zip(out, mine)]
    return out


def group_by_module(graph: ActivationGraph) -> ActivationGraph:
    """A coarser graph: each run of consecutive ops of one module call becomes one op (times
    summed, inputs from outside the run, every tensor it makes as outputs, saved_for mapped to
    the run). Tensor names do not change, so plans for it apply to the model as they are."""
    runs: list[list[int]] = []
    for i, op in enumerate(graph.ops):
        module = op.extra.get("module", op.name)
        if (
            runs
            and graph.ops[runs[-1][0]].extra.get("module", graph.ops[runs[-1][0]].name) == module
        ):
            runs[-1].append(i)
        else:
            runs.append([i])
    new_name: dict[str, str] = {}
    ops = []
    counts: dict[str, int] = {}
    for members in runs:
        module = graph.ops[members[0]].extra.get("module", graph.ops[members[0]].name)
        k = counts.get(module, 0)
        counts[module] = k + 1
        name = f"{module}@{k}"
        outputs = [o for i in members for o in graph.ops[i].outputs]
        made = set(outputs)
        inputs = []
        for i in members:
            for x in graph.ops[i].inputs:
                if x not in made and x not in inputs:
                    inputs.append(x)
        for i in members:
            new_name[graph.ops[i].name] = name
        ops.append(
            Op(
                name=name,
                forward_s=float(sum(graph.ops[i].forward_s for i in members)),
                backward_s=float(sum(graph.ops[i].backward_s for i in members)),
                inputs=tuple(inputs),
                outputs=tuple(outputs),
                forward_workspace_bytes=max(graph.ops[i].forward_workspace_bytes for i in members),
                backward_workspace_bytes=max(
                    graph.ops[i].backward_workspace_bytes for i in members
                ),
                rerun_workspace_bytes=max(graph.ops[i].rerun_workspace_bytes for i in members),
                recomputable=all(graph.ops[i].recomputable for i in members),
                writes=tuple(
                    dict.fromkeys(x for i in members for x in graph.ops[i].writes if x not in made)
                ),
                unit=graph.ops[members[0]].unit,
                param_unit=next(
                    (graph.ops[i].param_unit for i in members if graph.ops[i].param_unit), ""
                ),
                hook_after=graph.ops[members[-1]].hook_after,
                hook_backward=any(graph.ops[i].hook_backward for i in members),
                extra={
                    "module": module,
                    "aten_ops": len(members),
                    **(
                        {"random": True}
                        if any(graph.ops[i].extra.get("random") for i in members)
                        else {}
                    ),
                    **(
                        {"param_grad_bytes": param_grads}
                        if (
                            param_grads := sum(
                                int(graph.ops[i].extra.get("param_grad_bytes", 0)) for i in members
                            )
                        )
                        else {}
                    ),
                    **(
                        {"param_grad_waiting_bytes": waiting}
                        if (
                            waiting := max(
                                int(graph.ops[i].extra.get("param_grad_waiting_bytes", 0))
                                for i in members
                            )
                        )
                        else {}
                    ),
                },
            )
        )
    tensors = []
    for t in graph.tensors:
        saved = []
        for op_name in t.saved_for:
            if new_name[op_name] not in saved:
                saved.append(new_name[op_name])
        tensors.append(
            Tensor(
                name=t.name,
                bytes=t.bytes,
                saved_for=tuple(saved),
                group=t.group,
                extra=dict(t.extra),
            )
        )
    return ActivationGraph(
        name=f"{graph.name}/modules",
        ops=tuple(ops),
        tensors=tuple(tensors),
        optimizer_s=graph.optimizer_s,
        extra={**graph.extra, "grouped_by": "module"},
    )
