"""Pipeline parallelism as data (formulations/pipeline.md): which micro-batch a stage runs
forward or backward at each turn of a ``torch.distributed.pipelining`` schedule, and a stage's
plan (one closed Plan per micro-batch) for that schedule.

A stage's graph is one micro-batch's step on that stage: its forward positions run in the
micro-batch's forward action, its backward positions in its backward action, and between the
two the micro-batch rests, holding what its plan keeps across its forward's end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .plan import Plan

# the schedules of torch.distributed.pipelining that run one stage per rank
SCHEDULES = ("gpipe", "1f1b")
FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True)
class Action:
    """One turn of a stage: the forward or the backward of one micro-batch."""

    phase: str  # "forward" or "backward"
    micro_batch: int

    def __str__(self) -> str:
        return f"{'F' if self.phase == FORWARD else 'B'}{self.micro_batch}"


@dataclass(frozen=True)
class PipelineSchedule:
    """A pipeline schedule of ``stages`` stages (one per rank) over ``micro_batches``
    micro-batches, as torch runs it:

    - ``gpipe`` (``ScheduleGPipe``): every forward, then every backward, in micro-batch order;
    - ``1f1b`` (``Schedule1F1B``): stage s (from 0) runs min(M, P - s) forwards, then one
      backward and one forward in turn while forwards are left, then the remaining backwards.
    """

    kind: str
    stages: int
    micro_batches: int

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(
                f"pipeline schedule must be one of {SCHEDULES}, got {self.kind!r} (interleaved "
                "schedules, several stages per rank, are not modelled)"
            )
        for name in ("stages", "micro_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"pipeline schedule: {name} must be a positive integer, got {value!r}"
                )

    def actions(self, stage: int) -> tuple[Action, ...]:
        """What ``stage`` runs, in order."""
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < self.stages:
            raise ValueError(
                f"pipeline schedule: stage must be 0..{self.stages - 1}, got {stage!r}"
            )
        M = self.micro_batches
        if self.kind == "gpipe":
            return tuple(Action(FORWARD, m) for m in range(M)) + tuple(
                Action(BACKWARD, m) for m in range(M)
            )
        warmup = min(M, self.stages - stage)
        out = [Action(FORWARD, m) for m in range(warmup)]
        forward, backward = warmup, 0
        while backward < M:
            out.append(Action(BACKWARD, backward))
            backward += 1
            if forward < M:
                out.append(Action(FORWARD, forward))
                forward += 1
        return tuple(out)

    def in_flight(self, stage: int) -> int:
        """The most micro-batches whose forward has run on ``stage`` and backward not ended."""
        started = done = most = 0
        for action in self.actions(stage):
            if action.phase == FORWARD:
                started += 1
                most = max(most, started - done)
            else:
                done += 1
        return most

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "stages": self.stages, "micro_batches": self.micro_batches}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> PipelineSchedule:
        return PipelineSchedule(str(data["kind"]), int(data["stages"]), int(data["micro_batches"]))


@dataclass(frozen=True)
class StagePlan:
    """What one stage runs under a pipeline schedule: a closed plan of its graph per
    micro-batch (the same plan, or one each), the stage's budget for everything it holds at
    once, ``held_bytes``: what each micro-batch holds beside its graph's tensors from its
    forward's end to its backward's end (the stage's output, which torch's schedule keeps for
    the backward; during the forward the graph counts it), and
    ``returned_bytes``: what each stays holding from the end of its backward to the end of the
    step (the last stage's output, which ``schedule.step()`` returns merged unless
    ``return_outputs=False``)."""

    stage: int
    schedule: PipelineSchedule
    plans: tuple[Plan, ...]
    budget_bytes: int
    held_bytes: int = 0
    returned_bytes: int = 0

    def __post_init__(self) -> None:
        if len(self.plans) != self.schedule.micro_batches:
            raise ValueError(
                f"stage {self.stage}: {len(self.plans)} plans for "
                f"{self.schedule.micro_batches} micro-batches (one each)"
            )
        self.schedule.actions(self.stage)  # (checks the stage)
        digests = {p.graph_digest for p in self.plans}
        if len(digests) != 1:
            raise ValueError(f"stage {self.stage}: its plans are for different graphs")
        if self.held_bytes < 0 or self.returned_bytes < 0 or self.budget_bytes <= 0:
            raise ValueError(
                f"stage {self.stage}: held_bytes and returned_bytes >= 0, budget_bytes > 0"
            )

    @property
    def graph_digest(self) -> str:
        return self.plans[0].graph_digest

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "schedule": self.schedule.to_dict(),
            "budget_bytes": self.budget_bytes,
            "held_bytes": self.held_bytes,
            "returned_bytes": self.returned_bytes,
            "plans": [p.to_dict() for p in self.plans],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> StagePlan:
        return StagePlan(
            int(data["stage"]),
            PipelineSchedule.from_dict(data["schedule"]),
            tuple(Plan.from_dict(p) for p in data["plans"]),
            int(data["budget_bytes"]),
            int(data.get("held_bytes", 0)),
            int(data.get("returned_bytes", 0)),
        )
