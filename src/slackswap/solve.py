"""solve(): one entry point for every planner (compare.py sets them side by side).

solve() resolves the budget, refuses one below the smallest feasible budget, runs the planner
registered under ``solver`` (planners/base.py), closes its plan (complete schedule, hardware:
core/complete.py), checks it with the independent checker and simulates it on its own schedule.
A plan that does not fit raises :class:`InfeasibleBudget`; it never escapes as a valid plan.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .check.simulate import SimResult, run_timeline
from .check.validate import validate
from .core.budget import offload_floor, parse_budget
from .core.complete import close_expanded, close_from
from .core.errors import InfeasibleBudget, PlanError
from .core.graph import ActivationGraph
from .core.hardware import Hardware
from .core.hardware import hardware as get_hardware
from .core.plan import KEEP, Plan, SolveInfo, overhead_gap
from .core.restrict import first_forbidden, parse_allowed, restricted
from .core.status import Status
from .core.units import is_smallest
from .planners.base import (
    Problem,
    get_planner,
    honouring_restrictions,
    register_solver,
    solver_names,
)
from .planners.interrupts import interruptible
from .planners.limits import DEFAULT_TIME_LIMIT_S
from .planners.minimal import keep_what_fits
from .planners.minpeak import MinPeak, min_peak
from .solve_options import check_options, check_time_limit, host_allowed, restriction_mask

log = logging.getLogger("slackswap")


def one_of(names: list[str]) -> str:
    """``a, b or c``: names for a message."""
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)


__all__ = [
    "DEFAULT_SOLVER",
    "min_budget",
    "register_solver",
    "smallest_budget",
    "solve",
    "solver_names",
]

DEFAULT_SOLVER = "cpsat"


DEFAULT_HARDWARE = "a100-80gb-pcie4"


def graph_hardware(graph: ActivationGraph, given: Hardware | str | None) -> tuple[Hardware, str]:
    """The hardware to plan for and where it came from: ``given`` ("argument"), else the one the
    graph records (a profiled graph's measured link, an analytic workload's preset: "graph"),
    else the A100 preset ("default")."""
    if given is not None:
        return get_hardware(given), "argument"
    recorded = graph.extra.get("hardware") if isinstance(graph.extra, Mapping) else None
    if isinstance(recorded, Mapping):
        try:
            return Hardware.from_dict(dict(recorded)), "graph"
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"graph {graph.name!r}: its recorded hardware is not valid ({exc}); "
                "pass hardware= explicitly"
            ) from exc
    if isinstance(recorded, str):
        try:
            return get_hardware(recorded), "graph"
        except ValueError:
            pass  # a name this version has no preset for: the default, said so
    return get_hardware(DEFAULT_HARDWARE), "default"


@dataclass(frozen=True)
class _Request:
    """What one solve() call asked, resolved: the graph, hardware, budget in bytes and the
    restrictions (``asked``: the caller's own; ``implied``: the hardware's, a device whose
    memory is the host's), shared by the steps that close, check and refuse its plan."""

    solver: str
    graph: ActivationGraph
    hw: Hardware
    hardware_from: str
    budget_bytes: int
    mask: Any
    allowed: Any
    pins: Mapping[str, str] | None
    asked: bool
    implied: bool = False
    deadline: float | None = None  # time.perf_counter() at which the time limit ends
    searched: MinPeak | None = None  # budget="smallest": the search that chose budget_bytes

    def smallest(self) -> MinPeak:
        """The smallest budget for this request: for budget="smallest" the very search that
        chose it (a search the clock cut short is not run again, to a different answer), else
        searched within what is left of its time."""
        if self.searched is not None:
            return self.searched
        return smallest_budget_of(self.graph, self.hw, self.mask, self.deadline)

    def recorded(self, plan: Plan) -> Plan:
        """``plan`` recording the caller's restrictions, where there are any."""
        if self.allowed is None and not self.pins:
            return plan
        extra = {"allowed": list(parse_allowed(self.allowed)), "pins": dict(self.pins or {})}
        return replace(plan, extra={**plan.extra, **extra})


def solve(
    graph: ActivationGraph,
    budget: float | int | str,
    hardware: Hardware | str | None = None,
    solver: str = DEFAULT_SOLVER,
    time_limit_s: float | None = None,
    *,
    work_s: float | None = None,
    strict: bool = True,
    allowed=None,
    pins: Mapping[str, str] | None = None,
    **options: Any,
) -> Plan:
    """The best plan ``solver`` finds for ``graph`` under ``budget`` on ``hardware``, closed:
    every copy and rebuild position and the hardware travel with it.

    budget: a fraction of the keep-all peak in (0, 1], bytes (int), a string ("12GiB", "50%",
    "4e10"), or "smallest": the smallest budget any plan reaches (``smallest_budget``) with the
    decisions allowed. Raises InfeasibleBudget (with ``min_budget_bytes``) when no plan can fit, or when the solver's
    plan does not fit and ``strict`` is true.

    allowed: the decisions plans may use ("keep", "swap", "recompute"; default all three), e.g.
    ``("keep", "recompute")`` where there is no host to swap to. pins: one decision for named
    tensors. Both are honoured by every planner and the LP bound, recorded in the plan, and
    checked by ``validate``; a solver that cannot honour them is refused by name.

    time_limit_s: a hard cap on the wall time (default 10 s), counted from this
    call (the planner's first load in a process included). Their phases stop on work limits
    (CP-SAT's deterministic time, branch-and-bound nodes, simplex iterations, simulated
    positions) sized by the option ``work_s`` (default: the time limit; the default fits the
    time limit on a 2-core machine with another busy process), so the same input gives the same
    plan, schedule, status and bound on any machine that finishes the work in time. Where the
    clock stops a phase first, ``plan.info.extra["clock_stopped"]`` names it and the status is
    "timeout". ``anytime=True``: the phases share the time limit instead (a faster machine
    searches further; two runs may differ). Where no plan it finds fits (and for "smallest"),
    the smallest budget (``min_budget``) decides between its plan and ``InfeasibleBudget``
    within what is left of the time limit: where the clock stops it, the smallest found so far
    is used (the error says it is unproven; ``min_budget()`` searches without the limit).

    Args:
        graph: the step to plan.
        budget: as above.
        hardware: the hardware (default: the graph's own, else the default preset).
        solver: a registered planner's name (solver_names()).
        time_limit_s: as above.
        work_s: the exact planners' work, in seconds of the reference machine.
        strict: raise when the planner's plan does not fit (False: return it, said so).
        allowed: as above.
        pins: as above.
        options: the planner's own (its ``options``).

    Returns:
        The plan, closed, checked and simulated; ``plan.info`` says its status, bound and gap.

    Raises:
        InfeasibleBudget: no plan fits the budget (``min_budget_bytes`` says what does).
        PlanError: a planner that cannot honour the restrictions, or did not.
        ValueError: an unknown option or solver.
    """
    entered = time.perf_counter()  # the time limit counts from here
    if not isinstance(graph, ActivationGraph):
        raise TypeError(f"solve: graph must be an ActivationGraph, got {type(graph).__name__}")
    hw, hardware_from = graph_hardware(graph, hardware)
    if hardware_from != "argument":
        log.info(
            "solve: planning graph %r for hardware %r (%s)",
            graph.name,
            hw.name,
            "recorded in the graph" if hardware_from == "graph" else "the default",
        )
    time_limit_s = check_time_limit(time_limit_s)
    allowed, implied = host_allowed(hw, allowed)
    mask = restriction_mask(graph, hw, allowed, pins)
    deadline = entered + (DEFAULT_TIME_LIMIT_S if time_limit_s is None else time_limit_s)
    # "smallest": the smallest budget any plan reaches with these decisions
    searched = smallest_budget_of(graph, hw, mask, deadline) if is_smallest(budget) else None
    budget_bytes = parse_budget(budget, graph, hw) if searched is None else searched.budget_bytes
    # the hardware's own restrictions (no host, tensors under min_swap_bytes) bind every planner
    # without the caller asking: a planner that cannot honour a restriction is refused only for
    # the caller's
    asked = (allowed is not None and not implied) or bool(pins)
    req = _Request(solver, graph, hw, hardware_from, budget_bytes, mask, allowed, pins, asked)
    req = replace(req, implied=implied, deadline=deadline, searched=searched)
    if budget_bytes < offload_floor(graph, hw, mask):
        raise _infeasible(req, "")
    planner, options = _planner_for(solver, graph, mask, asked, allowed, work_s, options)
    if not isinstance(strict, (bool, np.bool_)):
        raise TypeError(f"solve: strict must be True or False, got {strict!r}")
    start = time.perf_counter()
    with interruptible():  # Ctrl-C stops native work at once: KeyboardInterrupt, cleaned up
        solution = planner.solve(
            Problem(graph, hw, budget_bytes, mask, began=entered),
            time_limit_s=time_limit_s,
            **options,
        )
    _refuse_forbidden(req, solution.codes)
    plan, expansion, simulated = _closed(graph, solution, hw, budget_bytes)
    plan = _with_extras(req.recorded(plan), graph)
    if not plan.info.wall_s:
        plan = plan.with_info(wall_s=time.perf_counter() - start)
    # the closed plan's own expansion (expanding its complete schedule again gives the same
    # step); the checker below walks the plan independently and refuses a wrong step time
    sim = run_timeline(graph, expansion, hw, budget_bytes) if simulated is None else simulated
    if getattr(planner, "honours_restrictions", False):
        # nothing moved or rebuilt that the budget does not need (a baseline is what it is)
        plan, sim = _minimal(graph, hw, budget_bytes, plan, expansion, sim, mask)
        plan, sim = _within_host(req, plan, sim)
    if implied:
        plan = plan.with_info(allowed_from="hardware")
    plan = plan.with_info(
        predicted_step_time_s=sim.step_time_s,
        hardware_from=hardware_from,
        overhead_gap=overhead_gap(sim.step_time_s, graph.ideal_step_time_s, plan.info.bound),
    )
    plan = _fitting(req, plan, sim.fits, planner, strict)
    if searched is not None:  # "smallest": whether that budget is proven the smallest
        said = {"proven": searched.proven, "clock_stopped": searched.clock_stopped}
        plan = replace(plan, extra={**plan.extra, "smallest_budget": said})
    return plan


def _fitting(req: _Request, plan: Plan, fits: bool, planner, strict: bool) -> Plan:
    """The plan, checked by the independent checker; where it does not fit and ``strict``,
    the smallest-budget plan when that fits (said so in its info), else InfeasibleBudget."""
    graph, hw, budget_bytes = req.graph, req.hw, req.budget_bytes
    check = validate(graph, plan)
    host = [v for v in check.violations if v.kind == "host_memory"]
    if host and strict:
        raise InfeasibleBudget(
            f"solver {req.solver!r} found no plan for graph {graph.name!r} within {budget_bytes} "
            f"bytes of device memory and {hw.host_memory_bytes} of host memory: {host[0]} "
            "(a larger device budget needs fewer swaps; or give the host more, "
            "host_memory_bytes / --host-memory)",
            min_budget_bytes=req.smallest().budget_bytes,
            budget_bytes=budget_bytes,
        )
    if not fits and strict:
        # the planner's plan does not fit: where the smallest-budget plan does, it is returned
        # (a plan exists at every budget min_budget reports), said so in its info; strict=False
        # returns the planner's own plan (compare's rows)
        smallest = req.smallest()
        if smallest.budget_bytes <= budget_bytes and getattr(
            planner, "honours_restrictions", False
        ):
            # (a baseline's plan is what it is: keep-all does not fit, it is not replaced)
            return _fitting(req, _smallest_plan(req, smallest, plan), True, planner, strict)
        raise _infeasible(req, f"solver {req.solver!r} found no plan: {check.violations[0]}; ")
    if strict and not check.ok:
        raise InfeasibleBudget(
            f"solver {req.solver!r} found no plan for graph {graph.name!r} within {budget_bytes} bytes: "
            f"{check.violations[0]}",
            min_budget_bytes=req.smallest().budget_bytes,
            budget_bytes=budget_bytes,
        )
    return plan


def _planner_for(
    solver: str,
    graph: ActivationGraph,
    mask,
    asked: bool,
    allowed,
    work_s: float | None,
    options: dict[str, Any],
) -> tuple[Any, dict[str, Any]]:
    """The planner registered as ``solver`` and the options it gets; refused by name where it
    cannot honour the caller's restrictions or does not take an option."""
    planner = get_planner(solver)
    if restricted(mask, graph) and asked and not getattr(planner, "honours_restrictions", False):
        raise PlanError(
            f"solve: solver {solver!r} cannot honour allowed="
            f"{parse_allowed(allowed)} and pins; use {one_of(honouring_restrictions())}"
        )
    accepted = getattr(planner, "options", None)
    if accepted is not None:
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise ValueError(
                f"solve: solver {solver!r} takes no option(s) {', '.join(unknown)}; "
                f"it takes: {', '.join(sorted(accepted)) or 'none'}"
            )
    check_options({**options, "work_s": work_s})
    if work_s is not None and "work_s" in (accepted or ()):
        options = {**options, "work_s": work_s}  # the planners without work limits ignore it
    return planner, options


def _refuse_forbidden(req: _Request, codes) -> None:
    """A planner's decision outside the allowed ones is refused, saying whose restriction it
    breaks (the hardware's minimum swap size, its having no host, or the caller's)."""
    solver, hw, allowed = req.solver, req.hw, req.allowed
    forbidden = first_forbidden(req.graph, codes, req.mask)
    if forbidden is not None:
        if not req.asked and not req.implied:
            raise PlanError(
                f"solve: solver {solver!r} swaps a tensor under hardware "
                f"{hw.name!r}'s min_swap_bytes ({hw.min_swap_bytes}): {forbidden}"
            )
        if req.implied:
            raise PlanError(
                f"solve: solver {solver!r} swaps ({forbidden}), but hardware "
                f"{hw.name!r} has no host to swap to (its device memory is host "
                "memory); use a solver that keeps or recomputes"
            )
        raise PlanError(
            f"solve: solver {solver!r} does not honour allowed={parse_allowed(allowed)} "
            f"and pins ({forbidden}); use {one_of(honouring_restrictions())}"
        )


def _closed(graph: ActivationGraph, solution, hw: Hardware, budget_bytes: int):
    """The solution closed (complete schedule, hardware: core/complete.py), its expansion, and
    the planner's own simulation where it is of exactly this plan (else None)."""
    simulated = solution.simulation
    if (
        solution.schedule is None
        and simulated is not None
        and simulated.budget_bytes == budget_bytes
        and simulated.hardware == hw
        and np.array_equal(simulated.expansion.codes, solution.codes)
    ):
        # the planner's own simulation of these decisions with the default schedule: its
        # expansion is the closed plan's (no second expansion of the step)
        expansion = simulated.expansion
        plan = close_from(graph, expansion, hw, budget_bytes, solution.info)
    else:
        simulated = None
        plan, expansion = close_expanded(
            graph, solution.codes, solution.schedule, hw, budget_bytes, solution.info
        )
    return plan, expansion, simulated


def _within_host(req: _Request, plan: Plan, sim: SimResult) -> tuple[Plan, SimResult]:
    """A plan whose swapped tensors need more host memory than the hardware has
    (``host_memory_bytes``) gives up swaps, cheapest to rebuild per byte first, each rebuilt
    where it may be (kept otherwise, and a random group's member kept), until the rest fit the
    host; the step model then says whether it still fits the budget (else solve refuses it,
    naming both figures). The exact planner's model has the row already (host_memory)."""
    from .core.codes import decision_codes
    from .core.plan import RECOMPUTE, SWAP
    from .planners.base import Solution
    from .planners.baselines import rebuild_cost

    graph, hw, mask = req.graph, req.hw, req.mask
    limit = hw.host_memory_bytes
    if not limit or sim.swapped_bytes <= limit:
        return plan, sim
    codes = decision_codes(graph, plan)
    nbytes = graph.tensor_bytes
    swapped = np.flatnonzero(codes == SWAP)
    cost = rebuild_cost(graph)
    order = sorted(swapped.tolist(), key=lambda t: (cost[t] / max(int(nbytes[t]), 1), t))
    held = int(nbytes[swapped].sum())
    given_up = 0
    for t in order:
        if held <= limit:
            break
        rebuild = (
            graph.can_recompute[t]
            and graph.tensors[t].group is None
            and (mask is None or mask[t, RECOMPUTE])
        )
        if not rebuild and mask is not None and not mask[t, KEEP]:
            continue  # may neither stay nor be rebuilt: the refusal below names the figures
        codes[t] = RECOMPUTE if rebuild else KEEP
        held -= int(nbytes[t])
        given_up += 1
    info = plan.info.to_dict()
    if info.get("status") == Status.OPTIMAL:
        info["status"] = Status.FEASIBLE
    extra = dict(info.get("extra") or {})
    extra["host_memory"] = (
        f"{given_up} swaps rebuilt or kept instead: the swapped tensors needed "
        f"{sim.swapped_bytes} bytes of host memory, the hardware has {limit}"
    )
    info["extra"] = extra
    solution = Solution(codes, None, SolveInfo.from_dict(info))
    closed, expansion, _ = _closed(graph, solution, hw, req.budget_bytes)
    closed = _with_extras(req.recorded(closed), graph)
    sim = run_timeline(graph, expansion, hw, req.budget_bytes)
    bound = closed.info.bound
    if bound is not None:  # the planner's bound holds; its gap was of the plan before
        gap = max(0.0, (sim.step_time_s - bound) / sim.step_time_s) if sim.step_time_s else 0.0
        closed = closed.with_info(gap=gap)
    return closed, sim


def _with_extras(plan: Plan, graph: ActivationGraph) -> Plan:
    """A plan for a checkpoint graph records so: it is for ``ss.checkpointed`` alone (the
    executor refuses it)."""
    if "checkpoint_graph" in graph.extra:
        plan = replace(
            plan, extra={**plan.extra, "checkpoint_graph": graph.extra["checkpoint_graph"]}
        )
    return plan


def _minimal(
    graph: ActivationGraph,
    hw: Hardware,
    budget_bytes: int,
    plan: Plan,
    expansion,
    sim: SimResult,
    mask,
) -> tuple[Plan, SimResult]:
    """The plan with every swap and recompute turned back to keep that the budget allows at the
    same or a lower step (planners/minimal.py); its info says how many."""
    minimal = keep_what_fits(
        graph, hw, budget_bytes, expansion, sim, None if mask is None else mask[:, KEEP]
    )
    if minimal is None:
        return plan, sim
    info = plan.info
    step = minimal.simulation.step_time_s
    bound = None if info.bound is None else min(info.bound, step)
    gap = None if bound is None else (max(0.0, (step - bound) / step) if step > 0 else 0.0)
    objective = info.objective
    if objective is not None and step < sim.step_time_s:
        objective = step  # no model's objective describes the new decisions: the simulator's
    closed = close_from(
        graph,
        minimal.expansion,
        hw,
        budget_bytes,
        replace(
            info,
            bound=bound,
            gap=gap,
            objective=objective,
            extra={**info.extra, "kept_back": len(minimal.kept_back)},
        ),
    )
    return replace(closed, extra={**plan.extra, **closed.extra}), minimal.simulation


# the smallest budgets found, per graph, hardware and restriction (a failed solve and the
# InfeasibleBudget it raises ask for the same one)
_SMALLEST: dict[tuple, MinPeak] = {}


def smallest_budget_of(
    graph: ActivationGraph, hw: Hardware, mask, deadline: float | None = None
) -> MinPeak:
    """planners/minpeak.py's answer for this graph, hardware and mask, computed once: a search
    that ``deadline`` cut short is not kept (the next caller searches again)."""
    key = (graph.digest, repr(hw), None if mask is None else mask.tobytes())
    found = _SMALLEST.get(key)
    if found is None:
        with interruptible():
            found = min_peak(graph, hw, mask, deadline=deadline)
        if not found.clock_stopped:
            if len(_SMALLEST) > 64:
                _SMALLEST.clear()
            _SMALLEST[key] = found
    return found


def _infeasible(req: _Request, prefix: str) -> InfeasibleBudget:
    graph, hw, mask, budget_bytes = req.graph, req.hw, req.mask, req.budget_bytes
    smallest = req.smallest()
    decisions = (
        "every decision"
        if mask is None
        else f"allowed={parse_allowed(req.allowed)}" + (" and these pins" if req.pins else "")
    )
    if hw.min_swap_bytes and mask is not None:
        decisions += f" (no swap under the hardware's min_swap_bytes, {hw.min_swap_bytes})"
    how = (
        "proven"
        if smallest.proven
        else f"the smallest found, unproven: no plan fits below {smallest.lower_bytes} bytes, "
        f"{100 * (1 - smallest.lower_bytes / max(1, smallest.budget_bytes)):.1f}% less"
    )
    if smallest.clock_stopped and not smallest.proven:
        how += (
            "; the search stopped at solve()'s time limit: min_budget() searches without it, "
            "or give time_limit_s more"
        )
    # "cannot fit" only where it is proven: below the lower bound; above it, nothing was found
    verdict = "cannot fit" if budget_bytes < smallest.lower_bytes else "has no plan found within"
    return InfeasibleBudget(
        f"{prefix}graph {graph.name!r} {verdict} {budget_bytes} bytes with {decisions} on "
        f"{hw.name!r}: a plan fits {smallest.budget_bytes} bytes ({how})",
        min_budget_bytes=smallest.budget_bytes,
        budget_bytes=budget_bytes,
    )


def _smallest_plan(req: _Request, smallest: MinPeak, planned: Plan) -> Plan:
    """The smallest-budget plan, closed at ``budget_bytes``, in place of a planner's plan that
    did not fit."""
    from .core.plan import SolveInfo

    info = SolveInfo(
        solver=planned.info.solver,
        status=Status.FEASIBLE,
        extra={
            **planned.info.extra,
            "plan_from": f"smallest budget ({smallest.method}): the planner's plan did not fit",
        },
    )
    graph, hw, budget_bytes = req.graph, req.hw, req.budget_bytes
    plan, expansion = close_expanded(
        graph, smallest.codes, smallest.schedule, hw, budget_bytes, info
    )
    plan = req.recorded(plan)
    sim = run_timeline(graph, expansion, hw, budget_bytes)
    if req.implied:
        plan = plan.with_info(allowed_from="hardware")
    return plan.with_info(
        predicted_step_time_s=sim.step_time_s, hardware_from=req.hardware_from, overhead_gap=None
    )


def min_budget(
    graph: ActivationGraph,
    hardware: Hardware | str | None = None,
    *,
    allowed=None,
    pins: Mapping[str, str] | None = None,
) -> int:
    """The smallest budget (bytes) a plan fits with the decisions allowed: ``allowed`` and
    ``pins`` as for :func:`solve`, and the hardware's own restriction (a device whose memory is
    the host's keeps and recomputes only). A plan exists at it: ``solve`` at this budget returns
    one. See :func:`smallest_budget` for how it is found and whether it is proven minimal.

    Args:
        graph, hardware, allowed, pins: as for :func:`smallest_budget`.

    Returns:
        The smallest budget in bytes any plan fits.
    """
    return smallest_budget(graph, hardware, allowed=allowed, pins=pins).budget_bytes


def smallest_budget(
    graph: ActivationGraph,
    hardware: Hardware | str | None = None,
    *,
    allowed=None,
    pins: Mapping[str, str] | None = None,
) -> MinPeak:
    """The smallest budget and a plan that fits it (planners/minpeak.py): where every tensor
    that is not pinned to stay may be offloaded, the all-offloaded peak (exact); otherwise the
    heuristic's smallest fitting plan by bisection, then, on graphs of at most MIN_PEAK_CELLS
    (planners/limits.py) positions x saved tensors, the exact planner's model with the budget a variable to minimise (CP-SAT,
    one worker, fixed deterministic time). ``proven``: no plan fits less (``lower_bytes``, the
    offload floor or the model's bound, is the same figure).

    Args:
        graph: the step.
        hardware: the hardware (default: the graph's own, else the default preset).
        allowed: the decisions plans may use (default all three).
        pins: one decision for named tensors.

    Returns:
        The MinPeak: the smallest budget's bytes, a lower bound on it (``proven`` when they
        meet), how it was found, and the decisions and schedule of a plan that fits it.
    """
    if not isinstance(graph, ActivationGraph):
        raise TypeError(f"min_budget: graph must be an ActivationGraph, got {type(graph).__name__}")
    hw, _ = graph_hardware(graph, hardware)
    allowed, _ = host_allowed(hw, allowed)
    return smallest_budget_of(graph, hw, restriction_mask(graph, hw, allowed, pins))
