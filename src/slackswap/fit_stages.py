"""Will it fit in a pipeline: ``fit`` for every stage of a pipeline schedule (formulations/
pipeline.md). The whole model's graph is split into stages (``core/stages.py``); each stage
holds its share of the model state for the whole step and, beside it, its micro-batches'
activations as the schedule has them in flight, planned by ``plan_rank`` within what is left
(a rank's stages together under an interleaved schedule). The answer is the worst rank's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .check.simulate_stage import simulate_pipeline, simulate_rank
from .core.errors import InfeasibleBudget
from .core.graph import ActivationGraph
from .core.hardware import Hardware
from .core.pipeline import PipelineSchedule, StagePlan
from .core.regions import numbered_blocks, op_regions
from .core.stages import split_stages
from .fit import GIB
from .pipeline import keep_all_rank_peak, plan_rank
from .solve import graph_hardware


@dataclass(frozen=True)
class StageFit:
    """One rank (one stage, or several under an interleaved schedule): what it holds and
    whether its schedule fits."""

    stage: int  # the rank's first stage
    blocks: int  # numbered blocks it runs
    model_state_bytes: int
    activation_memory_bytes: int  # the device's memory less the model state
    in_flight: int
    keep_all_peak_bytes: int  # every micro-batch in flight keeping everything
    plan: StagePlan | None = field(repr=False)
    peak_bytes: int | None  # the plan's, under the schedule
    busy_s: float | None
    verdict: str
    stages: tuple[int, ...] = ()  # every stage the rank runs
    plans: tuple[StagePlan, ...] = field(default=(), repr=False)  # one per stage, where it fits

    @property
    def fits(self) -> bool:
        return self.plan is not None

    @property
    def label(self) -> str:
        return ",".join(map(str, self.stages)) if len(self.stages) > 1 else str(self.stage)


@dataclass(frozen=True)
class StagesFitReport:
    """``fit_stages``'s answer: every stage, the worst, and the pipeline's predicted step."""

    graph_name: str
    hardware: str
    memory_bytes: int
    schedule: PipelineSchedule
    stages: tuple[StageFit, ...]
    step_s: float | None  # the pipeline's step where every stage fits
    ideal_step_s: float | None

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    @property
    def worst(self) -> StageFit:
        """The stage that fails, else the one with the least memory to spare."""
        failing = [s for s in self.stages if not s.fits]
        if failing:
            return failing[0]
        return min(self.stages, key=lambda s: s.activation_memory_bytes - int(s.peak_bytes or 0))

    @property
    def verdict(self) -> str:
        worst = self.worst
        if not self.fits:
            return f"does not fit: stage {worst.label}: {worst.verdict}"
        assert self.step_s is not None and self.ideal_step_s is not None
        return (
            f"fits: the pipeline's step {1e3 * self.step_s:.1f} ms, "
            f"{100 * self.ideal_step_s / self.step_s:.2f}% of its ideal; the tightest stage is "
            f"{worst.label}"
        )

    def table(self) -> str:
        s = self.schedule
        per_rank = f" ({s.stages_per_rank} a rank)" if s.stages_per_rank > 1 else ""
        lines = [
            f"{self.graph_name} on {self.hardware} ({_size(self.memory_bytes)}), "
            f"{s.kind}: {s.stages} stages{per_rank}, {s.micro_batches} micro-batches",
            f"{'stage':>5}  {'blocks':>6}  {'model state':>11}  {'left':>9}  {'in flight':>9}  "
            f"{'keep-all':>9}  {'planned':>9}  verdict",
        ]
        for f in self.stages:
            planned = "-" if f.peak_bytes is None else _size(f.peak_bytes)
            lines.append(
                f"{f.label:>5}  {f.blocks:>6}  {_size(f.model_state_bytes):>11}  "
                f"{_size(f.activation_memory_bytes):>9}  {f.in_flight:>9}  "
                f"{_size(f.keep_all_peak_bytes):>9}  {planned:>9}  {f.verdict}"
            )
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)


def fit_stages(
    graph: ActivationGraph,
    hardware: Hardware | str | None = None,
    *,
    stages: int,
    micro_batches: int,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
    memory_bytes: int | None = None,
    solver: str = "heuristic",
    time_limit_s: float | None = None,
    **options: Any,
) -> StagesFitReport:
    """Whether the model whose step ``graph`` is fits a pipeline of ``stages`` stages running
    ``micro_batches`` micro-batches (``graph`` is one micro-batch's step of the whole model).

    Args:
        graph: the whole model's step for one micro-batch, with its model state, profiled with
            ``gradients="held"`` (a stage accumulates its gradients over the micro-batches).
        hardware: the device (default: the graph's own).
        stages: pipeline stages.
        micro_batches: micro-batches per step.
        schedule: "1f1b", "gpipe" or "interleaved-1f1b".
        stages_per_rank: stages on each rank (interleaved-1f1b; the others run one): a rank's
            stages share its memory and are planned together.
        memory_bytes: the device memory to fit in (default: the hardware's).
        solver: the planner of each stage's one-step plan (``plan_stage``).
        time_limit_s: the exact planner's cap.
        options: passed to ``solve``.

    Returns:
        A StagesFitReport: every stage's model state, activations in flight and plan, the
        worst stage, and the pipeline's predicted step.
    """
    if not isinstance(graph, ActivationGraph):
        raise TypeError(f"fit_stages: graph must be an ActivationGraph, got {type(graph).__name__}")
    if graph.extra.get("parameter_gradients") == "made":
        raise ValueError(
            f"fit_stages: graph {graph.name!r} counts parameter gradients made in each step's "
            "backward (gradients='made'); a stage accumulates them over its micro-batches and "
            "holds them beside: profile with gradients='held'"
        )
    hw, _ = graph_hardware(graph, hardware)
    memory = hw.memory_bytes if memory_bytes is None else memory_bytes
    if isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0:
        raise ValueError(f"fit_stages: hardware {hw.name!r} has no memory_bytes; pass memory_bytes")
    pipeline = PipelineSchedule(schedule, stages, micro_batches, stages_per_rank)
    parts = split_stages(graph, stages)
    results: list[StageFit] = []
    for rank in range(pipeline.ranks):
        mine = pipeline.stages_of(rank)
        graphs = [parts[s] for s in mine]
        held = sum(int((g.extra.get("model_state") or {}).get("total_bytes", 0)) for g in graphs)
        left = memory - held
        keep_all = keep_all_rank_peak(graphs, pipeline, rank, hw)
        blocks = sum(len(numbered_blocks(op_regions(g))) for g in graphs)
        plans: list[StagePlan] = []
        peak = busy = None
        if left <= 0:
            verdict = f"its model state alone needs {_size(held)}"
        else:
            try:
                plans = plan_rank(
                    graphs, left, pipeline, rank, hw, solver=solver, time_limit_s=time_limit_s,
                    **options,
                )  # fmt: skip
            except InfeasibleBudget as exc:
                verdict = (
                    f"its activations need {_size(exc.min_budget_bytes)} with the smallest "
                    f"plan, {_size(left)} are left"
                )
            else:
                result = simulate_rank(graphs, plans)
                peak, busy = result.peak_bytes, result.busy_s
                verdict = "fits as it is" if keep_all <= left else "fits with the plan"
        results.append(
            StageFit(
                mine[0],
                blocks,
                held,
                left,
                pipeline.in_flight_on_rank(rank),
                keep_all,
                plans[0] if plans else None,
                peak,
                busy,
                verdict,
                mine,
                tuple(plans),
            )  # fmt: skip
        )
    step = ideal = None
    if all(r.plan is not None for r in results):
        by_stage = {p.stage: p for r in results for p in r.plans}
        whole = simulate_pipeline(list(parts), [by_stage[s] for s in range(stages)])
        step, ideal = whole.step_s, whole.ideal_step_s
    return StagesFitReport(graph.name, hw.name, int(memory), pipeline, tuple(results), step, ideal)


def _size(nbytes: int) -> str:
    """GiB with two decimals, MiB below one GiB (small models)."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.2f} MiB"
