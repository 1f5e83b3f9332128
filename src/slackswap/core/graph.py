"""The activation graph: ops in forward order, the tensors they produce, and who saves what.

Loading checks every rule of formulations/step-model.md that a graph alone can break, so that
planners never see a malformed graph. Unknown JSON fields are kept (``extra``) and written back.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from .errors import GraphError
from .graph_rules import MAX_TOTAL_BYTES, MAX_TOTAL_SECONDS, PHASES  # noqa: F401 - re-exported

GRAPH_FORMAT = "slackswap.graph/1"


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
    # where an executor that runs only hooks can act (formulations/step-model.md, "Hook
    # positions"): ``hook_after``, a saved-tensor hook runs between this op's forward and the
    # next op's; ``hook_backward``, the op's autograd node unpacks a saved tensor when its
    # backward begins (true of every op that saves one). The profiler records both; an analytic
    # graph, whose executor is not a hook, may act anywhere (both true)
    hook_after: bool = True
    hook_backward: bool = True
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
        from .graph_rules import check_graph

        check_graph(self)

    # ---------------------------------------------------------------- (de)serialisation
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ActivationGraph:
        """A graph from its JSON object (core/graph_json.py)."""
        from .graph_json import graph_from_dict

        return graph_from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The graph's JSON object (core/graph_json.py)."""
        from .graph_json import graph_to_dict

        return graph_to_dict(self)

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
        def timed(o: Op) -> list[float]:
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
                # hook positions only where an op has none, so analytic graphs keep digests
                + ([{"hook_after": False}] if not o.hook_after else [])
                + ([{"hook_backward": False}] if not o.hook_backward else [])
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
    def n_positions(self) -> int:
        """Positions of the step: forward op i at i, backward of op i at 2n-1-i."""
        return 2 * len(self.ops)

    def bwd_position(self, op: int) -> int:
        return 2 * len(self.ops) - 1 - op

    @cached_property
    def hook_positions(self) -> np.ndarray:
        """Per position, whether an executor that runs only hooks can act at its start
        (formulations/step-model.md, "Hook positions"): the forward's first op (the model's
        forward hook), forward op k after op k-1's ``hook_after``, the backward's first
        position (the backward call) and the backward of op i where its ``hook_backward``."""
        n = len(self.ops)
        at = np.ones(2 * n, dtype=bool)
        at[1:n] = [op.hook_after for op in self.ops[:-1]]
        at[n + 1 :] = [op.hook_backward for op in reversed(self.ops[:-1])]
        return at

    @cached_property
    def hooked_everywhere(self) -> bool:
        """Every position is a hook position (an analytic graph): no schedule is restricted."""
        return bool(self.hook_positions.all())

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
        for j, tensor in enumerate(self.tensors):
            if tensor.alive_until is not None:
                last[j] = max(last[j], self.op_index[tensor.alive_until])
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
    def rebuild_position(self) -> np.ndarray:
        """Per tensor, the latest position at which it may be rebuilt when recomputed (the
        backward of its ``rebuilt_before`` op), or -1: up to its first use."""
        return np.array(
            [
                self.bwd_position(self.op_index[t.rebuilt_before]) if t.rebuilt_before else -1
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

    def collective_position(self, c: Collective) -> int:
        """The position at which collective ``c`` is issued."""
        i = self.op_position[c.op]
        return i if c.phase == "forward" else self.bwd_position(i)

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
        from .closures import units_and_blocked

        return units_and_blocked(self)

    @cached_property
    def _closures(self) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
        from .closures import rerun_closures

        return rerun_closures(self)

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
    """Load a graph from a JSON file path, a JSON text, or a dict; check every rule.

    Args:
        source: a path to a graph file, its JSON text, its dict, or a graph (returned as it is).

    Returns:
        The graph, every rule of formulations/step-model.md checked.

    Raises:
        GraphError: a malformed graph, naming the op, tensor or field at fault.
    """
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
