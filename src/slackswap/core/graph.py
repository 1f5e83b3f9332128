"""The activation graph: ops in forward order, the tensors they produce, and who saves what.

Loading checks every rule of formulations/step-model.md that a graph alone can break, so that
planners never see a malformed graph. Unknown JSON fields are kept (``extra``) and written back.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from .errors import GraphError

GRAPH_FORMAT = "slackswap.graph/1"
# every byte sum of a step (resident tensors plus a workspace) must stay exact in int64 and in the
# float64 the solvers see: bytes are refused once their total passes 2**53 (about 9 PB)
MAX_TOTAL_BYTES = 2**53
# every time sum of a step must stay finite: times are refused once their total passes 1e12 s
MAX_TOTAL_SECONDS = 1e12

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
}
_TENSOR_FIELDS = {"name", "bytes", "saved_for", "group", "alive_until", "rebuilt_before"}
_GRAPH_FIELDS = {"format", "name", "ops", "tensors", "optimizer_s", "collectives"}
_COLLECTIVE_FIELDS = {"name", "op", "phase", "d2h_bytes", "h2d_bytes"}
PHASES = ("forward", "backward")


@dataclass(frozen=True)
class Op:
    """One op of the forward pass; its backward runs in reverse order."""

    name: str
    forward_s: float
    backward_s: float
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    forward_workspace_bytes: int = 0
    backward_workspace_bytes: int = 0
    recomputable: bool = True
    # memory a rebuild at this op's backward position holds beside the rerun ops' own: the
    # activation gradients already waiting when the op's backward begins (its incoming ones
    # among them), which its backward workspace counts only while the op itself runs
    # (formulations/step-model.md, "Memory")
    rerun_workspace_bytes: int = 0
    # the sharding unit (an FSDP2 ``fully_shard`` module) the op runs in, and the one whose
    # parameters it reads: those are gathered only around their unit's forward and backward, so
    # a rerun of the op may only run in that unit's backward (formulations/step-model.md,
    # "Sharded parameters"); "" when none
    unit: str = ""
    param_unit: str = ""
    # tensors this op writes in place (it reads them too): a dropout mask filled by bernoulli_,
    # an in-place ReLU's output. Rebuilding such a tensor reruns its producer and then its
    # writers, in forward order (formulations/step-model.md, "Decisions")
    writes: tuple[str, ...] = ()
    # ops that run again whenever this op runs again, with their own rebuild closures: torch's
    # checkpoint reruns a region's forward from its start to its last save, every op it does not
    # cache, whatever the plan rebuilds (ss.checkpoint_graph; formulations/step-model.md,
    # "Decisions")
    rerun_with: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Tensor:
    """An op output. ``saved_for`` names the ops whose backward reads it (empty: not saved).

    Tensors sharing a ``group`` (random ops drawing from one RNG stream) are recomputed all
    together or not at all. ``alive_until`` names the last forward op during which the model
    itself still holds the tensor when that is later than its last reader (a Python variable
    alive to the end of a function): the profiler observes it, and no plan can free it sooner.
    ``rebuilt_before`` names the op before whose backward the tensor is rebuilt when a plan
    recomputes it, at the latest (torch's checkpoint reruns a region at its first backward op,
    ``ss.checkpoint_graph``); None: any position up to its first use.
    """

    name: str
    bytes: int
    saved_for: tuple[str, ...] = ()
    group: str | None = None
    alive_until: str | None = None
    rebuilt_before: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)


def _where(kind: str, name: str) -> str:
    return f"{kind} {name!r}"


def _check_time(value: Any, where: str, fieldname: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GraphError(f"{where}: {fieldname} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise GraphError(f"{where}: {fieldname} must be finite and >= 0, got {value!r}")
    return value


def _check_bytes(value: Any, where: str, fieldname: str) -> int:
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


def _check_unit(value, where: str) -> str:
    if not isinstance(value, str):
        raise GraphError(
            f"{where}: unit must be a string (a sharding unit's module path), got {value!r}"
        )
    return value


def _check_bool(value: Any, where: str, fieldname: str) -> bool:
    if not isinstance(value, bool):
        raise GraphError(
            f"{where}: {fieldname} must be true or false (a JSON boolean), got {value!r}"
        )
    return value


def _names(value: Any, where: str, fieldname: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise GraphError(f"{where}: {fieldname} must be a list of names, got {value!r}")
    for item in value:
        if not isinstance(item, str):
            raise GraphError(f"{where}: {fieldname} must hold names (strings), got {item!r}")
    return tuple(value)


@dataclass(frozen=True)
class Collective:
    """One collective of the step (an all-gather or reduce-scatter of a sharded unit), issued
    when the forward (``phase`` "forward") or backward ("backward") of op ``op`` is reached. On a
    link it shares with the activation copies it sends ``d2h_bytes`` and receives ``h2d_bytes``
    (formulations/step-model.md, "Collectives on the copy lanes")."""

    name: str
    op: str
    phase: str
    d2h_bytes: int = 0
    h2d_bytes: int = 0


@dataclass(frozen=True)
class ActivationGraph:
    """A profiled or analytic training step. Build with :func:`load_graph` or the constructor.

    ``collectives``: the step's communication (FSDP all-gathers, reduce-scatters) that crosses the
    host link when the hardware says so (``Hardware.collectives_on_link``)."""

    name: str
    ops: tuple[Op, ...]
    tensors: tuple[Tensor, ...]
    optimizer_s: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)
    collectives: tuple[Collective, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "tensors", tuple(self.tensors))
        object.__setattr__(self, "collectives", tuple(self.collectives))
        self._check()

    # ---------------------------------------------------------------- checking
    def _check(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise GraphError(f"graph: name must be a non-empty string, got {self.name!r}")
        _check_time(self.optimizer_s, "graph", "optimizer_s")
        if not self.ops:
            raise GraphError(f"graph {self.name!r}: it has no ops")
        op_index: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            where = _where("op", op.name)
            if not isinstance(op.name, str) or not op.name:
                raise GraphError(f"op #{i}: name must be a non-empty string, got {op.name!r}")
            if op.name in op_index:
                raise GraphError(f"{where}: duplicate op name")
            op_index[op.name] = i
            _check_time(op.forward_s, where, "forward_s")
            _check_time(op.backward_s, where, "backward_s")
            _check_bytes(op.forward_workspace_bytes, where, "forward_workspace_bytes")
            _check_bytes(op.backward_workspace_bytes, where, "backward_workspace_bytes")
            _check_bytes(op.rerun_workspace_bytes, where, "rerun_workspace_bytes")
            _check_bool(op.recomputable, where, "recomputable")
            _check_unit(op.unit, where)
            _check_unit(op.param_unit, where)
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
        for op in self.ops:
            for name in op.rerun_with:
                if name not in op_index or name == op.name:
                    raise GraphError(
                        f"{_where('op', op.name)}: rerun_with {name!r} is "
                        + ("the op itself" if name == op.name else "no op of the graph")
                    )
        tensor_index: dict[str, int] = {}
        for j, t in enumerate(self.tensors):
            where = _where("tensor", t.name)
            if not isinstance(t.name, str) or not t.name:
                raise GraphError(f"tensor #{j}: name must be a non-empty string, got {t.name!r}")
            if t.name in tensor_index:
                raise GraphError(f"{where}: duplicate tensor name")
            tensor_index[t.name] = j
            _check_bytes(t.bytes, where, "bytes")
        self._check_totals()
        names: set[str] = set()
        for c in self.collectives:
            if not isinstance(c, Collective):
                raise GraphError(
                    f"graph {self.name!r}: collectives must be Collective, got {type(c).__name__}"
                )
            where = _where("collective", c.name)
            if not isinstance(c.name, str) or not c.name or c.name in names:
                raise GraphError(f"{where}: name must be a non-empty, unique string")
            names.add(c.name)
            if c.op not in op_index:
                raise GraphError(f"{where}: op {c.op!r} is not an op of the graph")
            if c.phase not in PHASES:
                raise GraphError(f"{where}: phase must be one of {PHASES}, got {c.phase!r}")
            _check_bytes(c.d2h_bytes, where, "d2h_bytes")
            _check_bytes(c.h2d_bytes, where, "h2d_bytes")
        producer: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            for out in op.outputs:
                if out not in tensor_index:
                    raise GraphError(
                        f"op {op.name!r}: output {out!r} is not listed in tensors (its bytes are unknown)"
                    )
                if out in producer:
                    raise GraphError(
                        f"tensor {out!r}: produced by both op {self.ops[producer[out]].name!r} "
                        f"and op {op.name!r}"
                    )
                producer[out] = i
        for t in self.tensors:
            if t.name not in producer:
                raise GraphError(f"tensor {t.name!r}: no op produces it (unknown producer)")
        for i, op in enumerate(self.ops):
            for name in op.inputs:
                if name in producer and producer[name] >= i:
                    raise GraphError(
                        f"op {op.name!r}: reads tensor {name!r} before it is produced "
                        f"(by op {self.ops[producer[name]].name!r}); the op order has a cycle "
                        "or is not a forward order"
                    )
        for t in self.tensors:
            where = _where("tensor", t.name)
            p = producer[t.name]
            if len(set(t.saved_for)) != len(t.saved_for):
                raise GraphError(f"{where}: saved_for lists an op twice")
            for opname in t.saved_for:
                if opname not in op_index:
                    raise GraphError(f"{where}: saved_for names unknown op {opname!r}")
                i = op_index[opname]
                if i != p and t.name not in self.ops[i].inputs:
                    raise GraphError(
                        f"{where}: saved_for names op {opname!r}, which neither produces nor reads it"
                    )
            if t.alive_until is not None:
                if t.alive_until not in op_index:
                    raise GraphError(f"{where}: alive_until names unknown op {t.alive_until!r}")
                if op_index[t.alive_until] < p:
                    raise GraphError(
                        f"{where}: alive_until names op {t.alive_until!r}, which runs "
                        f"before its producer {self.ops[p].name!r}"
                    )
            if t.rebuilt_before is not None:
                if t.rebuilt_before not in op_index:
                    raise GraphError(
                        f"{where}: rebuilt_before names unknown op {t.rebuilt_before!r}"
                    )
                if not t.saved_for:
                    raise GraphError(f"{where}: rebuilt_before is set, but the tensor is not saved")
                first = max(op_index[o] for o in t.saved_for)
                if op_index[t.rebuilt_before] < first:
                    raise GraphError(
                        f"{where}: rebuilt_before names op {t.rebuilt_before!r}, whose backward runs "
                        f"after the tensor's first backward use (op {self.ops[first].name!r})"
                    )

    def _check_totals(self) -> None:
        """Sums that every planner and the simulator form must stay exact and finite: refuse,
        naming the tensor or op at which the running total passes the limit."""
        total = max(
            (max(op.forward_workspace_bytes, op.backward_workspace_bytes) for op in self.ops),
            default=0,
        )
        for t in self.tensors:
            total += int(t.bytes)
            if total > MAX_TOTAL_BYTES:
                raise GraphError(
                    f"tensor {t.name!r}: the step's bytes pass {MAX_TOTAL_BYTES} with "
                    "it (with the largest workspace): sums would not be exact"
                )
        seconds = float(self.optimizer_s)
        for op in self.ops:
            seconds += float(op.forward_s) * 2 + float(op.backward_s)  # a rerun runs forward again
            if not seconds <= MAX_TOTAL_SECONDS:
                raise GraphError(
                    f"op {op.name!r}: the step's time passes {MAX_TOTAL_SECONDS:g} s "
                    "with it: times must be seconds, and finite in sum"
                )

    # ---------------------------------------------------------------- (de)serialisation
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ActivationGraph:
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
            where = _where("op", raw.get("name", f"#{i}"))
            for key in ("name", "forward_s", "backward_s"):
                if key not in raw:
                    raise GraphError(f"{where}: missing field {key!r}")
            ops.append(
                Op(
                    name=raw["name"],
                    forward_s=_check_time(raw["forward_s"], where, "forward_s"),
                    backward_s=_check_time(raw["backward_s"], where, "backward_s"),
                    inputs=_names(raw.get("inputs", []), where, "inputs"),
                    outputs=_names(raw.get("outputs", []), where, "outputs"),
                    forward_workspace_bytes=_check_bytes(
                        raw.get("forward_workspace_bytes", 0), where, "forward_workspace_bytes"
                    ),
                    backward_workspace_bytes=_check_bytes(
                        raw.get("backward_workspace_bytes", 0), where, "backward_workspace_bytes"
                    ),
                    recomputable=_check_bool(raw.get("recomputable", True), where, "recomputable"),
                    rerun_workspace_bytes=_check_bytes(
                        raw.get("rerun_workspace_bytes", 0), where, "rerun_workspace_bytes"
                    ),
                    unit=_check_unit(raw.get("unit", ""), where),
                    param_unit=_check_unit(raw.get("param_unit", ""), where),
                    writes=_names(raw.get("writes", []), where, "writes"),
                    rerun_with=_names(raw.get("rerun_with", []), where, "rerun_with"),
                    extra={k: v for k, v in raw.items() if k not in _OP_FIELDS},
                )
            )
        tensors = []
        for j, raw in enumerate(data["tensors"]):
            if not isinstance(raw, Mapping):
                raise GraphError(f"tensor #{j}: expected an object, got {raw!r}")
            where = _where("tensor", raw.get("name", f"#{j}"))
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
                    bytes=_check_bytes(raw["bytes"], where, "bytes"),
                    saved_for=_names(raw.get("saved_for", []), where, "saved_for"),
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
            where = _where("collective", raw.get("name", f"#{j}"))
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
                    d2h_bytes=_check_bytes(raw.get("d2h_bytes", 0), where, "d2h_bytes"),
                    h2d_bytes=_check_bytes(raw.get("h2d_bytes", 0), where, "h2d_bytes"),
                )
            )
        return cls(
            name=data["name"],
            ops=tuple(ops),
            tensors=tuple(tensors),
            optimizer_s=_check_time(data.get("optimizer_s", 0.0), "graph", "optimizer_s"),
            extra={k: v for k, v in data.items() if k not in _GRAPH_FIELDS},
            collectives=tuple(collectives),
        )

    def to_dict(self) -> dict[str, Any]:
        ops = []
        for op in self.ops:
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
            ops.append(d)
        tensors = []
        for t in self.tensors:
            d = dict(t.extra)
            d.update(name=t.name, bytes=t.bytes, saved_for=list(t.saved_for))
            if t.group is not None:
                d["group"] = t.group
            if t.alive_until is not None:
                d["alive_until"] = t.alive_until
            if t.rebuilt_before is not None:
                d["rebuilt_before"] = t.rebuilt_before
            tensors.append(d)
        out: dict[str, Any] = dict(self.extra)
        out.update(
            format=GRAPH_FORMAT,
            name=self.name,
            ops=ops,
            tensors=tensors,
            optimizer_s=self.optimizer_s,
        )
        if self.collectives:
            out["collectives"] = [
                {
                    "name": c.name,
                    "op": c.op,
                    "phase": c.phase,
                    "d2h_bytes": c.d2h_bytes,
                    "h2d_bytes": c.h2d_bytes,
                }
                for c in self.collectives
            ]
        return out

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @cached_property
    def digest(self) -> str:
        """sha256 of the graph's content (names, times, bytes, saved_for), not its extras."""
        return self._content_digest(times=True)

    @cached_property
    def structure_digest(self) -> str:
        """sha256 of the graph's content without its times: equal for a fake profile and a real
        one of the same model, inputs and device."""
        return self._content_digest(times=False)

    def _content_digest(self, times: bool) -> str:
        def timed(o: Op) -> list:
            return [o.forward_s, o.backward_s] if times else []

        core = {
            # unit only where set, so graphs without units keep their digests
            "ops": [
                [
                    o.name,
                    *timed(o),
                    list(o.inputs),
                    list(o.outputs),
                    o.forward_workspace_bytes,
                    o.backward_workspace_bytes,
                    o.recomputable,
                ]
                + ([o.unit, o.param_unit] if o.unit or o.param_unit else [])
                + ([{"writes": list(o.writes)}] if o.writes else [])
                + ([{"rerun_with": list(o.rerun_with)}] if o.rerun_with else [])
                + (
                    [{"rerun_workspace_bytes": o.rerun_workspace_bytes}]
                    if o.rerun_workspace_bytes
                    else []
                )
                for o in self.ops
            ],
            # alive_until only where set, so graphs without it keep their digests
            "tensors": [
                [t.name, t.bytes, list(t.saved_for), t.group]
                + ([t.alive_until] if t.alive_until is not None else [])
                + ([{"rebuilt_before": t.rebuilt_before}] if t.rebuilt_before else [])
                for t in self.tensors
            ],
            **({"optimizer_s": self.optimizer_s} if times else {}),
        }
        if self.collectives:  # only where present, so graphs without keep their digests
            core["collectives"] = [
                [c.name, c.op, c.phase, c.d2h_bytes, c.h2d_bytes] for c in self.collectives
            ]
        text = json.dumps(core, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    # ---------------------------------------------------------------- derived columns
    @property
    def n_ops(self) -> int:
        return len(self.ops)

    @property
    def n_slots(self) -> int:
        """Positions of the step: forward op i at i, backward of op i at 2n-1-i."""
        return 2 * len(self.ops)

    def bwd_slot(self, op: int) -> int:
        return 2 * len(self.ops) - 1 - op

    @cached_property
    def op_index(self) -> dict[str, int]:
        return {op.name: i for i, op in enumerate(self.ops)}

    @cached_property
    def tensor_index(self) -> dict[str, int]:
        return {t.name: j for j, t in enumerate(self.tensors)}

    @cached_property
    def tensor_bytes(self) -> np.ndarray:
        return np.array([t.bytes for t in self.tensors], dtype=np.int64)

    @cached_property
    def forward_s(self) -> np.ndarray:
        return np.array([op.forward_s for op in self.ops], dtype=float)

    @cached_property
    def backward_s(self) -> np.ndarray:
        return np.array([op.backward_s for op in self.ops], dtype=float)

    @cached_property
    def forward_ws(self) -> np.ndarray:
        return np.array([op.forward_workspace_bytes for op in self.ops], dtype=np.int64)

    @cached_property
    def backward_ws(self) -> np.ndarray:
        return np.array([op.backward_workspace_bytes for op in self.ops], dtype=np.int64)

    @cached_property
    def rerun_ws(self) -> np.ndarray:
        """Per op, what a rebuild at its backward position holds beside the rerun op's own
        workspace (Op.rerun_workspace_bytes)."""
        return np.array([op.rerun_workspace_bytes for op in self.ops], dtype=np.int64)

    @cached_property
    def producer(self) -> np.ndarray:
        prod = np.zeros(len(self.tensors), dtype=np.int64)
        for i, op in enumerate(self.ops):
            for out in op.outputs:
                prod[self.tensor_index[out]] = i
        return prod

    @cached_property
    def op_inputs(self) -> tuple[tuple[int, ...], ...]:
        """Graph-tensor inputs of each op (names that are not graph tensors are dropped)."""
        ti = self.tensor_index
        return tuple(tuple(ti[n] for n in op.inputs if n in ti) for op in self.ops)

    @cached_property
    def op_writes(self) -> tuple[frozenset[int], ...]:
        """Graph tensors each op writes in place."""
        ti = self.tensor_index
        return tuple(frozenset(ti[n] for n in op.writes if n in ti) for op in self.ops)

    @cached_property
    def writers(self) -> tuple[tuple[int, ...], ...]:
        """Per tensor, the ops that write it in place, in forward order."""
        out: list[list[int]] = [[] for _ in self.tensors]
        for i, ws in enumerate(self.op_writes):
            for t in ws:
                out[t].append(i)
        return tuple(tuple(x) for x in out)

    @cached_property
    def op_outputs(self) -> tuple[tuple[int, ...], ...]:
        ti = self.tensor_index
        return tuple(tuple(ti[n] for n in op.outputs) for op in self.ops)

    @cached_property
    def last_forward_use(self) -> np.ndarray:
        """Index of the last forward op each tensor is alive at: its last reader (its producer if
        none), or its ``alive_until`` op when the model holds it longer."""
        last = self.producer.copy()
        for i, ins in enumerate(self.op_inputs):
            for t in ins:
                last[t] = max(last[t], i)
        for j, t in enumerate(self.tensors):
            if t.alive_until is not None:
                last[j] = max(last[j], self.op_index[t.alive_until])
        return last

    @cached_property
    def saved_for_index(self) -> tuple[tuple[int, ...], ...]:
        oi = self.op_index
        return tuple(tuple(sorted(oi[n] for n in t.saved_for)) for t in self.tensors)

    @cached_property
    def is_saved(self) -> np.ndarray:
        return np.array([bool(t.saved_for) for t in self.tensors], dtype=bool)

    @cached_property
    def saved(self) -> np.ndarray:
        """Indices of saved tensors, in graph order: the tensors a plan decides on."""
        return np.flatnonzero(self.is_saved)

    @cached_property
    def rebuild_slot(self) -> np.ndarray:
        """Per tensor, the latest position at which it may be rebuilt when recomputed (the
        backward of its ``rebuilt_before`` op), or -1: up to its first use."""
        return np.array(
            [
                self.bwd_slot(self.op_index[t.rebuilt_before]) if t.rebuilt_before else -1
                for t in self.tensors
            ],
            dtype=np.int64,
        )

    @cached_property
    def first_backward_use(self) -> np.ndarray:
        """Forward index of the op whose backward reads each saved tensor first (max of saved_for)."""
        return np.array([max(s) if s else -1 for s in self.saved_for_index], dtype=np.int64)

    @cached_property
    def last_backward_use(self) -> np.ndarray:
        """Forward index of the op whose backward reads each saved tensor last (min of saved_for)."""
        return np.array([min(s) if s else -1 for s in self.saved_for_index], dtype=np.int64)

    @cached_property
    def rng_groups(self) -> dict[str, tuple[int, ...]]:
        """Saved tensors by RNG group (recomputed all together or not at all), graph order."""
        groups: dict[str, list[int]] = {}
        for t in self.saved:
            g = self.tensors[int(t)].group
            if g is not None:
                groups.setdefault(g, []).append(int(t))
        return {g: tuple(members) for g, members in groups.items()}

    def group_of(self, t: int) -> tuple[int, ...]:
        """The saved tensors recomputed together with ``t`` (``t`` alone if it has no group)."""
        g = self.tensors[t].group
        return self.rng_groups.get(g, (t,)) if g is not None else (t,)

    @cached_property
    def ideal_step_time_s(self) -> float:
        return float(self.forward_s.sum() + self.backward_s.sum() + self.optimizer_s)

    @cached_property
    def saved_by_op(self) -> tuple[tuple[int, ...], ...]:
        """For each op, the saved tensors its backward reads."""
        out: list[list[int]] = [[] for _ in self.ops]
        for t, ops in enumerate(self.saved_for_index):
            for i in ops:
                out[i].append(t)
        return tuple(tuple(x) for x in out)

    @cached_property
    def rerun_ops(self) -> tuple[tuple[int, ...], ...]:
        """Ops that must run again to rebuild each tensor: its producer and, through tensors that
        are not saved, their producers (forward order)."""
        return self._closures[0]

    @cached_property
    def rerun_frontier(self) -> tuple[tuple[int, ...], ...]:
        """Saved tensors that those reruns read: they must be on the device when the rebuild runs."""
        return self._closures[1]

    @cached_property
    def can_recompute(self) -> np.ndarray:
        """Whether every op a tensor's rebuild needs may run again, where the rebuild may run."""
        return np.array(
            [self.recompute_blocker(t) is None for t in range(len(self.tensors))], dtype=bool
        )

    def recompute_blocker(self, t: int) -> str | None:
        """Why tensor ``t`` cannot be rebuilt (an op that may not run again, or one whose
        sharded parameters are not gathered where the rebuild may run), or None."""
        for i in self.rerun_ops[t]:
            if not self.ops[i].recomputable:
                return f"op {self.ops[i].name!r} may not run again"
        if self.has_units:
            units = self._units_and_blocked[0][t]
            for i in self.rerun_ops[t]:
                unit = self.ops[i].param_unit
                if unit and any(u != unit for u in units):
                    where = sorted(u or "outside any unit" for u in units if u != unit)[0]
                    return (
                        f"op {self.ops[i].name!r} reads the parameters of sharding unit "
                        f"{unit!r}, which are not gathered in the backward of {where!r} "
                        "where the rebuild may run"
                    )
        return None

    @cached_property
    def op_position(self) -> dict[str, int]:
        """Forward index of every op, by name."""
        return {op.name: i for i, op in enumerate(self.ops)}

    def collective_slot(self, c: Collective) -> int:
        """The position at which collective ``c`` is issued."""
        i = self.op_position[c.op]
        return i if c.phase == "forward" else self.bwd_slot(i)

    @cached_property
    def has_units(self) -> bool:
        return any(op.param_unit for op in self.ops)

    @property
    def rebuild_units(self) -> tuple[frozenset[str], ...]:
        """For each saved tensor, the units in whose backward its rebuild may run: its first
        backward reader's, and (nested) those of every rebuildable tensor whose rebuild may need
        it (step-model.md, "Sharded parameters")."""
        return self._units_and_blocked[0]

    @cached_property
    def _units_and_blocked(self) -> tuple[tuple[frozenset[str], ...], frozenset[int]]:
        # Blocked tensors are never rebuilt, so they rebuild nothing nested. Start from the ops
        # that may not run again; block what the propagated units forbid; propagate again from
        # the tensors still rebuildable; repeat. The blocked set only grows, so it ends, and at
        # the end every rebuildable tensor is compatible with every unit that can pull it in.
        first = self.first_backward_use
        saved = [int(y) for y in self.saved]
        needs: dict[int, set[int]] = {}
        for y in saved:
            needs[y] = {int(x) for x in self.rerun_frontier[y]}
            needs[y] |= {
                int(o)
                for q in self.rerun_ops[y]
                for o in self.op_outputs[q]
                if o != y and self.is_saved[o]
            }
        blocked = {y for y in saved if not all(self.ops[q].recomputable for q in self.rerun_ops[y])}
        while True:
            units = [
                {self.ops[int(first[t])].unit} if first[t] >= 0 else set()
                for t in range(len(self.tensors))
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
                    self.ops[q].param_unit and any(u != self.ops[q].param_unit for u in units[t])
                    for q in self.rerun_ops[t]
                )
            }
            if not more:
                return tuple(frozenset(u) for u in units), frozenset(blocked)
            blocked |= more

    @cached_property
    def _closures(self) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
        saved = self.is_saved.tolist()
        producer = self.producer.tolist()
        writers = self.writers
        written = self.op_writes
        op_closure: dict[int, tuple[frozenset, frozenset]] = {}
        # the closure of op i's write of tensor t: the op and what its other reads need
        write_closure: dict[int, tuple[frozenset, frozenset]] = {}

        def tensor_closure(t: int, before: int) -> tuple[set, set]:
            """What rebuilding tensor t as op ``before`` reads it needs: its producer's closure,
            then the closures of the writes to it made before that op."""
            ops, frontier = set(op_closure[producer[t]][0]), set(op_closure[producer[t]][1])
            for w in writers[t]:
                if w < before:
                    ops |= write_closure[w][0]
                    frontier |= write_closure[w][1]
            return ops, frontier

        # op closures in forward order, so inputs' closures already exist
        for i, ins in enumerate(self.op_inputs):
            ops = {i}
            frontier = set()
            own = {i}
            own_frontier: set = set()
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
        rerun_with = self.op_rerun_with
        if any(rerun_with):
            # an op that runs again brings the ops it reruns with (Op.rerun_with), each with its
            # own closure: once over the whole set, so a rebuild runs each op once
            base = dict(op_closure)
            for i, (ops, frontier) in base.items():
                more = [base[r] for q in ops for r in rerun_with[q]]
                if more:
                    op_closure[i] = (
                        ops.union(*(m[0] for m in more)),
                        frontier.union(*(m[1] for m in more)),
                    )
            for i in list(write_closure):
                ops, frontier = write_closure[i]
                more = [base[r] for q in ops for r in rerun_with[q]]
                if more:
                    write_closure[i] = (
                        ops.union(*(m[0] for m in more)),
                        frontier.union(*(m[1] for m in more)),
                    )
        sorted_closure = {
            i: (tuple(sorted(ops)), tuple(sorted(fr))) for i, (ops, fr) in op_closure.items()
        }
        per_tensor = []
        end = len(self.ops)
        for t, p in enumerate(producer):
            if writers[t]:
                ops, frontier = tensor_closure(t, end)
                frontier.discard(t)
                per_tensor.append((tuple(sorted(ops)), tuple(sorted(frontier))))
            elif any(rerun_with) and t in op_closure[p][1]:
                # an op it reruns with reads it: the rerun makes it first
                ops, frontier = sorted_closure[p]
                per_tensor.append((ops, tuple(f for f in frontier if f != t)))
            else:
                per_tensor.append(sorted_closure[p])
        return tuple(c[0] for c in per_tensor), tuple(c[1] for c in per_tensor)

    @cached_property
    def op_rerun_with(self) -> tuple[tuple[int, ...], ...]:
        """Per op, the ops that run again with it (Op.rerun_with), as indices."""
        index = self.op_index
        return tuple(tuple(index[n] for n in op.rerun_with) for op in self.ops)

    def summary(self) -> str:
        return (
            f"{self.name}: {self.n_ops} ops, {len(self.tensors)} tensors, "
            f"{len(self.saved)} saved ({self.tensor_bytes[self.saved].sum() / 2**30:.2f} GiB)"
        )


def load_graph(source: str | Path | Mapping[str, Any] | ActivationGraph) -> ActivationGraph:
    """Load a graph from a JSON file path, a JSON text, or a dict; check every rule."""
    if isinstance(source, ActivationGraph):
        return source
    if isinstance(source, Mapping):
        return ActivationGraph.from_dict(source)
    text = read_json_source(source, "graph", GraphError)
    return ActivationGraph.from_dict(parse_json(text, "graph", GraphError))


def read_json_source(source: str | Path, what: str, error: type[Exception]) -> str:
    """The JSON text of ``source``: a path (str or Path) to a file, or JSON text itself (a string
    starting with "{" or "["). Anything else is refused by name, never taken as a file name."""
    if not isinstance(source, (str, Path)):
        raise error(f"{what}: expected a path, JSON text or a dict, got {type(source).__name__}")
    if isinstance(source, str) and source.lstrip()[:1] in ("{", "["):
        return source
    text = str(source)
    if isinstance(source, str) and ("\n" in text or len(text) > 4096):
        raise error(f"{what}: not JSON (it does not start with '{{') and not a file name")
    path = Path(text)
    try:
        if not path.is_file():
            raise error(f"{what} file {text!r} does not exist")
        return path.read_text()
    except OSError as exc:
        raise error(f"{what} file {text!r} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise error(f"{what} file {text!r} is not text (UTF-8)") from None


def parse_json(text: str, what: str, error: type[Exception]) -> Any:
    """JSON text as Python data; malformed or absurdly nested text, and an object that gives a
    key twice (JSON would keep the last silently: a decision given twice), are refused by
    name."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise error(
                    f"{what}: key {key!r} is given twice in one object (JSON would keep "
                    "the last silently)"
                )
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        raise error(f"{what}: not valid JSON ({exc})") from None
    except RecursionError:
        raise error(f"{what}: JSON nested too deeply to be a {what}") from None
