"""Plans: a decision per saved tensor, the complete schedule, the hardware, how the planner fared.

A plan is data. It names its graph by digest, so it cannot be applied to another graph by mistake,
and it is closed: the positions of every copy and rebuild and the hardware they were planned for
travel with it, so nothing downstream (checker, simulator, executor) plans again.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import IntEnum
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .errors import PlanError
from .hardware import Hardware
from .status import PLAN_STATUSES, Status

if TYPE_CHECKING:
    from .graph import ActivationGraph

PLAN_FORMAT = "slackswap.plan/2"
PLAN_FORMATS = ("slackswap.plan/1", PLAN_FORMAT)  # /1: no hardware, schedule optional
DECISIONS = ("keep", "swap", "recompute")
STATUSES = PLAN_STATUSES  # what info.status may be (core/status.py)

# "optimal" means: the plan's step is proven within OVERHEAD_TARGET of its overhead (step time
# less the ideal step, what the user pays) of a valid bound, or within STEP_FLOOR of the step,
# whichever is larger (so a plan with no overhead is still provable)
OVERHEAD_TARGET = 0.01
STEP_FLOOR = 1e-5


def proof_tolerance_s(step_s: float, ideal_s: float, target: float = OVERHEAD_TARGET) -> float:
    """How far above a valid bound a plan of ``step_s`` may be and still be called optimal
    (``target`` 0: not at all)."""
    if target <= 0:
        return 0.0
    return max(target * max(step_s - ideal_s, 0.0), STEP_FLOOR * step_s)


def overhead_gap(step_s: float, ideal_s: float, bound_s: float | None) -> float | None:
    """(step - bound) / overhead, the overhead being step - ideal (at least STEP_FLOOR of the
    step, so a plan with no overhead has a finite gap): what is left to prove of what the user
    pays. None without a bound."""
    if bound_s is None or not math.isfinite(step_s):
        return None
    overhead = max(step_s - ideal_s, STEP_FLOOR * step_s)
    return max(0.0, step_s - bound_s) / overhead if overhead > 0 else 0.0


class Decision(IntEnum):
    """What a plan does with one tensor; the value is the code in numpy decision columns."""

    UNSAVED = -1  # not saved for backward: it takes no decision
    KEEP = 0
    SWAP = 1
    RECOMPUTE = 2

    @property
    def label(self) -> str:
        """The word plans use in JSON ("keep", "swap", "recompute")."""
        return DECISIONS[self.value]

    @classmethod
    def of(cls, label: str) -> Decision:
        try:
            return cls(DECISIONS.index(label))
        except ValueError:
            raise PlanError(f"decision {label!r}: expected one of {DECISIONS}") from None


# the codes as plain ints for numpy columns (numpy compares an IntEnum member far more slowly)
UNSAVED, KEEP, SWAP, RECOMPUTE = (
    int(d) for d in (Decision.UNSAVED, Decision.KEEP, Decision.SWAP, Decision.RECOMPUTE)
)


@dataclass(frozen=True)
class Schedule:
    """When each swap's copies happen and where each recompute runs, as step positions.

    Positions: forward op i is at i, the backward of op i at 2n-1-i (n ops).
    ``d2h_free``: the position after which a swapped tensor leaves the device (its offload must
    be done by then, else the next op waits). ``h2d_issue``: the position at whose start its
    prefetch is issued. ``recompute_at``: the position before whose backward a recomputed tensor is
    rebuilt (never later than its first use).
    """

    d2h_free: Mapping[str, int] = field(default_factory=dict)
    h2d_issue: Mapping[str, int] = field(default_factory=dict)
    recompute_at: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("d2h_free", "h2d_issue", "recompute_at"):
            raw = getattr(self, name)
            if not isinstance(raw, Mapping):
                raise PlanError(f"schedule: {name} must be an object of tensor -> position")
            clean = {}
            for tensor, pos in raw.items():
                if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0:
                    raise PlanError(
                        f"schedule: {name}[{tensor!r}] must be a non-negative integer position, got {pos!r}"
                    )
                clean[str(tensor)] = int(pos)
            object.__setattr__(self, name, MappingProxyType(clean))

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {
            "d2h_free": dict(self.d2h_free),
            "h2d_issue": dict(self.h2d_issue),
            "recompute_at": dict(self.recompute_at),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        if not isinstance(data, Mapping):
            raise PlanError("plan: field 'schedule' must be an object")
        return cls(
            d2h_free=data.get("d2h_free", {}),
            h2d_issue=data.get("h2d_issue", {}),
            recompute_at=data.get("recompute_at", {}),
        )


@dataclass(frozen=True)
class SolveInfo:
    """How a planner fared; the same type whatever the planner, so rows compare directly."""

    solver: str
    status: Status  # a plain word is taken and turned into its Status
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    wall_s: float = 0.0
    predicted_step_time_s: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)
    # the proven distance to the bound as a fraction of the plan's overhead (its step time less
    # the ideal step), what the user pays; None without a bound
    overhead_gap: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.solver, str):
            raise PlanError(f"plan: info.solver must be a string, got {self.solver!r}")
        if self.status not in STATUSES:
            words = tuple(str(s) for s in STATUSES)
            raise PlanError(f"plan: info.status must be one of {words}, got {self.status!r}")
        object.__setattr__(self, "status", Status(self.status))
        for name in (
            "objective",
            "bound",
            "gap",
            "predicted_step_time_s",
            "wall_s",
            "overhead_gap",
        ):
            value = getattr(self, name)
            if value is None and name != "wall_s":
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or math.isnan(value)
                or value < 0
            ):
                raise PlanError(f"plan: info.{name} must be a non-negative number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.extra, Mapping):
            raise PlanError(f"plan: info extras must be an object, got {self.extra!r}")

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.extra)
        d.update(
            solver=self.solver,
            status=str(self.status),
            objective=self.objective,
            bound=self.bound,
            gap=self.gap,
            wall_s=self.wall_s,
            predicted_step_time_s=self.predicted_step_time_s,
        )
        if self.overhead_gap is not None:
            d["overhead_gap"] = self.overhead_gap
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SolveInfo:
        known = (
            "solver",
            "status",
            "objective",
            "bound",
            "gap",
            "wall_s",
            "predicted_step_time_s",
            "overhead_gap",
        )
        return cls(
            solver=data.get("solver", "unknown"),
            status=data.get("status", Status.FEASIBLE),
            objective=data.get("objective"),
            bound=data.get("bound"),
            gap=data.get("gap"),
            wall_s=data.get("wall_s", 0.0) or 0.0,
            predicted_step_time_s=data.get("predicted_step_time_s"),
            extra={k: v for k, v in data.items() if k not in known},
            overhead_gap=data.get("overhead_gap"),
        )


@dataclass(frozen=True)
class Plan:
    """keep / swap / recompute for every saved tensor of one graph, under one budget."""

    graph_name: str
    graph_digest: str
    budget_bytes: int
    decisions: Mapping[str, str]
    schedule: Schedule | None = None
    info: SolveInfo = field(
        default_factory=lambda: SolveInfo(solver="user", status=Status.FEASIBLE)
    )
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)
    hardware: Hardware | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.decisions, Mapping):
            raise PlanError("plan: decisions must be an object of tensor -> keep|swap|recompute")
        for tensor, decision in self.decisions.items():
            if decision not in DECISIONS:
                raise PlanError(
                    f"plan: tensor {tensor!r} has decision {decision!r}; expected one of {DECISIONS}"
                )
        object.__setattr__(self, "decisions", MappingProxyType(dict(self.decisions)))
        for name in ("graph_name", "graph_digest"):
            if not isinstance(getattr(self, name), str):
                raise PlanError(f"plan: {name} must be a string, got {getattr(self, name)!r}")
        if (
            isinstance(self.budget_bytes, bool)
            or not isinstance(self.budget_bytes, numbers.Integral)
            or self.budget_bytes < 0
        ):
            raise PlanError(
                f"plan: budget_bytes must be a non-negative integer, got {self.budget_bytes!r}"
            )
        object.__setattr__(self, "budget_bytes", int(self.budget_bytes))
        if not isinstance(self.info, SolveInfo):
            raise PlanError(f"plan: info must be a SolveInfo, got {self.info!r}")
        if self.hardware is not None and not isinstance(self.hardware, Hardware):
            raise PlanError(f"plan: hardware must be a slackswap.Hardware, got {self.hardware!r}")

    @property
    def is_complete(self) -> bool:
        """Closed: the hardware is named and every swap has its two copy positions and every
        recompute its rebuild position."""
        s = self.schedule
        if self.hardware is None or s is None:
            return False
        return all(
            (d != "swap" or (t in s.d2h_free and t in s.h2d_issue))
            and (d != "recompute" or t in s.recompute_at)
            for t, d in self.decisions.items()
        )

    def check_graph(self, graph: ActivationGraph) -> None:
        """Raise PlanError unless ``graph`` is the graph this plan was made for (by digest)."""
        if graph.digest != self.graph_digest:
            raise PlanError(
                f"plan was made for graph {self.graph_name!r} (digest "
                f"{self.graph_digest[:12]}), not for graph {graph.name!r} "
                f"(digest {graph.digest[:12]})"
            )

    def require_complete(self, what: str) -> None:
        """Raise PlanError naming ``what`` refused an open plan, and how to close it."""
        if not self.is_complete:
            lacks = "hardware" if self.hardware is None else "a complete schedule"
            raise PlanError(
                f"{what}: plan for graph {self.graph_name!r} has no {lacks}; plans "
                "from solve() are complete, a hand-made one is completed once with "
                "slackswap.complete(plan, graph, hw)"
            )

    def count(self, decision: str) -> int:
        return sum(1 for d in self.decisions.values() if d == decision)

    def tensors(self, decision: str) -> list[str]:
        return [t for t, d in self.decisions.items() if d == decision]

    def with_info(self, **changes: Any) -> Plan:
        data = self.info.to_dict()
        data.update(changes)
        return replace(self, info=SolveInfo.from_dict(data))

    def without_schedule(self) -> Plan:
        """The decisions alone (an open plan: schedule and hardware dropped)."""
        return replace(self, schedule=None, hardware=None)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        out.update(
            {
                "format": PLAN_FORMAT,
                "graph": self.graph_name,
                "graph_digest": self.graph_digest,
                "budget_bytes": self.budget_bytes,
                "decisions": dict(self.decisions),
            }
        )
        if self.schedule is not None:
            out["schedule"] = self.schedule.to_dict()
        if self.hardware is not None:
            out["hardware"] = self.hardware.to_dict()
        out["info"] = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in self.info.to_dict().items()
        }
        return out

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(indent=1))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        if not isinstance(data, Mapping):
            raise PlanError("plan: expected a JSON object")
        fmt = data.get("format")
        if fmt not in PLAN_FORMATS:
            raise PlanError(
                f"plan: field 'format' must be {PLAN_FORMAT!r} (or the older "
                f"{PLAN_FORMATS[0]!r}), got {fmt!r}"
            )
        required: tuple[str, ...] = ("graph", "graph_digest", "budget_bytes", "decisions")
        if fmt == PLAN_FORMAT:
            required += ("schedule", "hardware")
        for key in required:
            if key not in data:
                raise PlanError(f"plan: missing field {key!r}")
        for key in ("graph", "graph_digest"):
            if not isinstance(data[key], str):
                raise PlanError(f"plan: field {key!r} must be a string, got {data[key]!r}")
        info = data.get("info", {})
        if not isinstance(info, Mapping):
            raise PlanError(f"plan: field 'info' must be an object, got {info!r}")
        known = {
            "format",
            "graph",
            "graph_digest",
            "budget_bytes",
            "decisions",
            "schedule",
            "info",
            "hardware",
        }
        schedule = data.get("schedule")
        hw = data.get("hardware")
        if hw is not None:
            if not isinstance(hw, Mapping):
                raise PlanError(f"plan: field 'hardware' must be an object, got {hw!r}")
            try:
                hw = Hardware.from_dict(dict(hw))
            except (TypeError, ValueError) as exc:
                raise PlanError(f"plan: field 'hardware': {exc}") from None
        plan = cls(
            graph_name=data["graph"],
            graph_digest=data["graph_digest"],
            budget_bytes=data["budget_bytes"],
            decisions=data["decisions"],
            schedule=None if schedule is None else Schedule.from_dict(schedule),
            info=SolveInfo.from_dict(info),
            extra={k: v for k, v in data.items() if k not in known},
            hardware=hw,
        )
        if fmt == PLAN_FORMAT and not plan.is_complete:
            raise PlanError(
                f"plan: format {PLAN_FORMAT!r} needs a complete schedule (a position "
                "for every swap's d2h_free and h2d_issue and every recompute_at)"
            )
        return plan


def read_plan(source: str | Path | Mapping[str, Any] | Plan) -> Plan:
    """A plan from a path, JSON text or dict, as written: a ``/1`` plan may be open."""
    from .graph import parse_json, read_json_source

    if isinstance(source, Plan):
        return source
    if isinstance(source, Mapping):
        return Plan.from_dict(source)
    return Plan.from_dict(
        parse_json(read_json_source(source, "plan", PlanError), "plan", PlanError)
    )
