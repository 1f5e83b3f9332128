"""Will it fit, and how fast: the whole memory answer for a graph on a device.

``fit(graph, hw)`` takes what plain training holds besides activations from the graph
(``graph.extra["model_state"]``: parameters, their gradients, the optimizer's state, written by
``profile``), leaves the rest of ``hw.memory_bytes`` to activations, and plans for it: the
keep-all peak, the smallest budget any plan reaches, and the best plan for the memory left with
its predicted step against the ideal one. Every figure is the step model's prediction for
``hw`` (formulations/step-model.md); a fake profile's op times are the cost model's
(formulations/cost-model.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .check.simulate import simulate
from .core.budget import keep_all_peak
from .core.errors import InfeasibleBudget
from .core.graph import ActivationGraph
from .core.hardware import Hardware
from .core.plan import Plan
from .sharding import casts_as_gathered, fsdp_collectives_of, graph_parameters, sharded_model_state
from .solve import graph_hardware, smallest_budget, solve

GIB = 2**30


@dataclass(frozen=True)
class FitReport:
    """What ``fit`` found. Bytes are device bytes; ``plan`` is None where nothing fits."""

    graph_name: str
    hardware: str
    memory_bytes: int
    model_state: dict[str, Any]
    # memory_bytes less the model state held beside the activations
    activation_memory_bytes: int
    keep_all_peak_bytes: int
    smallest_budget_bytes: int
    smallest_proven: bool
    ideal_step_s: float
    plan: Plan | None = field(repr=False)
    step_s: float | None
    retention: float | None  # ideal step / planned step
    verdict: str
    gradients_made: bool = False  # parameter gradients counted in backward, not beside
    # host memory the plan's swapped tensors take (the executor's pool holds each for the
    # step), and what the hardware has for them (0: no limit)
    host_bytes: int = 0
    host_memory_bytes: int = 0
    # FSDP2: the ranks the model state is sharded over, and the fewest at which the step fits
    # (None: not within MAX_RANKS; only asked where ranks > 1)
    ranks: int = 1
    fewest_ranks: int | None = None
    # FSDP2's traffic in one rank's step (received by all-gathers, sent by reduce-scatters), and
    # whether it shares the copy lanes with the swaps (Hardware.collectives_on_link)
    gathered_bytes: int = 0
    reduced_bytes: int = 0
    collectives_on_link: bool = False

    @property
    def fits(self) -> bool:
        return self.plan is not None

    def rows(self) -> list[tuple[str, str]]:
        state = self.model_state
        rows = [("device", f"{self.hardware}, {self.memory_bytes / GIB:.2f} GiB")]
        if self.ranks > 1:
            fewest = "none up to 1024" if self.fewest_ranks is None else str(self.fewest_ranks)
            rows.append(
                ("ranks (FSDP2)", f"{self.ranks}: model state per rank; fewest that fit: {fewest}")
            )
            lanes = "on the copy lanes" if self.collectives_on_link else "beside the copy lanes"
            rows.append(
                (
                    "collectives per step",
                    f"all-gathers {self.gathered_bytes / GIB:.2f} GiB in, reduce-scatters "
                    f"{self.reduced_bytes / GIB:.2f} GiB out ({lanes})",
                )
            )
        if state:
            grads = f"{state['gradient_bytes'] / GIB:.2f} GiB" + (
                " (made in backward: counted with the activations)" if self.gradients_made else ""
            )
            if "precision" in state:
                rows.append(("precision", _precision_line(state)))
            rows += [
                ("parameters", f"{state['parameter_bytes'] / GIB:.2f} GiB"),
                ("gradients", grads),
                (
                    f"optimizer state ({state['optimizer']})",
                    f"{state['optimizer_state_bytes'] / GIB:.2f} GiB",
                ),
            ]
            if state.get("unsharded_bytes"):
                rows.append(
                    (
                        "FSDP2's unsharded buffers",
                        f"{state['unsharded_bytes'] / GIB:.2f} GiB (3 x the largest block)",
                    )
                )
            if state.get("optimizer_step_bytes"):
                how = "foreach" if state.get("foreach") else "one parameter at a time"
                rows.append(
                    (
                        f"optimizer step's temporaries ({how})",
                        f"{state['optimizer_step_bytes'] / GIB:.2f} GiB, after the activations "
                        "are freed",
                    )
                )
        activations = "activations" + (
            " and the gradients made in backward" if self.gradients_made else ""
        )
        rows += [
            ("memory left for activations", f"{self.activation_memory_bytes / GIB:.2f} GiB"),
            (f"{activations}, keep-all peak", f"{self.keep_all_peak_bytes / GIB:.2f} GiB"),
            (
                "smallest budget any plan reaches",
                f"{self.smallest_budget_bytes / GIB:.2f} GiB"
                + ("" if self.smallest_proven else " (found, not proven)"),
            ),
            ("ideal step (nothing moved)", f"{1e3 * self.ideal_step_s:.1f} ms"),
        ]
        if self.plan is not None and self.step_s is not None and self.retention is not None:
            counts = ", ".join(f"{self.plan.count(d)} {d}" for d in ("keep", "swap", "recompute"))
            host = f"{self.host_bytes / GIB:.2f} GiB" + (
                f" of {self.host_memory_bytes / GIB:.2f} GiB" if self.host_memory_bytes else ""
            )
            rows += [
                ("plan", f"{self.plan.info.solver}, {self.plan.info.status}: {counts}"),
                ("host memory the plan needs", host),
                (
                    "predicted step",
                    f"{1e3 * self.step_s:.1f} ms, {100 * self.retention:.2f}% of ideal",
                ),
            ]
        rows.append(("verdict", self.verdict))
        return rows

    def table(self) -> str:
        width = max(len(k) for k, _ in self.rows())
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in self.rows())

    def to_dict(self) -> dict[str, Any]:
        return {
            "graph": self.graph_name,
            "hardware": self.hardware,
            "memory_bytes": self.memory_bytes,
            "model_state": self.model_state,
            "activation_memory_bytes": self.activation_memory_bytes,
            "keep_all_peak_bytes": self.keep_all_peak_bytes,
            "smallest_budget_bytes": self.smallest_budget_bytes,
            "smallest_proven": self.smallest_proven,
            "ideal_step_s": self.ideal_step_s,
            "step_s": self.step_s,
            "retention": self.retention,
            "fits": self.fits,
            "verdict": self.verdict,
            "host_bytes": self.host_bytes,
            "host_memory_bytes": self.host_memory_bytes,
            "ranks": self.ranks,
            "fewest_ranks": self.fewest_ranks,
            "gathered_bytes": self.gathered_bytes,
            "reduced_bytes": self.reduced_bytes,
            "collectives_on_link": self.collectives_on_link,
        }


def _precision_line(state: dict[str, Any]) -> str:
    compute = state.get("compute_dtype", "?")
    name = f"pure {compute}" if state["precision"] == "pure" else state["precision"]
    if "holds" in state:
        return f"{name}: {state['holds']}"
    return f"{name}: the forward in {compute}"  # (a graph saved before regimes said it)


def memory_beside_state(
    graph: ActivationGraph,
    hardware: Hardware | str | None,
    memory_bytes: int | None,
    host_memory_bytes: int | None,
    ranks: int,
) -> tuple[Hardware, int, dict[str, Any], int, bool]:
    """(hardware, device memory, the model state one rank holds, the bytes held beside the
    activations, whether the graph counts gradients made in backward): what ``fit`` plans the
    activations beside, for it and for the searches that ask it many times."""
    hw, _ = graph_hardware(graph, hardware)
    if host_memory_bytes is not None:
        hw = replace(hw, host_memory_bytes=host_memory_bytes)
    memory = hw.memory_bytes if memory_bytes is None else memory_bytes
    if isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0:
        raise ValueError(f"fit: hardware {hw.name!r} has no memory_bytes; pass memory_bytes=...")
    state = dict(graph.extra.get("model_state") or {})
    if state and not isinstance(state.get("total_bytes"), int):
        raise ValueError("fit: graph.extra['model_state'] has no integer total_bytes")
    # gradients made in the step (zero_grad() sets them to None) are in the graph's backward
    # workspaces already (profile(gradients="made")); held ones are there for the whole step
    made = graph.extra.get("parameter_gradients") == "made"
    # FSDP2's MixedPrecisionPolicy gathers parameters cast: one rank holds the copies too
    gathered = bool(state and graph.extra.get("parameters")) and casts_as_gathered(
        state, graph_parameters(graph)
    )
    if ranks != 1 or gathered:
        if made:
            raise ValueError(
                f"fit(ranks={ranks}): graph {graph.name!r} counts whole parameter gradients in "
                "its backward (gradients='made'); FSDP2 reduce-scatters them into shards: "
                "profile with gradients='held'"
            )
        state = sharded_model_state(graph, ranks)
    outside = (
        int(state.get("total_bytes", 0))
        + int(state.get("unsharded_bytes", 0))
        - (int(state.get("gradient_bytes", 0)) if made else 0)
    )
    return hw, int(memory), state, outside, made


def rank_graph(graph: ActivationGraph, ranks: int) -> ActivationGraph:
    """One rank's step under ``fully_shard`` over ``ranks``: ``graph`` with the all-gathers and
    reduce-scatters FSDP2 issues (sharding.fsdp_collectives_of), which take the copy lanes where
    the hardware's collectives cross the host link. A graph that records its own (profiled on a
    sharded model) and a single rank's are returned as they are."""
    if ranks == 1 or graph.collectives:
        return graph
    return replace(graph, collectives=fsdp_collectives_of(graph, ranks))


def fit(
    graph: ActivationGraph,
    hardware: Hardware | str | None = None,
    *,
    memory_bytes: int | None = None,
    host_memory_bytes: int | None = None,
    ranks: int = 1,
    solver: str = "cpsat",
    **options: Any,
) -> FitReport:
    """Plan ``graph`` for the device memory ``hw`` has (``memory_bytes`` overrides it), less the
    model state the graph records. ``solver`` and ``options`` go to :func:`slackswap.solve`.

    Args:
        graph: the step, profiled with its model state (``graph.extra["model_state"]``).
        hardware: the device (default: the graph's own).
        memory_bytes: the device memory to fit in (default: the hardware's).
        host_memory_bytes: the host memory swapped tensors may take (default: the
            hardware's; 0: no limit).
        ranks: FSDP2 ranks the model state is sharded over (sharding.py); the graph is one
            rank's step, profiled with ``gradients="held"`` (FSDP2 reduce-scatters them).
        solver: the planner for the activations' budget.
        options: passed to ``solve``.

    Returns:
        A FitReport: whether the step fits, the activation budget left beside the model state,
        and the plan for it.
    """
    if not isinstance(graph, ActivationGraph):
        raise TypeError(f"fit: graph must be an ActivationGraph, got {type(graph).__name__}")
    hw, memory, state, outside, made = memory_beside_state(
        graph, hardware, memory_bytes, host_memory_bytes, ranks
    )
    left = memory - outside
    graph = rank_graph(graph, ranks)
    # optimizer.step() runs once backward has freed the activations: parameters, gradients and
    # state, and what the step itself allocates (runtime/model_state.py)
    optimizer_step = int(state.get("total_bytes", 0)) + int(state.get("optimizer_step_bytes", 0))
    keep_all = keep_all_peak(graph, hw)
    smallest = smallest_budget(graph, hw)
    fewest = _fewest_ranks(graph, memory, smallest.budget_bytes) if ranks != 1 else None
    ideal = graph.ideal_step_time_s
    plan = None
    step = retention = None
    host = 0
    if left <= 0:
        verdict = (
            f"does not fit: the model state alone needs {outside / GIB:.2f} "
            f"GiB of {memory / GIB:.2f} GiB"
        )
    elif optimizer_step > memory:
        verdict = (
            f"does not fit: the optimizer step needs {optimizer_step / GIB:.2f} GiB of "
            f"{memory / GIB:.2f} GiB (parameters, gradients, state and the step's temporaries)"
        )
    elif left < smallest.budget_bytes:
        verdict = (
            f"does not fit: the smallest plan needs {smallest.budget_bytes / GIB:.2f} GiB "
            f"for activations, {left / GIB:.2f} GiB are left"
            if smallest.proven or left < smallest.lower_bytes
            else f"no plan found: the smallest found needs {smallest.budget_bytes / GIB:.2f} GiB "
            f"for activations, {left / GIB:.2f} GiB are left (not proven: no plan fits below "
            f"{smallest.lower_bytes / GIB:.2f} GiB)"
        )
    else:
        try:
            plan = solve(graph, int(left), hw, solver=solver, **options)
        except InfeasibleBudget as exc:  # a proven smallest budget above what bisection found
            verdict = f"does not fit: {exc}"
        else:
            sim = simulate(graph, plan, hw)
            step, retention, host = sim.step_time_s, sim.retention, sim.swapped_bytes
            verdict = (
                "fits as it is: every activation kept"
                if keep_all <= left
                else f"fits with the plan: {100 * retention:.2f}% of ideal throughput"
            )
    return FitReport(
        graph_name=graph.name,
        hardware=hw.name,
        memory_bytes=int(memory),
        model_state=state,
        activation_memory_bytes=int(left),
        keep_all_peak_bytes=int(keep_all),
        smallest_budget_bytes=int(smallest.budget_bytes),
        smallest_proven=bool(smallest.proven),
        ideal_step_s=float(ideal),
        plan=plan,
        step_s=step,
        retention=retention,
        verdict=verdict,
        gradients_made=made,
        host_bytes=int(host),
        host_memory_bytes=int(hw.host_memory_bytes),
        ranks=ranks,
        fewest_ranks=fewest,
        gathered_bytes=sum(c.h2d_bytes for c in graph.collectives),
        reduced_bytes=sum(c.d2h_bytes for c in graph.collectives),
        collectives_on_link=bool(hw.collectives_on_link and graph.collectives),
    )


MAX_RANKS = 1024


def _fewest_ranks(graph: ActivationGraph, memory: int, smallest: int) -> int | None:
    """The fewest FSDP2 ranks at which one rank's model state, its unsharded buffers and the
    smallest activation budget fit ``memory``, and the optimizer step too (the graph, hence the
    smallest budget, is the same at every count)."""
    for n in range(1, MAX_RANKS + 1):
        st = sharded_model_state(graph, n)
        beside = st["total_bytes"] + st["unsharded_bytes"]
        if memory - beside >= smallest and st["total_bytes"] + st["optimizer_step_bytes"] <= memory:
            return n
    return None
