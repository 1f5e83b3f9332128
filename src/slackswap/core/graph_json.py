"""A graph's JSON object (docs/file-formats.md): reading checks every field's type and names
the op, tensor or field that is wrong; unknown fields are kept (``extra``) and written back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import GraphError
from .graph import GRAPH_FORMAT, ActivationGraph, Collective, Op, Tensor
from .graph_rules import (
    check_bool,
    check_bytes,
    check_names,
    check_time,
    check_unit,
    described,
)

_OP_FIELDS = {
    "name",
    "forward_s",
    "backward_s",
    "inputs",
    "outputs",
    "forward_workspace_bytes",
    "backward_workspace_bytes",
    "recomputable",
    "unit",
    "param_unit",
    "writes",
    "rerun_with",
    "rerun_workspace_bytes",
    "hook_after",
    "hook_backward",
}
_TENSOR_FIELDS = {"name", "bytes", "saved_for", "group", "alive_until", "rebuilt_before"}
_GRAPH_FIELDS = {"format", "name", "ops", "tensors", "optimizer_s", "collectives"}
_COLLECTIVE_FIELDS = {"name", "op", "phase", "d2h_bytes", "h2d_bytes"}


def graph_from_dict(data: Mapping[str, Any]) -> ActivationGraph:
    """A graph from its JSON object (docs/file-formats.md); unknown fields are kept."""
    if not isinstance(data, Mapping):
        raise GraphError(f"graph: expected a JSON object, got {type(data).__name__}")
    fmt = data.get("format")
    if fmt != GRAPH_FORMAT:
        raise GraphError(f"graph: field 'format' must be {GRAPH_FORMAT!r}, got {fmt!r}")
    for key in ("name", "ops", "tensors"):
        if key not in data:
            raise GraphError(f"graph: missing field {key!r}")
    if not isinstance(data["ops"], list) or not isinstance(data["tensors"], list):
        raise GraphError("graph: fields 'ops' and 'tensors' must be lists")
    ops = []
    for i, raw in enumerate(data["ops"]):
        if not isinstance(raw, Mapping):
            raise GraphError(f"op #{i}: expected an object, got {raw!r}")
        where = described("op", raw.get("name", f"#{i}"))
        for key in ("name", "forward_s", "backward_s"):
            if key not in raw:
                raise GraphError(f"{where}: missing field {key!r}")
        ops.append(
            Op(
                name=raw["name"],
                forward_s=check_time(raw["forward_s"], where, "forward_s"),
                backward_s=check_time(raw["backward_s"], where, "backward_s"),
                inputs=check_names(raw.get("inputs", []), where, "inputs"),
                outputs=check_names(raw.get("outputs", []), where, "outputs"),
                forward_workspace_bytes=check_bytes(
                    raw.get("forward_workspace_bytes", 0), where, "forward_workspace_bytes"
                ),
                backward_workspace_bytes=check_bytes(
                    raw.get("backward_workspace_bytes", 0), where, "backward_workspace_bytes"
                ),
                recomputable=check_bool(raw.get("recomputable", True), where, "recomputable"),
                rerun_workspace_bytes=check_bytes(
                    raw.get("rerun_workspace_bytes", 0), where, "rerun_workspace_bytes"
                ),
                unit=check_unit(raw.get("unit", ""), where),
                param_unit=check_unit(raw.get("param_unit", ""), where),
                writes=check_names(raw.get("writes", []), where, "writes"),
                rerun_with=check_names(raw.get("rerun_with", []), where, "rerun_with"),
                hook_after=check_bool(raw.get("hook_after", True), where, "hook_after"),
                hook_backward=check_bool(raw.get("hook_backward", True), where, "hook_backward"),
                extra={k: v for k, v in raw.items() if k not in _OP_FIELDS},
            )
        )
    tensors = []
    for j, raw in enumerate(data["tensors"]):
        if not isinstance(raw, Mapping):
            raise GraphError(f"tensor #{j}: expected an object, got {raw!r}")
        where = described("tensor", raw.get("name", f"#{j}"))
        for key in ("name", "bytes"):
            if key not in raw:
                raise GraphError(f"{where}: missing field {key!r}")
        group = raw.get("group")
        if group is not None and not isinstance(group, str):
            raise GraphError(f"{where}: group must be a string or null, got {group!r}")
        alive_until = raw.get("alive_until")
        if alive_until is not None and not isinstance(alive_until, str):
            raise GraphError(
                f"{where}: alive_until must be an op name or null, got {alive_until!r}"
            )
        rebuilt_before = raw.get("rebuilt_before")
        if rebuilt_before is not None and not isinstance(rebuilt_before, str):
            raise GraphError(
                f"{where}: rebuilt_before must be an op name or null, got {rebuilt_before!r}"
            )
        tensors.append(
            Tensor(
                name=raw["name"],
                bytes=check_bytes(raw["bytes"], where, "bytes"),
                saved_for=check_names(raw.get("saved_for", []), where, "saved_for"),
                group=group,
                alive_until=alive_until,
                rebuilt_before=rebuilt_before,
                extra={k: v for k, v in raw.items() if k not in _TENSOR_FIELDS},
            )
        )
    raw_collectives = data.get("collectives", [])
    if not isinstance(raw_collectives, list):
        raise GraphError("graph: field 'collectives' must be a list")
    collectives = []
    for j, raw in enumerate(raw_collectives):
        if not isinstance(raw, Mapping):
            raise GraphError(f"collective #{j}: expected an object, got {raw!r}")
        where = described("collective", raw.get("name", f"#{j}"))
        for key in ("name", "op", "phase"):
            if key not in raw:
                raise GraphError(f"{where}: missing field {key!r}")
        unknown = set(raw) - _COLLECTIVE_FIELDS
        if unknown:
            raise GraphError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        collectives.append(
            Collective(
                name=raw["name"],
                op=raw["op"],
                phase=raw["phase"],
                d2h_bytes=check_bytes(raw.get("d2h_bytes", 0), where, "d2h_bytes"),
                h2d_bytes=check_bytes(raw.get("h2d_bytes", 0), where, "h2d_bytes"),
            )
        )
    return ActivationGraph(
        name=data["name"],
        ops=tuple(ops),
        tensors=tuple(tensors),
        optimizer_s=check_time(data.get("optimizer_s", 0.0), "graph", "optimizer_s"),
        extra={k: v for k, v in data.items() if k not in _GRAPH_FIELDS},
        collectives=tuple(collectives),
    )


def graph_to_dict(graph: ActivationGraph) -> dict[str, Any]:
    """The graph's JSON object; unknown fields it was loaded with are written back."""
    ops = []
    for op in graph.ops:
        d: dict[str, Any] = dict(op.extra)
        d.update(
            name=op.name,
            forward_s=op.forward_s,
            backward_s=op.backward_s,
            inputs=list(op.inputs),
            outputs=list(op.outputs),
        )
        if op.forward_workspace_bytes:
            d["forward_workspace_bytes"] = op.forward_workspace_bytes
        if op.backward_workspace_bytes:
            d["backward_workspace_bytes"] = op.backward_workspace_bytes
        if not op.recomputable:
            d["recomputable"] = False
        if op.unit:
            d["unit"] = op.unit
        if op.param_unit:
            d["param_unit"] = op.param_unit
        if op.writes:
            d["writes"] = list(op.writes)
        if op.rerun_with:
            d["rerun_with"] = list(op.rerun_with)
        if op.rerun_workspace_bytes:
            d["rerun_workspace_bytes"] = op.rerun_workspace_bytes
        if not op.hook_after:
            d["hook_after"] = False
        if not op.hook_backward:
            d["hook_backward"] = False
        ops.append(d)
    tensors = []
    for t in graph.tensors:
        d = dict(t.extra)
        d.update(name=t.name, bytes=t.bytes, saved_for=list(t.saved_for))
        if t.group is not None:
            d["group"] = t.group
        if t.alive_until is not None:
            d["alive_until"] = t.alive_until
        if t.rebuilt_before is not None:
            d["rebuilt_before"] = t.rebuilt_before
        tensors.append(d)
    out: dict[str, Any] = dict(graph.extra)
    out.update(
        format=GRAPH_FORMAT,
        name=graph.name,
        ops=ops,
        tensors=tensors,
        optimizer_s=graph.optimizer_s,
    )
    if graph.collectives:
        out["collectives"] = [
            {
                "name": c.name,
                "op": c.op,
                "phase": c.phase,
                "d2h_bytes": c.d2h_bytes,
                "h2d_bytes": c.h2d_bytes,
            }
            for c in graph.collectives
        ]
    return out
