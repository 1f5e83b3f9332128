"""Plans: a decision per saved tensor, an optional schedule, and how the planner fared.

A plan is data. It names its graph by digest, so it cannot be applied to another graph by mistake.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .errors import PlanError

PLAN_FORMAT = "slackswap.plan/1"
DECISIONS = ("keep", "swap", "recompute")
KEEP, SWAP, RECOMPUTE = 0, 1, 2
STATUSES = ("optimal", "feasible", "timeout", "heuristic", "baseline")


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
        return {"d2h_free": dict(self.d2h_free), "h2d_issue": dict(self.h2d_issue),
                "recompute_at": dict(self.recompute_at)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        if not isinstance(data, Mapping):
            raise PlanError("plan: field 'schedule' must be an object")
        return cls(d2h_free=data.get("d2h_free", {}), h2d_issue=data.get("h2d_issue", {}),
                   recompute_at=data.get("recompute_at", {}))


@dataclass(frozen=True)
class SolveInfo:
    """How a planner fared; the same type whatever the planner, so rows compare directly."""

    solver: str
    status: str
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    wall_s: float = 0.0
    predicted_step_time_s: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.extra)
        d.update(solver=self.solver, status=self.status, objective=self.objective,
                 bound=self.bound, gap=self.gap, wall_s=self.wall_s,
                 predicted_step_time_s=self.predicted_step_time_s)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SolveInfo:
        known = ("solver", "status", "objective", "bound", "gap", "wall_s", "predicted_step_time_s")
        return cls(solver=str(data.get("solver", "unknown")), status=str(data.get("status", "feasible")),
                   objective=data.get("objective"), bound=data.get("bound"), gap=data.get("gap"),
                   wall_s=float(data.get("wall_s", 0.0) or 0.0),
                   predicted_step_time_s=data.get("predicted_step_time_s"),
                   extra={k: v for k, v in data.items() if k not in known})


@dataclass(frozen=True)
class Plan:
    """keep / swap / recompute for every saved tensor of one graph, under one budget."""

    graph_name: str
    graph_digest: str
    budget_bytes: int
    decisions: Mapping[str, str]
    schedule: Schedule | None = None
    info: SolveInfo = field(default_factory=lambda: SolveInfo(solver="user", status="feasible"))
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.decisions, Mapping):
            raise PlanError("plan: decisions must be an object of tensor -> keep|swap|recompute")
        for tensor, decision in self.decisions.items():
            if decision not in DECISIONS:
                raise PlanError(
                    f"plan: tensor {tensor!r} has decision {decision!r}; expected one of {DECISIONS}"
                )
        object.__setattr__(self, "decisions", MappingProxyType(dict(self.decisions)))
        if isinstance(self.budget_bytes, bool) or not isinstance(self.budget_bytes, int) \
                or self.budget_bytes < 0:
            raise PlanError(f"plan: budget_bytes must be a non-negative integer, got {self.budget_bytes!r}")

    def count(self, decision: str) -> int:
        return sum(1 for d in self.decisions.values() if d == decision)

    def tensors(self, decision: str) -> list[str]:
        return [t for t, d in self.decisions.items() if d == decision]

    def with_info(self, **changes: Any) -> Plan:
        data = self.info.to_dict()
        data.update(changes)
        return Plan(self.graph_name, self.graph_digest, self.budget_bytes, self.decisions,
                    self.schedule, SolveInfo.from_dict(data), self.extra)

    def without_schedule(self) -> Plan:
        return Plan(self.graph_name, self.graph_digest, self.budget_bytes, self.decisions,
                    None, self.info, self.extra)

    def as_checkpoint_policy(self, graph):
        """A torch.utils.checkpoint selective-checkpoint policy with this plan's recomputes.

        Ops of ``graph`` that produce a saved tensor the plan keeps or offloads get MUST_SAVE;
        all others PREFER_RECOMPUTE: those whose tensors the plan recomputes, those whose outputs
        backward never reads (views, in-place ops, intermediates), and ops whose outputs are
        later written in place (a dropout mask
        drawn in place): torch must rerun those with the in-place op, so they get
        PREFER_RECOMPUTE too (checkpoint restores the RNG state). Calls are matched to the graph's ops in order, so checkpoint the same
        forward that was profiled (the whole model call); a call that does not match the graph's
        next op is saved; the graph's first op with no match ahead starts the next step. Use with
        ``create_selective_checkpoint_contexts``.
        """
        from torch.utils.checkpoint import CheckpointPolicy

        if graph.digest != self.graph_digest:
            raise PlanError(f"plan was made for graph {self.graph_name!r}, not {graph.name!r}")
        steps = []
        for i, op in enumerate(graph.ops):
            keeps = [graph.tensors[t].name for t in graph.op_outputs[i] if graph.is_saved[t]]
            recompute = not op.recomputable or not keeps or any(
                self.decisions.get(name) == "recompute" for name in keeps)
            steps.append((str(op.extra.get("aten", "")), recompute))
        cursor = {False: 0, True: 0}

        def policy(ctx, func, *args, **kwargs):
            key = bool(getattr(ctx, "is_recompute", False))
            i = cursor[key]
            name = str(func)
            while i < len(steps) and steps[i][0] != name:
                i += 1
            if i >= len(steps):
                if name != steps[0][0]:
                    return CheckpointPolicy.MUST_SAVE
                # the graph's first op again with no match ahead: a new step (the graph's tail,
                # the loss, ran outside the checkpointed call)
                i = 0
            cursor[key] = i + 1
            if cursor[key] >= len(steps):
                cursor[key] = 0
            return CheckpointPolicy.PREFER_RECOMPUTE if steps[i][1] else CheckpointPolicy.MUST_SAVE

        return policy

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        out.update({
            "format": PLAN_FORMAT,
            "graph": self.graph_name,
            "graph_digest": self.graph_digest,
            "budget_bytes": self.budget_bytes,
            "decisions": dict(self.decisions),
        })
        if self.schedule is not None:
            out["schedule"] = self.schedule.to_dict()
        out["info"] = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                       for k, v in self.info.to_dict().items()}
        return out

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(indent=1))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        if not isinstance(data, Mapping):
            raise PlanError("plan: expected a JSON object")
        if data.get("format") != PLAN_FORMAT:
            raise PlanError(f"plan: field 'format' must be {PLAN_FORMAT!r}, got {data.get('format')!r}")
        for key in ("graph", "graph_digest", "budget_bytes", "decisions"):
            if key not in data:
                raise PlanError(f"plan: missing field {key!r}")
        known = {"format", "graph", "graph_digest", "budget_bytes", "decisions", "schedule", "info"}
        schedule = data.get("schedule")
        return cls(
            graph_name=data["graph"],
            graph_digest=data["graph_digest"],
            budget_bytes=data["budget_bytes"],
            decisions=data["decisions"],
            schedule=None if schedule is None else Schedule.from_dict(schedule),
            info=SolveInfo.from_dict(data.get("info", {})),
            extra={k: v for k, v in data.items() if k not in known},
        )


def load_plan(source: str | Path | Mapping[str, Any]) -> Plan:
    """Load a plan from a path, JSON text or dict."""
    if isinstance(source, Plan):
        return source
    if isinstance(source, Mapping):
        return Plan.from_dict(source)
    text = str(source)
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.exists():
            raise PlanError(f"plan file {text!r} does not exist")
        text = path.read_text()
    try:
        return Plan.from_dict(json.loads(text))
    except json.JSONDecodeError as exc:
        raise PlanError(f"plan: not valid JSON ({exc})") from None
