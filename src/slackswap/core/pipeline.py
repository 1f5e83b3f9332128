"""Pipeline parallelism as data (formulations/pipeline.md): which micro-batch a stage runs
forward or backward at each turn of a ``torch.distributed.pipelining`` schedule (and, where a
rank holds several stages, in which order the rank runs them all), and a stage's plan (one
closed Plan per micro-batch) for that schedule.

A stage's graph is one micro-batch's step on that stage: its forward positions run in the
micro-batch's forward action, its backward positions in its backward action, and between the
two the micro-batch rests, holding what its plan keeps across its forward's end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .plan import Plan

# the schedules of torch.distributed.pipelining modelled: two with one stage per rank, one
# with several (ScheduleInterleaved1F1B)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True)
class Action:
    """One turn of a stage: the forward or the backward of one micro-batch (of ``stage``, in
    a rank's order, where the rank holds several)."""

    phase: str  # "forward" or "backward"
    micro_batch: int
    stage: int | None = None

    def __str__(self) -> str:
        where = "" if self.stage is None else f"@{self.stage}"
        return f"{'F' if self.phase == FORWARD else 'B'}{self.micro_batch}{where}"


@dataclass(frozen=True)
class PipelineSchedule:
    """A pipeline schedule of ``stages`` stages over ``micro_batches`` micro-batches, as torch
    runs it:

    - ``gpipe`` (``ScheduleGPipe``): every forward, then every backward, in micro-batch order;
    - ``1f1b`` (``Schedule1F1B``): stage s (from 0) runs min(M, P - s) forwards, then one
      backward and one forward in turn while forwards are left, then the remaining backwards;
    - ``interleaved-1f1b`` (``ScheduleInterleaved1F1B``): ``stages_per_rank`` (V) stages on each
      of R = stages / V ranks, rank r holding stages r, r + R, r + 2R, ...; the rank runs its
      stages' actions in the order torch's ``_get_1f1b_rank_ops`` gives (``rank_actions``).

    The first two hold one stage per rank (``stages_per_rank`` 1): rank s runs stage s.
    """

    kind: str
    stages: int
    micro_batches: int
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"pipeline schedule must be one of {SCHEDULES}, got {self.kind!r}")
        for name in ("stages", "micro_batches", "stages_per_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"pipeline schedule: {name} must be a positive integer, got {value!r}"
                )
        V = self.stages_per_rank
        if self.kind != "interleaved-1f1b" and V != 1:
            raise ValueError(
                f"pipeline schedule {self.kind!r} runs one stage per rank, not "
                f"stages_per_rank={V} (interleaved-1f1b runs several)"
            )
        if self.stages % V:
            raise ValueError(
                f"pipeline schedule: {self.stages} stages do not split into ranks of "
                f"stages_per_rank={V}"
            )
        if self.kind == "interleaved-1f1b":
            rounds = max(1, self.micro_batches // self.ranks)
            if self.micro_batches % rounds:
                raise ValueError(
                    f"interleaved-1f1b: {self.micro_batches} micro-batches must be a multiple of "
                    f"its {rounds} rounds (micro-batches // ranks), as torch requires"
                )

    @property
    def ranks(self) -> int:
        return self.stages // self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage`` (torch's stage index: local index x ranks + rank)."""
        self._check_stage(stage)
        return stage % self.ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs, in torch's local order."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.ranks:
            raise ValueError(f"pipeline schedule: rank must be 0..{self.ranks - 1}, got {rank!r}")
        return tuple(v * self.ranks + rank for v in range(self.stages_per_rank))

    def _check_stage(self, stage: int) -> None:
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < self.stages:
            raise ValueError(
                f"pipeline schedule: stage must be 0..{self.stages - 1}, got {stage!r}"
            )

    def rank_actions(self, rank: int) -> tuple[Action, ...]:
        """What ``rank`` runs, in order, every action naming its stage."""
        stages = self.stages_of(rank)
        if self.kind != "interleaved-1f1b":
            return tuple(Action(a.phase, a.micro_batch, stages[0]) for a in self.actions(stages[0]))
        return _interleaved_rank_actions(rank, self.ranks, self.stages_per_rank, self.micro_batches)

    def actions(self, stage: int) -> tuple[Action, ...]:
        """What ``stage`` runs, in order."""
        self._check_stage(stage)
        M = self.micro_batches
        if self.kind == "interleaved-1f1b":
            return tuple(
                Action(a.phase, a.micro_batch)
                for a in self.rank_actions(self.rank_of(stage))
                if a.stage == stage
            )
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

    def in_flight_on_rank(self, rank: int) -> int:
        """The most micro-batches, over the rank's stages, whose forward has run there and
        backward not ended."""
        open_ = most = 0
        for action in self.rank_actions(rank):
            open_ += 1 if action.phase == FORWARD else -1
            most = max(most, open_)
        return most

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "stages": self.stages,
            "micro_batches": self.micro_batches,
        }
        if self.stages_per_rank != 1:
            out["stages_per_rank"] = self.stages_per_rank
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> PipelineSchedule:
        return PipelineSchedule(
            str(data["kind"]),
            int(data["stages"]),
            int(data["micro_batches"]),
            int(data.get("stages_per_rank", 1)),
        )


def _interleaved_rank_actions(rank: int, ranks: int, local: int, M: int) -> tuple[Action, ...]:
    """Rank ``rank``'s order under ``ScheduleInterleaved1F1B`` (torch's ``_get_warmup_ops`` and
    ``_get_1f1b_rank_ops``, its idle turns left out): a warm-up of forwards, then a forward and
    a backward in turn, then the backwards left; the forwards go through the rank's stages
    ``per_round`` micro-batches at a time, in its local order, the backwards in the reverse."""
    rounds = max(1, M // ranks)
    per_round = M // rounds
    total = local * M
    warmup = min((local - 1) * per_round + 2 * (ranks - 1 - rank), total)
    steady = total - warmup

    def forward_stage(step: int) -> int:
        return ((step // per_round) % local) * ranks + rank

    def backward_stage(step: int) -> int:
        return (local - 1 - ((step - warmup) // per_round) % local) * ranks + rank

    forwards: dict[int, int] = {}
    backwards: dict[int, int] = {}
    out: list[Action] = []

    def forward(step: int) -> None:
        s = forward_stage(step)
        forwards[s] = forwards.get(s, 0) + 1
        out.append(Action(FORWARD, forwards[s] - 1, s))

    def backward(step: int) -> None:
        s = backward_stage(step)
        backwards[s] = backwards.get(s, 0) + 1
        out.append(Action(BACKWARD, backwards[s] - 1, s))

    for step in range(warmup + steady + warmup):
        if step < warmup:
            forward(step)
        elif step < warmup + steady:
            forward(step)
            backward(step)
        else:
            backward(step)
    return tuple(out)


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
    def from_json(text: str) -> StagePlan:
        return StagePlan.from_dict(json.loads(text))

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
