"""The exact planner's starting plan: the best of the heuristic and two local searches.

The SlackSwap heuristic is fast but greedy. The LP relaxation with integral decisions
(lpbound.py, ``integral=True``) chooses decisions against the whole step's memory and copy-lane
capacity at once, but in aggregate: its plan may wait on a D2H backlog or top the budget where a
whole tensor, not a fraction of one, is still on the device. The local search (local_search.py)
repairs that with the step model's exact rules. A second relaxation with 2% slower copy lanes gives
decisions with headroom for that, a second start. The best plan is the MILP's hint and the floor
of what the exact planner returns; the integral relaxation's bound tightens the proof.
formulations/milp.md, "Solving", steps 1-2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...check.simulate import SimResult, simulate_decisions
from ...core.plan import KEEP, RECOMPUTE, SWAP
from ..base import Problem
from ..local_search import improve


@dataclass
class WarmStart:
    """A plan (decisions and the default schedule it was simulated with) and where it came from."""

    codes: np.ndarray
    free: dict[int, int]
    issue: dict[int, int]
    rebuild: dict[int, int]
    sim: SimResult
    source: str
    heuristic_codes: np.ndarray
    heuristic_sim: SimResult
    bound_s: float | None = None  # the integral relaxation's bound on the step time, if solved
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def step_time_s(self) -> float:
        return self.sim.step_time_s if self.sim.fits else float("inf")

    @property
    def hint(self):
        return self.codes, self.free, self.issue, self.rebuild


def _warm(problem: Problem, codes: np.ndarray, sim: SimResult, source: str, heuristic_codes,
          heuristic_sim, bound_s=None) -> WarmStart:
    """A warm start from decisions and their simulation (whose expansion holds the default
    schedule, yielding to the budget, that the plan was simulated with)."""
    g, exp = problem.graph, sim.expansion
    free = {int(t): int(exp.d2h_free[t]) for t in g.saved if codes[t] == SWAP}
    issue = {int(t): int(exp.h2d_issue[t]) for t in g.saved if codes[t] == SWAP}
    rebuild = {int(t): int(exp.materialize_at[t]) for t in g.saved if codes[t] == RECOMPUTE}
    return WarmStart(codes, free, issue, rebuild, sim, source, heuristic_codes, heuristic_sim,
                     bound_s)


def _better(a: SimResult, b: SimResult) -> bool:
    """a is a better plan than b: it fits where b does not, or it is faster."""
    if a.fits != b.fits:
        return a.fits
    return a.step_time_s < b.step_time_s


def _integral_codes(problem: Problem, relaxation) -> np.ndarray:
    g = problem.graph
    codes = np.full(len(g.tensors), -1, dtype=np.int8)
    for t in g.saved:
        name = g.tensors[int(t)].name
        values = (relaxation.keep[name], relaxation.swap[name], relaxation.recompute[name])
        codes[t] = (KEEP, SWAP, RECOMPUTE)[int(np.argmax(values))]
    return codes


# the second integral relaxation plans with copy lanes this much slower: decisions that leave the
# lanes some headroom for what the fluid model does not see (whole tensors, in production order)
LANE_HEADROOM = 0.98


def warm_start(problem: Problem, polish: bool = True, bound_s: float | None = None,
               gap: float = 1e-3, integral_lp_s: float = 5.0, search_s: float = 10.0) -> WarmStart:
    """The heuristic's plan, improved (``polish``) by local search from the decisions of the
    integral relaxation, of the same with 2% slower lanes, and of the heuristic, whichever
    simulates fastest. Each further start is tried only while the plan is not yet within ``gap``
    of the best known bound (``bound_s`` or the relaxation's). ``integral_lp_s`` limits each
    integral relaxation, ``search_s`` the local searches together."""
    from ..heuristic import SlackSwapHeuristic
    from ..lpbound import lp_bound

    g, hw, budget = problem.graph, problem.hardware, problem.budget_bytes
    h_codes = SlackSwapHeuristic().solve(problem).codes
    h_sim = simulate_decisions(g, h_codes, hw, budget)
    best = _warm(problem, h_codes, h_sim, "heuristic", h_codes, h_sim)

    def proven() -> bool:
        known = [b for b in (bound_s, best.bound_s) if b is not None]
        return bool(known) and best.sim.fits and \
            best.step_time_s - max(known) <= gap * best.step_time_s

    if not polish or proven():
        return best
    notes: dict[str, Any] = {}
    searched = 0.0

    def relaxed_codes(label: str, lanes: float = 1.0, tight: bool = True) -> np.ndarray | None:
        planning_hw = hw if lanes == 1.0 else hw.with_link(
            d2h_bytes_per_s=hw.d2h_bytes_per_s * lanes, h2d_bytes_per_s=hw.h2d_bytes_per_s * lanes)
        relaxation = lp_bound(g, budget, planning_hw, integral=True, time_limit_s=integral_lp_s,
                              producer_delay=tight)
        notes[label] = {"status": relaxation.status, "wall_s": relaxation.wall_s,
                        "retention": relaxation.retention, "lanes": lanes, "tight": tight}
        if lanes == 1.0 and tight and relaxation.status in ("optimal", "timeout") \
                and np.isfinite(relaxation.step_time_s):
            best.bound_s = relaxation.step_time_s  # the real lanes: a valid bound
        return _integral_codes(problem, relaxation) if relaxation.keep else None

    starts = (("integral LP", lambda: relaxed_codes("integral_lp")),
              ("looser integral LP", lambda: relaxed_codes("integral_lp_loose", tight=False)),
              ("integral LP with lane headroom",
               lambda: relaxed_codes("integral_lp_headroom", lanes=LANE_HEADROOM)),
              ("heuristic", lambda: h_codes))
    for label, make in starts:
        if search_s - searched <= 0 or proven():
            break
        codes = make()
        if codes is None or proven():
            continue
        result = improve(g, hw, budget, codes, time_limit_s=search_s - searched)
        searched += result.wall_s
        notes[f"local_search_from_{label.replace(' ', '_')}"] = {
            "retention": result.sim.retention, "fits": result.sim.fits, "moves": result.moves,
            "evaluations": result.evaluations, "wall_s": result.wall_s, "complete": result.complete}
        if _better(result.sim, best.sim):
            best = _warm(problem, result.codes, result.sim, f"{label} + local search", h_codes,
                         h_sim, best.bound_s)
    best.notes = notes
    return best
