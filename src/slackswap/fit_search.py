"""The largest micro-batch (or sequence) that fits, and the plans users compare at it.

``largest_fit(graph_at, hw)`` grows the size (1, 2, 4, ...) until no plan fits the memory left
beside the model state, then bisects: the answer is a size at which ``fit`` finds a plan and one
above at which it finds none (the step model's prediction for ``hw``, like every figure of
``fit``). Sizes inside the search are decided by the heuristic's ``fit`` (whether a plan fits
follows from the smallest budget, whatever the planner); the planner asked for plans the answer.
At that size ``strategies`` compares what users would otherwise run, side by side: no
plan, every block checkpointed (HF ``gradient_checkpointing``), the blocks under torch's
selective checkpointing of matrix products, offloading everything, and the slackswap plan, each
with its predicted peak, step time and tokens per second.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .check.simulate import simulate
from .core.budget import keep_all_peak, offload_floor
from .core.errors import InfeasibleBudget
from .core.graph import ActivationGraph
from .core.hardware import Hardware
from .fit import FitReport, fit, memory_beside_state, rank_graph
from .planners.base import get_planner
from .solve import graph_hardware, solve

GIB = 2**30

# (solver name, what users call it): the plans compared at the largest size
STRATEGIES = (
    ("keep-all", "no plan (every activation kept)"),
    ("checkpoint-blocks", "every block checkpointed"),
    ("checkpoint-blocks-sac", "blocks with torch SAC (matmuls saved)"),
    ("swap-all", "offload everything"),
)


@dataclass(frozen=True)
class StrategyRow:
    """One strategy at one size: its predicted peak of activations, step and throughput, and
    whether the step fits the memory left beside the model state."""

    strategy: str
    label: str
    size: int
    peak_bytes: int
    step_s: float
    tokens_per_s: float
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class LargestFit:
    """The largest size that fits (0: not even 1), ``fit``'s report there and one size above
    (where no plan fits), every size tried with its verdict, and the strategies compared."""

    dimension: str  # "batch" or "seq"
    size: int
    report: FitReport | None
    above: FitReport | None
    tried: dict[int, bool] = field(default_factory=dict)
    rows: tuple[StrategyRow, ...] = ()
    # per size tried, the strategies there (``largest_fit(..., curve=True)``: for the plot)
    curve: dict[int, tuple[StrategyRow, ...]] = field(default_factory=dict)

    def table(self) -> str:
        lines = [
            f"largest {self.dimension} that fits: {self.size}"
            + ("" if self.size else " (none: not even 1)"),
            f"{'batch sizes' if self.dimension == 'batch' else 'sequence lengths'} tried: "
            + ", ".join(f"{n} {'fits' if ok else 'no'}" for n, ok in sorted(self.tried.items())),
        ]
        if self.above is not None:
            lines.append(f"at {self.dimension} {self.size + 1}: {self.above.verdict}")
        if self.rows:
            width = max(len(r.label) for r in self.rows)
            lines.append(
                f"{'at ' + self.dimension + ' ' + str(self.size):<{width}}  "
                f"{'peak GiB':>9} {'step ms':>9} {'tokens/s':>10}  fits"
            )
            for r in self.rows:
                lines.append(
                    f"{r.label:<{width}}  {r.peak_bytes / GIB:9.2f} {1e3 * r.step_s:9.1f} "
                    f"{r.tokens_per_s:10.0f}  {'yes' if r.fits else 'no'}"
                )
            lines.append(
                "(every row the step model's prediction; a strategy's reruns as slackswap's "
                "executor runs its decisions, one rebuild per tensor, not torch's replay of a "
                "region)"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dimension": self.dimension,
            "size": self.size,
            "tried": {str(k): v for k, v in sorted(self.tried.items())},
            "report": None if self.report is None else self.report.to_dict(),
            "above": None if self.above is None else self.above.to_dict(),
            "strategies": [r.to_dict() for r in self.rows],
        }


def _fits(report: FitReport) -> bool:
    return report.fits


def largest_fit(
    graph_at: Callable[[int], ActivationGraph],
    hardware: Hardware | str | None = None,
    *,
    dimension: str = "batch",
    limit: int = 1 << 16,
    tokens_per_size: int = 1,
    memory_bytes: int | None = None,
    host_memory_bytes: int | None = None,
    ranks: int = 1,
    solver: str = "cpsat",
    progress: Callable[[str], None] | None = None,
    curve: bool = False,
    **options: Any,
) -> LargestFit:
    """The largest size in [1, ``limit``] at which ``fit(graph_at(size), ...)`` finds a plan.

    Args:
        graph_at: the step's graph at a size (a fake profile at that batch or sequence).
        hardware: the device (default: the graphs' own).
        dimension: what the size is ("batch" or "seq"), for the report.
        limit: the largest size tried.
        tokens_per_size: tokens a step holds per unit of size (the sequence length when the
            size is the batch; the batch when it is the sequence), for tokens per second.
        memory_bytes: the device memory instead of the hardware's.
        host_memory_bytes: the host memory for swapped tensors instead of the hardware's.
        ranks: FSDP2 ranks the model state is sharded over (``fit``'s).
        solver: the planner for the slackswap plan.
        progress: called with a line per size tried.
        curve: compare the strategies at every size tried too (``LargestFit.curve``).
        options: passed to ``fit`` and ``solve``.

    Returns:
        A LargestFit: the size, fit's reports at it and above it, every size tried, and the
        strategies compared at it.
    """
    if dimension not in ("batch", "seq"):
        raise ValueError(f"largest_fit: dimension must be 'batch' or 'seq', got {dimension!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"largest_fit: limit must be a positive integer, got {limit!r}")
    sizes = _SizeSearch(
        graph_at,
        hardware,
        dimension=dimension,
        limit=limit,
        memory_bytes=memory_bytes,
        host_memory_bytes=host_memory_bytes,
        ranks=ranks,
        solver=solver,
        progress=progress,
        options=options,
    )
    low = sizes.largest()
    if not low:
        return LargestFit(dimension, 0, None, sizes.report_at(1), sizes.tried)
    above = None
    if low < limit:
        sizes.check(low + 1)
        above = sizes.report_at(low + 1)

    def compared(size: int) -> tuple[StrategyRow, ...]:
        graph = sizes.graphs[size]
        hw, _ = graph_hardware(graph, hardware)
        if host_memory_bytes is not None:
            hw = replace(hw, host_memory_bytes=host_memory_bytes)
        rows = strategies(
            graph,
            hw,
            sizes.report_at(size),
            size=size,
            tokens_per_size=tokens_per_size,
            solver=solver,
            **options,
        )
        return tuple(rows)

    points = {n: compared(n) for n in sorted(sizes.tried)} if curve else {}
    rows = points.get(low) or compared(low)
    return LargestFit(dimension, low, sizes.report_at(low), above, sizes.tried, rows, points)


class _SizeSearch:
    """The sizes tried by ``largest_fit`` and its reports. Inside the search a size is decided by
    the heuristic's ``fit``: whether a plan fits follows from the smallest budget alone (fit
    solves only where it is within the memory left, and solve then returns a plan that fits,
    its planner's or the smallest budget's), so the asked planner's minutes go to the answer
    alone; should that planner find no plan there, the search goes on below with its own
    verdicts (fit's report is the planner's, never the heuristic's)."""

    def __init__(
        self,
        graph_at: Callable[[int], ActivationGraph],
        hardware: Hardware | str | None,
        *,
        dimension: str,
        limit: int,
        memory_bytes: int | None,
        host_memory_bytes: int | None,
        ranks: int,
        solver: str,
        progress: Callable[[str], None] | None,
        options: dict[str, Any],
    ):
        self.graph_at, self.hardware, self.dimension, self.limit = (
            graph_at,
            hardware,
            dimension,
            limit,
        )
        self.memory_bytes, self.host_memory_bytes, self.ranks = (
            memory_bytes,
            host_memory_bytes,
            ranks,
        )
        # an unknown solver, or one whose library is missing, is refused before any size is
        # searched (the heuristic's search would otherwise run first and fail at the answer)
        get_planner(solver)
        self.solver, self.progress, self.options = solver, progress, options
        self.tried: dict[int, bool] = {}  # per size, whether a plan fits
        self.reports: dict[int, FitReport] = {}  # the asked planner's
        self.graphs: dict[int, ActivationGraph] = {}
        self.searching = solver != "heuristic"  # sizes decided by the heuristic's fit
        self.searched: set[int] = set()

    def fit_at(self, size: int, solver: str) -> FitReport:
        options = self.options if solver == self.solver else _heuristic_options(self.options)
        return fit(
            self.graphs[size],
            self.hardware,
            memory_bytes=self.memory_bytes,
            host_memory_bytes=self.host_memory_bytes,
            ranks=self.ranks,
            solver=solver,
            **options,
        )

    def report_at(self, size: int) -> FitReport:
        """The asked planner's report at ``size``."""
        if size not in self.graphs:
            self.graphs[size] = rank_graph(self.graph_at(size), self.ranks)
        if size not in self.reports:
            self.reports[size] = self.fit_at(size, self.solver)
            self.tried[size] = _fits(self.reports[size])
            self.searched.discard(size)
        return self.reports[size]

    def check(self, size: int) -> bool:
        """Whether a plan fits at ``size`` (settled, searched or reported: the class docstring)."""
        if size in self.tried:
            return self.tried[size]
        if size not in self.graphs:
            self.graphs[size] = rank_graph(self.graph_at(size), self.ranks)
        quick = _settled(
            self.graphs[size], self.hardware, self.memory_bytes, self.host_memory_bytes, self.ranks
        )
        if quick is not None:
            self.tried[size] = quick
            verdict = "fits as it is" if quick else "does not fit (settled without a plan)"
        elif self.searching:
            report = self.fit_at(size, "heuristic")
            self.tried[size] = _fits(report)
            self.searched.add(size)
            verdict = report.verdict
            if report.fits:
                verdict += f" (the heuristic's plan; {self.solver} plans the largest size)"
        else:
            verdict = self.report_at(size).verdict
        if self.progress is not None:
            self.progress(f"{self.dimension} {size}: {verdict}")
        return self.tried[size]

    def search(self, low: int, high: int | None) -> int:
        """The largest size that fits, from ``low`` (fits) and ``high`` (does not, or None)."""
        while high is None:  # grow: 1, 2, 4, ... until one does not fit or the limit
            nxt = min(2 * low, self.limit)
            if nxt == low:
                break
            if self.check(nxt):
                low = nxt
            else:
                high = nxt
        while high is not None and high - low > 1:  # bisect (low fits, high does not)
            mid = (low + high) // 2
            if self.check(mid):
                low = mid
            else:
                high = mid
        return low

    def largest(self) -> int:
        """The largest size at which the asked planner's fit finds a plan (0: not even 1)."""
        if not self.check(1):
            return 0
        low = self.search(1, None)
        if low in self.searched and not self.report_at(low).fits:
            self.searching = False
            for size in [n for n in self.searched if n < low]:
                del self.tried[size]
            self.searched.clear()
            if not self.check(1):
                return 0
            low = self.search(1, low)
        self.report_at(low)
        return low


def _heuristic_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options of a search's ``fit`` that the heuristic takes: solve's own (the time limit,
    work, allowed decisions and pins, which decide what fits) and the heuristic's; another
    planner's (a gap, a warm start) are for the answer's plan alone."""
    takes = set(getattr(get_planner("heuristic"), "options", None) or ())
    takes |= {
        name
        for name, p in inspect.signature(solve).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY or p.name == "time_limit_s"
    }
    return {k: v for k, v in options.items() if k in takes}


def _settled(graph, hardware, memory_bytes, host_memory_bytes, ranks) -> bool | None:
    """Whether ``fit`` would find a plan, where it follows without the smallest budget
    (keep-all fits, or less is left than even offloading everything needs), else None."""
    hw, memory, state, outside, _ = memory_beside_state(
        graph, hardware, memory_bytes, host_memory_bytes, ranks
    )
    left = memory - outside
    step = int(state.get("total_bytes", 0)) + int(state.get("optimizer_step_bytes", 0))
    if left <= 0 or step > memory or left < offload_floor(graph, hw, None):
        return False
    return True if keep_all_peak(graph, hw) <= left else None


def _host_holds(hw: Hardware, sim) -> bool:
    """The swapped tensors fit the host memory the hardware has for them (0: no limit)."""
    return not hw.host_memory_bytes or sim.swapped_bytes <= hw.host_memory_bytes


def strategies(
    graph: ActivationGraph,
    hardware: Hardware | str | None,
    report: FitReport,
    *,
    size: int,
    tokens_per_size: int,
    solver: str = "cpsat",
    **options: Any,
) -> list[StrategyRow]:
    """Each strategy of STRATEGIES and the slackswap plan on ``graph``, within the memory
    ``report`` leaves for activations: its predicted peak, step and tokens per second. A
    strategy fits where its peak is within that memory and the model state fits beside it."""
    hw, _ = graph_hardware(graph, hardware)
    left = report.activation_memory_bytes
    state_fits = left > 0 and "optimizer step needs" not in report.verdict
    tokens = size * tokens_per_size
    rows = []
    for name, label in STRATEGIES:
        # a baseline's decisions do not depend on the budget: planned at the keep-all peak (a
        # budget below the smallest would be refused), its peak compared with the memory left
        baseline = solve(graph, 1.0, hw, solver=name, strict=False)
        sim = simulate(graph, baseline, hw)
        rows.append(
            StrategyRow(
                name,
                label,
                size,
                int(sim.peak_bytes),
                float(sim.step_time_s),
                tokens / sim.step_time_s,
                bool(state_fits and sim.peak_bytes <= left and _host_holds(hw, sim)),
            )
        )
    plan = report.plan
    if plan is None and state_fits:
        try:
            plan = solve(graph, left, hw, solver=solver, **options)
        except InfeasibleBudget:
            plan = None
    if plan is not None:
        sim = simulate(graph, plan, hw)
        rows.append(
            StrategyRow(
                "slackswap",
                f"slackswap plan ({plan.info.solver})",
                size,
                int(sim.peak_bytes),
                float(sim.step_time_s),
                tokens / sim.step_time_s,
                bool(state_fits and sim.fits),
            )
        )
    return rows
