"""Closing plans: the one place a schedule is completed with the step model's defaults.

Planners hand their decisions (and whatever positions they chose) to :func:`close`, which fills
the rest with the defaults of formulations/step-model.md ("Default schedule", yielding to the
budget) and names the hardware. A user's hand-made plan goes through :func:`complete` once, which
says so; ``/1`` plan files are completed the same way when loaded with their graph. Downstream
(checker, simulator, executor) only ever reads a closed plan's schedule.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from .codes import codes_to_decisions, decision_codes
from .graph import ActivationGraph
from .hardware import Hardware, hardware
from .plan import Plan, Schedule, SolveInfo, read_plan
from .stepmodel import Expansion, expand

log = logging.getLogger("slackswap")

COMPLETED_NOTE = "schedule completed with the step model's defaults (slackswap.complete)"


def full_schedule(
    graph: ActivationGraph,
    codes: np.ndarray,
    schedule: Schedule | None,
    hw: Hardware,
    budget_bytes: int,
) -> Schedule:
    """Every position the decisions need: the given ones, the step model's defaults for the rest
    (the defaults yield to ``budget_bytes`` where memory tops it)."""
    return expand(graph, codes, schedule, hw, budget_bytes=budget_bytes).schedule(graph)


def close(
    graph: ActivationGraph,
    codes: np.ndarray,
    schedule: Schedule | None,
    hw: Hardware,
    budget_bytes: int,
    info: SolveInfo,
) -> Plan:
    """A closed plan from a planner's decisions and (possibly partial) schedule."""
    return close_expanded(graph, codes, schedule, hw, budget_bytes, info)[0]


def close_expanded(
    graph: ActivationGraph,
    codes: np.ndarray,
    schedule: Schedule | None,
    hw: Hardware,
    budget_bytes: int,
    info: SolveInfo,
) -> tuple[Plan, Expansion]:
    """``close``, with the step model's expansion of the closed plan (the simulator can run it
    without expanding the step again: on a 50,000-op graph an expansion takes half a second)."""
    exp = expand(graph, codes, schedule, hw, budget_bytes=budget_bytes)
    return close_from(graph, exp, hw, budget_bytes, info), exp


def close_from(
    graph: ActivationGraph, exp: Expansion, hw: Hardware, budget_bytes: int, info: SolveInfo
) -> Plan:
    """The closed plan of an expansion: its decisions and every position it holds."""
    return Plan(
        graph_name=graph.name,
        graph_digest=graph.digest,
        budget_bytes=int(budget_bytes),
        decisions=codes_to_decisions(graph, exp.codes),
        schedule=exp.schedule(graph),
        info=info,
        hardware=hw,
        extra={"tensor_bytes": tensor_bytes(graph)},
    )


def tensor_bytes(graph: ActivationGraph) -> dict[str, int]:
    """Bytes of every saved tensor: the executor checks them when it runs without the graph, so
    a plan for another width or batch size with the same tensor names is refused."""
    return {graph.tensors[t].name: int(graph.tensor_bytes[t]) for t in graph.saved}


def complete(plan: Plan, graph: ActivationGraph, hw: Hardware | str | None = None) -> Plan:
    """``plan`` closed for ``graph`` on ``hw`` (default: the plan's hardware): positions it does
    not give get the step model's defaults; a plan already complete is returned as it is (its
    hardware included). The
    completed plan records it in ``info.extra["schedule"]``, and the completion is logged.

    Args:
        plan: the plan, open (decisions alone) or closed.
        graph: the graph the plan was made for (checked by digest).
        hw: the hardware the schedule is for (default: the plan's own).

    Returns:
        The closed plan: its complete schedule and the hardware it was made for.

    Raises:
        PlanError: the plan is for another graph, or names no hardware and none is given.
    """
    plan.check_graph(graph)
    hw = hardware(
        hw
        if hw is not None
        else plan.hardware
        if plan.hardware is not None
        else _need_hardware(plan)
    )
    if plan.is_complete:
        return plan
    codes = decision_codes(graph, plan)
    schedule = full_schedule(graph, codes, plan.schedule, hw, plan.budget_bytes)
    log.warning("plan for graph %r: %s for hardware %r", plan.graph_name, COMPLETED_NOTE, hw.name)
    info = plan.info.to_dict()
    info["schedule"] = COMPLETED_NOTE
    return Plan(
        plan.graph_name,
        plan.graph_digest,
        plan.budget_bytes,
        plan.decisions,
        schedule,
        SolveInfo.from_dict(info),
        {**plan.extra, "tensor_bytes": tensor_bytes(graph)},
        hw,
    )


def _need_hardware(plan: Plan) -> NoReturn:
    from .errors import PlanError

    raise PlanError(
        f"plan for graph {plan.graph_name!r} names no hardware: pass the hardware it "
        "is for, complete(plan, graph, hw)"
    )


def load_plan(
    source: str | Path | Mapping[str, Any] | Plan,
    graph: ActivationGraph | None = None,
    hardware: Hardware | str | None = None,
) -> Plan:
    """Load a plan from a path, JSON text or dict. A ``slackswap.plan/1`` plan (no hardware, maybe
    no schedule) is completed on load when ``graph`` is given, for ``hardware`` (default
    a100-80gb-pcie4, what /1 plans were made for unless told otherwise).

    Args:
        source: a path to a plan file, its JSON text, its dict, or a plan.
        graph: the graph it is for, to complete an older plan's schedule.
        hardware: the hardware for an older plan that names none.

    Returns:
        The plan, closed.

    Raises:
        PlanError: a malformed plan, or one that cannot be closed with what is given.
    """
    plan = read_plan(source)
    if graph is not None and not plan.is_complete:
        plan = complete(plan, graph, hardware or plan.hardware or "a100-80gb-pcie4")
    return plan
