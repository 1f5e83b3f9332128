"""The rules a graph alone can break (formulations/step-model.md), checked when a graph is
made: each error names the op, tensor or field, so that no planner sees a malformed graph."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import GraphError

if TYPE_CHECKING:
    from .graph import ActivationGraph

# every byte sum of a step (resident tensors plus a workspace) must stay exact in int64 and in the
# float64 the solvers see: bytes are refused once their total passes 2**53 (about 9 PB)
MAX_TOTAL_BYTES = 2**53
# every time sum of a step must stay finite: times are refused once their total passes 1e12 s
MAX_TOTAL_SECONDS = 1e12
PHASES = ("forward", "backward")


def described(kind: str, name: str) -> str:
    return f"{kind} {name!r}"


def check_time(value: Any, where: str, fieldname: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GraphError(f"{where}: {fieldname} must be a number, got {value!r}")
    seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0:
        raise GraphError(f"{where}: {fieldname} must be finite and >= 0, got {seconds!r}")
    return seconds


def check_bytes(value: Any, where: str, fieldname: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if isinstance(value, float) and math.isfinite(value) and value.is_integer() and value >= 0:
            value = int(value)
        else:
            raise GraphError(f"{where}: {fieldname} must be a non-negative integer, got {value!r}")
    if value < 0:
        raise GraphError(f"{where}: {fieldname} must be a non-negative integer, got {value!r}")
    if value > MAX_TOTAL_BYTES:
        raise GraphError(
            f"{where}: {fieldname} = {value} is more than the {MAX_TOTAL_BYTES} bytes "
            "a step may hold in all"
        )
    return int(value)


def check_unit(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise GraphError(
            f"{where}: unit must be a string (a sharding unit's module path), got {value!r}"
        )
    return value


def check_bool(value: Any, where: str, fieldname: str) -> bool:
    if not isinstance(value, bool):
        raise GraphError(
            f"{where}: {fieldname} must be true or false (a JSON boolean), got {value!r}"
        )
    return value


def check_names(value: Any, where: str, fieldname: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise GraphError(f"{where}: {fieldname} must be a list of names, got {value!r}")
    for item in value:
        if not isinstance(item, str):
            raise GraphError(f"{where}: {fieldname} must hold names (strings), got {item!r}")
    return tuple(value)


def check_graph(graph: ActivationGraph) -> None:
    """Every rule of formulations/step-model.md a graph alone can break, the op, tensor or
    field named (GraphError)."""
    if not isinstance(graph.name, str) or not graph.name:
        raise GraphError(f"graph: name must be a non-empty string, got {graph.name!r}")
    check_time(graph.optimizer_s, "graph", "optimizer_s")
    if not graph.ops:
        raise GraphError(f"graph {graph.name!r}: it has no ops")
    op_index = _check_ops(graph)
    tensor_index = _check_tensor_names(graph)
    check_totals(graph)
    _check_collectives(graph, op_index)
    producer = _check_producers(graph, tensor_index)
    _check_saves(graph, op_index, producer)


def _check_ops(graph: ActivationGraph) -> dict[str, int]:
    """Each op's fields, and the ops it reruns with; returns the ops by name."""
    op_index: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        where = described("op", op.name)
        if not isinstance(op.name, str) or not op.name:
            raise GraphError(f"op #{i}: name must be a non-empty string, got {op.name!r}")
        if op.name in op_index:
            raise GraphError(f"{where}: duplicate op name")
        op_index[op.name] = i
        check_time(op.forward_s, where, "forward_s")
        check_time(op.backward_s, where, "backward_s")
        check_bytes(op.forward_workspace_bytes, where, "forward_workspace_bytes")
        check_bytes(op.backward_workspace_bytes, where, "backward_workspace_bytes")
        check_bytes(op.rerun_workspace_bytes, where, "rerun_workspace_bytes")
        check_bool(op.recomputable, where, "recomputable")
        check_bool(op.hook_after, where, "hook_after")
        check_bool(op.hook_backward, where, "hook_backward")
        check_unit(op.unit, where)
        check_unit(op.param_unit, where)
        if len(set(op.outputs)) != len(op.outputs):
            raise GraphError(f"{where}: an output is listed twice")
        if not isinstance(op.writes, tuple):
            raise GraphError(f"{where}: writes must be a tuple of tensor names")
        for name in op.writes:
            if name not in op.inputs:
                raise GraphError(
                    f"{where}: writes {name!r} in place but does not read it "
                    "(an op writes in place what it reads: list it in inputs)"
                )
        if not isinstance(op.rerun_with, tuple):
            raise GraphError(f"{where}: rerun_with must be a tuple of op names")
    for op in graph.ops:
        for name in op.rerun_with:
            if name not in op_index or name == op.name:
                raise GraphError(
                    f"{described('op', op.name)}: rerun_with {name!r} is "
                    + ("the op itself" if name == op.name else "no op of the graph")
                )
    return op_index


def _check_tensor_names(graph: ActivationGraph) -> dict[str, int]:
    """Each tensor's name and size; returns the tensors by name."""
    tensor_index: dict[str, int] = {}
    for j, t in enumerate(graph.tensors):
        where = described("tensor", t.name)
        if not isinstance(t.name, str) or not t.name:
            raise GraphError(f"tensor #{j}: name must be a non-empty string, got {t.name!r}")
        if t.name in tensor_index:
            raise GraphError(f"{where}: duplicate tensor name")
        tensor_index[t.name] = j
        check_bytes(t.bytes, where, "bytes")
    return tensor_index


def _check_collectives(graph: ActivationGraph, op_index: dict[str, int]) -> None:
    """Each collective: a unique name, an op of the graph, a phase, its bytes."""
    from .graph import Collective

    names: set[str] = set()
    for c in graph.collectives:
        if not isinstance(c, Collective):
            raise GraphError(
                f"graph {graph.name!r}: collectives must be Collective, got {type(c).__name__}"
            )
        where = described("collective", c.name)
        if not isinstance(c.name, str) or not c.name or c.name in names:
            raise GraphError(f"{where}: name must be a non-empty, unique string")
        names.add(c.name)
        if c.op not in op_index:
            raise GraphError(f"{where}: op {c.op!r} is not an op of the graph")
        if c.phase not in PHASES:
            raise GraphError(f"{where}: phase must be one of {PHASES}, got {c.phase!r}")
        check_bytes(c.d2h_bytes, where, "d2h_bytes")
        check_bytes(c.h2d_bytes, where, "h2d_bytes")


def _check_producers(graph: ActivationGraph, tensor_index: dict[str, int]) -> dict[str, int]:
    """Each tensor made by exactly one op, and read only after it is made (a forward order);
    returns each tensor's producer."""
    producer: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for out in op.outputs:
            if out not in tensor_index:
                raise GraphError(
                    f"op {op.name!r}: output {out!r} is not listed in tensors (its bytes are unknown)"
                )
            if out in producer:
                raise GraphError(
                    f"tensor {out!r}: produced by both op {graph.ops[producer[out]].name!r} "
                    f"and op {op.name!r}"
                )
            producer[out] = i
    for t in graph.tensors:
        if t.name not in producer:
            raise GraphError(f"tensor {t.name!r}: no op produces it (unknown producer)")
    for i, op in enumerate(graph.ops):
        for name in op.inputs:
            if name in producer and producer[name] >= i:
                raise GraphError(
                    f"op {op.name!r}: reads tensor {name!r} before it is produced "
                    f"(by op {graph.ops[producer[name]].name!r}); the op order has a cycle "
                    "or is not a forward order"
                )
    return producer


def _check_saves(
    graph: ActivationGraph, op_index: dict[str, int], producer: dict[str, int]
) -> None:
    """Who saves each tensor, and how long it lives and when it must be rebuilt, name ops that
    can: its producer or readers, no op before its producer."""
    for t in graph.tensors:
        where = described("tensor", t.name)
        p = producer[t.name]
        if len(set(t.saved_for)) != len(t.saved_for):
            raise GraphError(f"{where}: saved_for lists an op twice")
        for opname in t.saved_for:
            if opname not in op_index:
                raise GraphError(f"{where}: saved_for names unknown op {opname!r}")
            i = op_index[opname]
            if i != p and t.name not in graph.ops[i].inputs:
                raise GraphError(
                    f"{where}: saved_for names op {opname!r}, which neither produces nor reads it"
                )
            if not graph.ops[i].hook_backward:
                raise GraphError(
                    f"{where}: saved_for names op {opname!r}, whose hook_backward is false: an "
                    "op that saves a tensor unpacks it when its backward begins (a hook position)"
                )
        if t.alive_until is not None:
            if t.alive_until not in op_index:
                raise GraphError(f"{where}: alive_until names unknown op {t.alive_until!r}")
            if op_index[t.alive_until] < p:
                raise GraphError(
                    f"{where}: alive_until names op {t.alive_until!r}, which runs "
                    f"before its producer {graph.ops[p].name!r}"
                )
        if t.rebuilt_before is not None:
            if t.rebuilt_before not in op_index:
                raise GraphError(f"{where}: rebuilt_before names unknown op {t.rebuilt_before!r}")
            if not t.saved_for:
                raise GraphError(f"{where}: rebuilt_before is set, but the tensor is not saved")
            first = max(op_index[o] for o in t.saved_for)
            if op_index[t.rebuilt_before] < first:
                raise GraphError(
                    f"{where}: rebuilt_before names op {t.rebuilt_before!r}, whose backward runs "
                    f"after the tensor's first backward use (op {graph.ops[first].name!r})"
                )


def check_totals(graph: ActivationGraph) -> None:
    """Sums that every planner and the simulator form must stay exact and finite: refuse,
    naming the tensor or op at which the running total passes the limit."""
    total = max(
        (max(op.forward_workspace_bytes, op.backward_workspace_bytes) for op in graph.ops),
        default=0,
    )
    for t in graph.tensors:
        total += int(t.bytes)
        if total > MAX_TOTAL_BYTES:
            raise GraphError(
                f"tensor {t.name!r}: the step's bytes pass {MAX_TOTAL_BYTES} with "
                "it (with the largest workspace): sums would not be exact"
            )
    seconds = float(graph.optimizer_s)
    for op in graph.ops:
        seconds += float(op.forward_s) * 2 + float(op.backward_s)  # a rerun runs forward again
        if not seconds <= MAX_TOTAL_SECONDS:
            raise GraphError(
                f"op {op.name!r}: the step's time passes {MAX_TOTAL_SECONDS:g} s "
                "with it: times must be seconds, and finite in sum"
            )
