"""What a rebuild reruns: per tensor its rerun closure and frontier, and the sharding units its
rebuild may run in (formulations/step-model.md, "Decisions" and "Sharded parameters"). Derived
once per graph (ActivationGraph's cached properties)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .graph import ActivationGraph


def units_and_blocked(
    graph: ActivationGraph,
) -> tuple[tuple[frozenset[str], ...], frozenset[int]]:
    """Per tensor the units its rebuild may run in, and the saved tensors never rebuilt
    (step-model.md, "Sharded parameters")."""
    # Blocked tensors are never rebuilt, so they rebuild nothing nested. Start from the ops
    # that may not run again; block what the propagated units forbid; propagate again from
    # the tensors still rebuildable; repeat. The blocked set only grows, so it ends, and at
    # the end every rebuildable tensor is compatible with every unit that can pull it in.
    first = graph.first_backward_use
    saved = [int(y) for y in graph.saved]
    needs: dict[int, set[int]] = {}
    for y in saved:
        needs[y] = {int(x) for x in graph.rerun_frontier[y]}
        needs[y] |= {
            int(o)
            for q in graph.rerun_ops[y]
            for o in graph.op_outputs[q]
            if o != y and graph.is_saved[o]
        }
    blocked = {y for y in saved if not all(graph.ops[q].recomputable for q in graph.rerun_ops[y])}
    while True:
        units = [
            {graph.ops[int(first[t])].unit} if first[t] >= 0 else set()
            for t in range(len(graph.tensors))
        ]
        changed = True
        while changed:
            changed = False
            for y in saved:
                if y in blocked:
                    continue
                for x in needs[y]:
                    if not units[y] <= units[x]:
                        units[x] |= units[y]
                        changed = True
        more = {
            t
            for t in saved
            if t not in blocked
            and any(
                graph.ops[q].param_unit and any(u != graph.ops[q].param_unit for u in units[t])
                for q in graph.rerun_ops[t]
            )
        }
        if not more:
            return tuple(frozenset(u) for u in units), frozenset(blocked)
        blocked |= more


def rerun_closures(
    graph: ActivationGraph,
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """Per tensor, the ops its rebuild reruns and the saved tensors they read (its rerun
    closure and frontier: step-model.md, "Decisions")."""
    saved = graph.is_saved.tolist()
    producer = graph.producer.tolist()
    writers = graph.writers
    written = graph.op_writes
    Closure = tuple[frozenset[int], frozenset[int]]  # the ops rerun, the saved tensors read
    op_closure: dict[int, Closure] = {}
    # the closure of op i's write of tensor t: the op and what its other reads need
    write_closure: dict[int, Closure] = {}

    def tensor_closure(t: int, before: int) -> tuple[set[int], set[int]]:
        """What rebuilding tensor t as op ``before`` reads it needs: its producer's closure,
        then the closures of the writes to it made before that op."""
        ops, frontier = set(op_closure[producer[t]][0]), set(op_closure[producer[t]][1])
        for w in writers[t]:
            if w < before:
                ops |= write_closure[w][0]
                frontier |= write_closure[w][1]
        return ops, frontier

    # op closures in forward order, so inputs' closures already exist
    for i, ins in enumerate(graph.op_inputs):
        ops = {i}
        frontier: set[int] = set()
        own = {i}
        own_frontier: set[int] = set()
        for t in ins:
            if saved[t]:
                frontier.add(t)
                if t not in written[i]:
                    own_frontier.add(t)
            else:
                sub_ops, sub_front = tensor_closure(t, i)
                ops |= sub_ops
                frontier |= sub_front
                if t not in written[i]:
                    own |= sub_ops
                    own_frontier |= sub_front
        op_closure[i] = (frozenset(ops), frozenset(frontier))
        if written[i]:
            write_closure[i] = (frozenset(own), frozenset(own_frontier))
    # sorted once per op: an op's outputs share its closure, unless written in place
    rerun_with = graph.op_rerun_with
    reruns_with = any(rerun_with)  # once: a scan of every op, not one per tensor
    if reruns_with:
        # an op that runs again brings the ops it reruns with (Op.rerun_with), each with its
        # own closure: once over the whole set, so a rebuild runs each op once
        base = dict(op_closure)
        for i, (c_ops, c_front) in base.items():
            more = [base[r] for q in c_ops for r in rerun_with[q]]
            if more:
                op_closure[i] = (
                    c_ops.union(*(m[0] for m in more)),
                    c_front.union(*(m[1] for m in more)),
                )
        for i in list(write_closure):
            w_ops, w_front = write_closure[i]
            more = [base[r] for q in w_ops for r in rerun_with[q]]
            if more:
                write_closure[i] = (
                    w_ops.union(*(m[0] for m in more)),
                    w_front.union(*(m[1] for m in more)),
                )
    sorted_closure = {
        i: (tuple(sorted(c_ops)), tuple(sorted(c_front)))
        for i, (c_ops, c_front) in op_closure.items()
    }
    per_tensor: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    end = len(graph.ops)
    for t, p in enumerate(producer):
        if writers[t]:
            t_ops, t_front = tensor_closure(t, end)
            t_front.discard(t)
            per_tensor.append((tuple(sorted(t_ops)), tuple(sorted(t_front))))
        elif reruns_with and t in op_closure[p][1]:
            # an op it reruns with reads it: the rerun makes it first
            s_ops, s_front = sorted_closure[p]
            per_tensor.append((s_ops, tuple(f for f in s_front if f != t)))
        else:
            per_tensor.append(sorted_closure[p])
    return tuple(c[0] for c in per_tensor), tuple(c[1] for c in per_tensor)
