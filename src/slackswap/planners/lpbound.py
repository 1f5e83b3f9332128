"""An upper bound on the retention any plan can reach: a linear relaxation solved with HiGHS.

Each saved tensor is split fractionally between keep, swap and recompute. Memory at every
position counts what any plan must hold there (formulations/lp-bound.md): kept tensors, the
smallest residency of swapped and recomputed ones, offloads the D2H lane cannot have finished yet,
and prefetches the H2D lane must already have landed. The lanes move at most bandwidth x elapsed
time, stalls buy time at their cost, and reruns cost their ops' forward time. Every valid plan is
a feasible point, so the optimum bounds the best retention from above.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.graph import ActivationGraph
from ..core.hardware import Hardware
from .base import Problem
from .lpbuilder import LPBound, LPBoundBuilder, LPSettings


def lp_bound(
    graph: ActivationGraph,
    budget,
    hw: Hardware | str,
    *,
    integral: bool = False,
    time_limit_s: float | None = None,
    gap: float = 1e-4,
    producer_delay: bool = True,
    improving_solutions: int | None = None,
    max_iterations: int | None = None,
    gap_on_step: bool = True,
    kill_after_s: float | None = None,
    max_nodes: int | None = None,
    allowed=None,
    pins=None,
    mask: np.ndarray | None = None,
    whole_departures: int = 0,
    highs_options: dict[str, Any] | None = None,
) -> LPBound:
    """Upper bound on the retention of any plan for ``graph`` within ``budget`` on ``hw``.

    integral: make the keep/swap/recompute fractions binary and solve the MILP (HiGHS) for at
    most ``time_limit_s``. Every plan's decisions are integral, so its dual bound is still a valid
    bound, usually a little tighter; its decisions (the incumbent) are a good starting point for
    a plan, whose schedule the relaxation does not model (formulations/lp-bound.md).
    producer_delay=False lets a tensor start to leave the instant it exists: a looser relaxation
    whose integral decisions are another starting point for a plan.

    ``allowed``, ``pins`` (as for ``solve``) or a ready ``mask``: the bound of the restricted
    problem, where a decision a tensor may not take has fraction 0.

    ``whole_departures`` (integral only): at the first forward position where keeping
    everything tops the budget, the one most over it, and this many more, a swapped tensor is
    freed only once its whole copy, behind every swapped tensor produced before it, is done
    (lanequeue.py): a tighter bound where single copies take a large share of the forward pass
    (CNNs), at the cost of binaries; 0 (the default) leaves the fluid lanes alone.

    ``gap_on_step``: the integral relaxation stops once its gap is ``gap`` of the whole step
    (False: of the extra time alone, HiGHS's own measure, which runs much longer).
    Limits: ``improving_solutions`` and ``max_nodes`` (integral: stop after that many improving
    solutions, branch-and-bound nodes) and ``max_iterations`` (LP) are work limits, the same on
    any machine;
    ``time_limit_s`` (default 10 s integral, none for the LP) is a hard cap. The status says what
    the bound is: "optimal", "timeout" (a limit stopped it; the bound is what was proven),
    "infeasible" (the budget is below the smallest feasible one), or "unsolved" (HiGHS failed;
    the bound is the trivial one, the ideal step, and ``note`` says why). Never a wrong bound.

    Args:
        graph: the step.
        budget: as for ``solve``.
        hw: the hardware.
        integral, time_limit_s, gap, producer_delay, improving_solutions, max_iterations,
        gap_on_step, kill_after_s, max_nodes, allowed, pins, mask, whole_departures,
        highs_options: as above.

    Returns:
        The LPBound: the bound on the step time (and retention), its status, and the
        relaxation's decision fractions.

    Raises:
        ValueError: whole_departures without integral, or not a non-negative integer.
    """
    settings = LPSettings(
        integral=integral,
        time_limit_s=time_limit_s,
        gap=gap,
        producer_delay=producer_delay,
        improving_solutions=improving_solutions,
        max_iterations=max_iterations,
        gap_on_step=gap_on_step,
        kill_after_s=kill_after_s,
        max_nodes=max_nodes,
        whole_departures=whole_departures,
        highs_options=highs_options,
    )
    return lp_bound_of(Problem.resolve(graph, budget, hw, allowed, pins, mask), settings)


def lp_bound_of(problem: Problem, settings: LPSettings | None = None) -> LPBound:
    """The LP bound of a resolved problem (hardware, budget in bytes and decision mask as the
    planners hold them), solved as ``settings`` say: what the exact planner calls, with nothing
    parsed again."""
    build = LPBoundBuilder(problem, settings or LPSettings())
    build.decisions()
    build.reruns()
    build.lanes()
    build.memory()
    build.add_departure_queue()
    build.copies_within_step()
    return build.solve()
