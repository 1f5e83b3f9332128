"""The SlackSwap heuristic: offload what compute can hide, recompute the cheapest of the rest.

1. Nominal timeline from the profile (no stalls, no reruns).
2. Transfer budget: the copy time compute can hide. A D2H copy may run from its tensor's
   production to the end of the forward pass; an H2D copy from the start of the backward pass to
   the tensor's first backward use. Each lane carries one copy at a time, so a set of swaps fits
   when, for every window, the copies that must run inside it fit its length.
3. Saved tensors, dearest to rebuild per byte first, are offloaded while both lanes still fit.
4. Where memory tops the budget, the kept tensors resident there that are cheapest to rebuild
   per byte are recomputed until it fits: first those whose rebuild reads no recomputed tensor
   (and that no recomputed tensor's rebuild reads), then, if that is not enough, rebuild chains
   too (a chain rebuilds its tensors together, like a checkpointed segment). If none remain,
   kept tensors there are offloaded with exposed copies.
5. Repair: the plan is expanded with the step model's exact rules; where it still tops the
   budget (rebuild transients, copies that do not finish in time), resident tensors there are
   offloaded, waiting on the copies as needed; as a last resort every tensor is offloaded,
   which fits any budget that can be met.
6. Polish: steps 3-5 once more with tensors rebuilt by the same reruns priced as one bundle
   (the faster plan is kept), then a short local search (planners/local_search.py), bounded by
   work, fixes the few tensors the aggregate rules misjudge (where no candidate fits, it starts
   from the rules' plan if that is less over the budget than the fallback, with 32 times the
   work, ``unfit_polish=False``: without: a recompute-only budget where rebuilding everything
   rematerializes everything at once);
   ``polish=False`` leaves both out
   (the published scheme); ``bundle_reruns=True`` asks for the bundled candidate alone;
   ``exchanges=False`` keeps the local search to single moves, no exchanges or lane trades
   (formulations/local-search.md; refused with ``polish=False``, which has no search).
See formulations/heuristic.md for what it does not see.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..core.codes import keep_all_codes
from ..core.graph import ActivationGraph
from ..core.hardware import Hardware
from ..core.plan import KEEP, RECOMPUTE, SWAP, SolveInfo
from ..core.restrict import first_forbidden
from ..core.status import Status
from ..core.stepmodel import expand, nominal_position_times
from .base import Problem, Solution
from .baselines import rebuild_cost, swap_all_codes
from .limits import (  # tuning constants: docs/tuning.md
    BUNDLED_UP_TO_POSITIONS,
    DEFAULT_TIME_LIMIT_S,
    POLISH_EVALUATIONS_PER_TENSOR,
    POLISH_POSITIONS,
    UNFIT_POLISH_FACTOR,
    UNFIT_POLISH_POSITIONS,
)

NO_RERUNS = None


def hideable_swaps(graph: ActivationGraph, hw: Hardware, order: np.ndarray) -> np.ndarray:
    """Tensors (from ``order``, in that order of preference) whose copies compute can hide."""
    n = graph.n_ops
    start, end = nominal_position_times(graph, [()] * graph.n_positions)
    t_fwd = end[n - 1]
    nbytes = graph.tensor_bytes
    # D2H: window from the producer's end to the end of the forward pass
    slack_d = t_fwd - end[:n]
    # H2D: window from the start of the backward pass to the first use
    slack_h = start[n:] - t_fwd
    p_d2h = hw.latency_s + nbytes / hw.d2h_bytes_per_s
    p_h2d = hw.latency_s + nbytes / hw.h2d_bytes_per_s
    need_at = 2 * n - 1 - graph.first_backward_use - n
    if hw.collectives_on_link:
        # collectives on the link take their lane time out of the windows they fall in
        for c in graph.collectives:
            k = graph.collective_position(c)
            if c.d2h_bytes and k < n:
                slack_d[: k + 1] -= hw.d2h_time(c.d2h_bytes)
            if c.h2d_bytes and k >= n:
                slack_h[k - n :] -= hw.h2d_time(c.h2d_bytes)
    chosen = []
    host_left = hw.host_memory_bytes or np.inf  # the pool holds every swapped tensor
    for t in order:
        if nbytes[t] == 0 or nbytes[t] > host_left:
            continue
        q = int(graph.producer[t])
        pd = p_d2h[t]
        ph = p_h2d[t]
        need = int(need_at[t])
        # one element first (the window's minimum is at most it): most tensors fail there once
        # the lanes fill, without a pass over the window
        if (
            slack_d[q] < pd
            or slack_h[need] < ph
            or slack_d[: q + 1].min() < pd
            or slack_h[need:].min() < ph
        ):
            continue
        slack_d[: q + 1] -= pd
        slack_h[need:] -= ph
        host_left -= nbytes[t]
        chosen.append(int(t))
    return np.array(chosen, dtype=np.int64)


def most_offloaded(graph: ActivationGraph, mask: np.ndarray | None) -> np.ndarray:
    """Every saved tensor swapped where it may be, else recomputed, else kept."""
    codes = swap_all_codes(graph)
    if mask is None:
        return codes
    for t in graph.saved:
        codes[t] = SWAP if mask[t, SWAP] else RECOMPUTE if mask[t, RECOMPUTE] else KEEP
    return codes


def heuristic_codes(
    graph: ActivationGraph,
    hw: Hardware,
    budget: int,
    allow_chains: bool = True,
    mask: np.ndarray | None = None,
    bundle_reruns: bool = False,
    unfit: list | None = None,
    single_cover: bool = True,
) -> tuple[np.ndarray, dict]:
    """The heuristic's decisions and a few counters describing how it got there. ``mask``:
    the decisions each tensor may take (core/restrict.py); None: all. ``bundle_reruns``: tensors
    rebuilt by the same reruns are priced and recomputed together (one cost for q, k and v of
    one projection, not three), where the published rule prices each tensor alone. ``unfit``:
    where the rules end over the budget and the fallback is returned, their own plan is
    appended to it (the polish searches from it: closer to a fit than the fallback).
    ``single_cover``: where one unit covers a position's excess alone more cheaply than the
    per-byte greedy set, it is taken instead (False: the published rule alone)."""
    saved = graph.saved
    cover = _Cover(graph, mask, bundle_reruns, hw.host_memory_bytes)
    codes = keep_all_codes(graph)
    if mask is not None:  # a tensor that may not stay starts where it must go
        for t in saved:
            if not mask[t, KEEP]:
                codes[t] = SWAP if mask[t, SWAP] else RECOMPUTE
    # the copies compute can hide, dearest to rebuild first (formulations/heuristic.md)
    per_byte = cover.per_byte
    dearest = saved[np.argsort(-per_byte[saved], kind="stable")]
    dearest = dearest[cover.may_swap[dearest] & (codes[dearest] == KEEP)]
    swaps = hideable_swaps(graph, hw, dearest)
    codes[swaps] = SWAP
    stats: dict[str, Any] = {
        "hidden_swaps": int(swaps.size),
        "recomputed": 0,
        "exposed_swaps": 0,
        "repairs": 0,
    }
    exp = expand(graph, codes, None, hw)
    if exp.memory().max() <= budget:
        return codes, stats
    cover.start(codes, exp, stats)
    for _ in range(4 * len(saved) + 1):
        over = cover.position_mem - budget
        s = int(np.argmax(over))
        if over[s] <= 0 or not cover.relieve(s, budget, allow_chains, single_cover):
            break
    if fit_to_budget(graph, hw, budget, codes, mask, stats):
        return codes, stats
    stats["fallback"] = "swap-all" if mask is None else "most offloaded allowed"
    if unfit is not None:
        unfit.append(codes)
    return most_offloaded(graph, mask), stats


class _Cover:
    """The heuristic's second phase: where memory still tops the budget, recompute the kept
    tensors alive there, cheapest rebuild per byte first (a greedy set cover), else swap the
    largest; position memory kept up to date as tensors move (exact without rebuild chains)."""

    def __init__(
        self,
        graph: ActivationGraph,
        mask: np.ndarray | None,
        bundle_reruns: bool,
        host_memory_bytes: int = 0,
    ):
        self.graph, self.mask, self.bundle_reruns = graph, mask, bundle_reruns
        self.host_memory_bytes = host_memory_bytes
        nbytes = self.nbytes = graph.tensor_bytes
        cost = self.cost = rebuild_cost(graph)
        may_recompute = self.may_recompute = (
            graph.can_recompute if mask is None else mask[:, RECOMPUTE]
        )
        self.may_swap = graph.is_saved if mask is None else mask[:, SWAP]
        # bundle_reruns: tensors rebuilt by the same reruns (q, k and v of one projection; an
        # op's several saved outputs) are rebuilt together for one cost: their price per byte is
        # the bundle's (its recomputable members' bytes), and they are recomputed together
        self.mates: dict[tuple[int, ...], list[int]] = {}
        priced_bytes = nbytes.astype(float)
        if bundle_reruns:
            for t in graph.saved:
                self.mates.setdefault(tuple(graph.rerun_ops[int(t)]), []).append(int(t))
            for members_ in self.mates.values():
                shared = sum(int(nbytes[m]) for m in members_ if may_recompute[m])
                priced_bytes[members_] = np.maximum(priced_bytes[members_], shared)
        self.per_byte = np.where(may_recompute, cost / np.maximum(priced_bytes, 1), np.inf)

    def start(self, codes: np.ndarray, exp, stats: dict[str, Any]) -> None:
        """From ``codes`` (changed in place from here on) and its expansion."""
        graph = self.graph
        self.codes, self.stats = codes, stats
        # position-level memory, updated as tensors are recomputed (exact without rebuild chains)
        mem_points = exp.memory()
        self.position_mem = np.full(graph.n_positions, 0, dtype=np.int64)
        np.maximum.at(self.position_mem, exp.point_position, mem_points)
        self.last_fwd = graph.last_forward_use
        self.u_position = np.array(
            [graph.bwd_position(int(u)) if u >= 0 else -1 for u in graph.first_backward_use]
        )
        self.readers_of: dict[int, list[int]] = {}
        for t in graph.saved:
            for f in graph.rerun_frontier[t]:
                self.readers_of.setdefault(int(f), []).append(int(t))
        # Python lists for the per-tensor tests below (numpy's per-element access costs more
        # than the test on 50,000-op graphs); ``code_list`` follows every change to ``codes``
        self.code_list = codes.tolist()
        self.can_list = graph.can_recompute.tolist()
        # host memory the swaps may still take (the executor's pool holds every swapped tensor)
        swapped = int(self.nbytes[codes == SWAP].sum())
        self.host_left = (self.host_memory_bytes - swapped) if self.host_memory_bytes else np.inf

    def can_rebuild(self, t: int, chains: bool = False) -> bool:
        code_list, frontier = self.code_list, self.graph.rerun_frontier
        for m in self.graph.group_of(t):
            if code_list[m] != KEEP or not self.can_list[m]:
                return False
            if chains:
                continue
            for f in frontier[m]:
                if code_list[f] == RECOMPUTE:
                    return False
            for r in self.readers_of.get(m, ()):
                if code_list[r] == RECOMPUTE:
                    return False
        return True

    def unit_of(self, t: int, chains: bool) -> list[int]:
        """What recomputing ``t`` recomputes: its group, and with bundle_reruns its bundle's
        kept tensors that may be rebuilt too (their rerun is paid for)."""
        graph = self.graph
        mates_of_t = self.mates[tuple(graph.rerun_ops[t])] if self.bundle_reruns else ()
        unit: list[int] = []
        for x in [t] + [y for y in mates_of_t if y != t]:
            if x != t and not (
                self.code_list[x] == KEEP and self.may_recompute[x] and self.can_rebuild(x, chains)
            ):
                continue
            unit.extend(m for m in graph.group_of(x) if m not in unit)
        return unit

    def freed_at(self, unit: list[int], s: int) -> int:
        last_fwd, u_position, nbytes = self.last_fwd, self.u_position, self.nbytes
        return int(sum(int(nbytes[m]) for m in unit if last_fwd[m] < s < u_position[m]))

    def move(self, m: int, code: int, sign: int) -> None:
        """Tensor ``m`` to ``code``; its bytes leave (sign -1) or return to (+1) the positions
        between its last forward use and its first backward use."""
        self.codes[m] = code
        self.code_list[m] = code
        self.position_mem[self.last_fwd[m] + 1 : self.u_position[m]] += sign * self.nbytes[m]

    def relieve(self, s: int, budget: int, allow_chains: bool, single_cover: bool) -> bool:
        """Position ``s``, the one most over the budget: recompute its cheapest kept tensors
        per byte (or the cheapest single unit that covers it alone), else swap its largest.
        Returns whether anything moved."""
        graph, codes, stats, position_mem, mask = (
            self.graph,
            self.codes,
            self.stats,
            self.position_mem,
            self.mask,
        )
        saved, per_byte, cost = graph.saved, self.per_byte, self.cost
        last_fwd, u_position = self.last_fwd, self.u_position
        removable = saved[(codes[saved] == KEEP) & (last_fwd[saved] < s) & (u_position[saved] > s)]
        if mask is not None:
            removable = removable[mask[removable, SWAP] | mask[removable, RECOMPUTE]]
        moved = False
        excess = int(position_mem[s] - budget)
        order = removable[np.argsort(per_byte[removable], kind="stable")]
        # the cheapest single unit that relieves the whole excess alone, priced before the
        # greedy pass changes anything (see below)
        single, single_cost = None, np.inf
        for t in order:
            t = int(t)
            if (
                np.isfinite(per_byte[t])
                and cost[t] < single_cost
                and self.can_rebuild(t)
                and self.freed_at(self.unit_of(t, False), s) >= excess
            ):
                single, single_cost = t, float(cost[t])
        undo: list[int] = []  # tensors the greedy pass recomputed here, to take back
        greedy_cost = 0.0
        for chains in (False, True):
            for t in order:
                if position_mem[s] <= budget:
                    break
                if not np.isfinite(per_byte[t]) or not self.can_rebuild(int(t), chains):
                    continue
                # its bundle's kept tensors come along: their rerun is paid for
                unit = self.unit_of(int(t), chains)
                greedy_cost += float(cost[t])
                for m in unit:
                    self.move(m, RECOMPUTE, -1)
                    stats["recomputed"] += 1
                    undo.append(m)
                moved = True
            if moved or not allow_chains:
                break
        if single_cover and single is not None and single_cost < greedy_cost * (1 - 1e-9):
            # cost per byte is a greedy covering rule: where a little is missing, the cheapest
            # per byte can be a large tensor whose rerun is dear while a small cheap one covers
            # the excess alone. The better of the greedy set and the best single unit is taken
            # (the covering problem's classic guard against the greedy's worst case)
            for m in reversed(undo):
                self.move(m, KEEP, +1)
                stats["recomputed"] -= 1
            for m in self.unit_of(single, False):
                self.move(m, RECOMPUTE, -1)
                stats["recomputed"] += 1
            stats["single_covers"] = stats.get("single_covers", 0) + 1
            moved = True
        if position_mem[s] > budget and not moved:
            for t in removable[np.argsort(-self.nbytes[removable], kind="stable")]:
                if not self.may_swap[t] or self.nbytes[t] > self.host_left:
                    continue
                if position_mem[s] <= budget:
                    break
                self.host_left -= int(self.nbytes[t])
                self.move(int(t), SWAP, -1)
                stats["exposed_swaps"] += 1
                moved = True
        return moved


def fit_to_budget(
    graph: ActivationGraph,
    hw: Hardware,
    budget: int,
    codes: np.ndarray,
    mask: np.ndarray | None = None,
    stats: dict | None = None,
) -> bool:
    """Repair (step 5), in place: where the plan expanded with the step model's rules still tops
    the budget, resident tensors there are offloaded (rebuilt, where nothing may be swapped),
    largest first. Whether it fits at the end."""
    stats = {} if stats is None else stats
    may_swap = graph.is_saved if mask is None else mask[:, SWAP]
    may_recompute = graph.can_recompute if mask is None else mask[:, RECOMPUTE]
    nbytes = graph.tensor_bytes
    members = graph.group_of
    host = hw.host_memory_bytes
    for _ in range(50):
        if host:  # what the host can still take: larger tensors may no longer be swapped
            host_left = host - int(nbytes[codes == SWAP].sum())
            may_swap = may_swap & (nbytes <= host_left)
        exp = expand(graph, codes, None, hw, budget_bytes=budget)
        mem = exp.memory()
        over_points = np.flatnonzero(mem > budget)
        if over_points.size == 0:
            return True
        stats["repairs"] = stats.get("repairs", 0) + 1
        p = int(over_points[np.argmax(mem[over_points])])
        live = exp.iv_tensor[(exp.iv_start <= p) & (exp.iv_end >= p)]
        live = np.unique(live[graph.is_saved[live] & (codes[live] != SWAP)])
        excess = mem[p] - budget
        if not may_swap[live].any():
            # no swap allowed here (recompute-only): rebuild more of what is resident, largest
            # first, skipping what the op or rerun at this point reads
            reading = set(graph.op_inputs[int(exp.point_op[p])])
            kept = [
                int(t)
                for t in live[np.argsort(-nbytes[live], kind="stable")]
                if codes[t] == KEEP
                and may_recompute[t]
                and t not in reading
                and all(may_recompute[m] and codes[m] == KEEP for m in members(int(t)))
            ]
            if not kept:
                break
            for t in kept:
                for m in members(t):
                    codes[m] = RECOMPUTE
                stats["recomputed"] = stats.get("recomputed", 0) + 1
                excess -= nbytes[t]
                if excess <= 0:
                    break
            continue
        live = live[may_swap[live]]
        room = host - int(nbytes[codes == SWAP].sum()) if host else None
        for t in live[np.argsort(-nbytes[live], kind="stable")]:
            group = [m for m in members(int(t)) if may_swap[m]]
            grown = int(nbytes[group].sum())
            if room is not None:
                if grown > room:
                    continue
                room -= grown
            codes[group] = SWAP
            excess -= nbytes[t]
            if excess <= 0:
                break
    return False


def step_lower_bound(graph: ActivationGraph, hw: Hardware, codes: np.ndarray) -> float:
    """A step time no plan with these decisions beats: the ideal step plus one run of every op
    some recompute reruns, and at least each lane's total copy time."""
    rerun: set[int] = set()
    for t in np.flatnonzero(codes == RECOMPUTE):
        rerun.update(graph.rerun_ops[int(t)])
    swapped = np.flatnonzero((codes == SWAP) & (graph.tensor_bytes > 0))  # empty: maybe no copy
    nbytes = graph.tensor_bytes[swapped].astype(float)
    d2h = float((hw.latency_s + nbytes / hw.d2h_bytes_per_s).sum())
    h2d = float((hw.latency_s + nbytes / hw.h2d_bytes_per_s).sum())
    ideal = graph.ideal_step_time_s
    return max(ideal + float(graph.forward_s[sorted(rerun)].sum()) if rerun else ideal, d2h, h2d)


def _best_of(graph: ActivationGraph, hw: Hardware, budget: int, candidates):
    """The candidate plan with the shortest simulated step that fits, and its simulation (None
    if no candidate fits: the first is returned); a candidate whose lower bound
    (step_lower_bound) cannot beat the best so far is not simulated."""
    from ..check.simulate import run_timeline

    best, best_time, best_sim = None, np.inf, None
    for codes in candidates:
        if best is not None and step_lower_bound(graph, hw, codes) >= best_time:
            continue
        exp = expand(graph, codes, None, hw, budget_bytes=budget)
        if not (codes == SWAP).any() and exp.memory().max() > budget:
            continue  # no copy to wait on: its memory is its expansion's, and it does not fit
        sim = run_timeline(graph, exp, hw, budget)
        if sim.fits and sim.step_time_s < best_time:
            best, best_time, best_sim = codes, sim.step_time_s, sim
    return (best, best_sim) if best is not None else (candidates[0], None)


class SlackSwapHeuristic:
    name = "heuristic"
    options: frozenset[str] = frozenset({"polish", "bundle_reruns", "unfit_polish", "exchanges"})
    honours_restrictions = True  # Problem.mask (allowed=, pins=)

    def is_available(self) -> bool:
        return True

    def solve(self, problem: Problem, **options) -> Solution:
        from .baselines import keep_all_codes, recompute_all_codes

        start = time.perf_counter()
        # solve()'s time limit (None: its default) is a hard cap: the polish, the one phase whose
        # work grows with the graph, stops at it and says so; the work limits alone decide where
        # it does not bind. A planner calling this one without the key (the smallest budget's
        # search, the exact planner's warm start) keeps its own clock.
        deadline = float("inf")
        if "time_limit_s" in options:
            limit = options["time_limit_s"]
            deadline = (start if problem.began is None else problem.began) + (
                DEFAULT_TIME_LIMIT_S if limit is None else float(limit)
            )
        g, hw, budget = problem.graph, problem.hardware, problem.budget_bytes
        unfit: list[np.ndarray] = []
        polish = options.get("polish", True)
        if "exchanges" in options and not polish:
            raise ValueError(
                "heuristic: exchanges= applies to the polish's local search; polish=False "
                "leaves it nothing to act on"
            )
        # the published rules with polish=False; with it, the single-cover guard too
        codes, stats = heuristic_codes(
            g, hw, budget, mask=problem.mask, unfit=unfit, single_cover=polish
        )
        # never worse than a baseline that fits (cheap insurance on unusual graphs)
        baselines = [
            keep_all_codes(g),
            recompute_all_codes(g),
            swap_all_codes(g, hw.min_swap_bytes),
        ]
        if problem.mask is not None:
            baselines = [b for b in baselines if first_forbidden(g, b, problem.mask) is None]
        variants = [codes]
        # the bundled pricing is not the published scheme's rule: it comes with the polish, or
        # alone (the exact planner's start when there is no time for the polish's search)
        bundle = options.get("bundle_reruns", polish)
        if bundle and g.n_positions <= BUNDLED_UP_TO_POSITIONS:
            # the same rules with reruns priced per bundle: far better on some graphs, worse on
            # others; the faster wins
            variants.append(
                heuristic_codes(
                    g, hw, budget, mask=problem.mask, bundle_reruns=True, single_cover=polish
                )[0]
            )
        chosen, simulation = _best_of(g, hw, budget, [*variants, *baselines])
        if chosen is variants[-1] and len(variants) > 1:
            stats["bundled_reruns"] = True
        elif chosen is not codes:
            stats["replaced_by_baseline"] = True
        codes = chosen
        if polish:
            # the aggregate rules misjudge a few tensors (exposed copies where a rerun is free, a
            # rerun whose transient tops the budget): a short descent, one tensor at a time,
            # judged by the simulator, bounded by work (POLISH_EVALUATIONS plans, at most
            # POLISH_POSITIONS simulated positions), so the heuristic stays fast on large graphs
            from ..check.simulate import simulate_decisions
            from .local_search import improve

            evaluations = min(
                POLISH_EVALUATIONS_PER_TENSOR * len(g.saved) + 8,
                POLISH_POSITIONS // max(1, g.n_positions),
            )
            start_codes = codes
            if (
                simulation is None
                and unfit
                and evaluations >= 4
                and options.get("unfit_polish", True)
            ):
                # nothing fits (a recompute-only budget where recomputing everything rebuilds
                # everything at once): the search starts from whichever plan is less over the
                # budget, the rules' own or the fallback, with more work, since the alternative
                # is no plan at all
                over = [simulate_decisions(g, c, hw, budget).peak_bytes for c in (unfit[0], codes)]
                if over[0] < over[1]:
                    start_codes = unfit[0]
                    stats["polish_from"] = "the rules' plan over the budget"
                # (at most UNFIT_POLISH_POSITIONS simulated positions in all)
                evaluations = UNFIT_POLISH_FACTOR * min(
                    POLISH_EVALUATIONS_PER_TENSOR * len(g.saved) + 8,
                    UNFIT_POLISH_POSITIONS // (UNFIT_POLISH_FACTOR * max(1, g.n_positions)),
                )
            if evaluations >= 4:  # fewer: too large a graph to try a move in the work allowed
                result = improve(
                    g,
                    hw,
                    budget,
                    start_codes,
                    time_limit_s=max(0.0, deadline - time.perf_counter()),
                    max_work=evaluations * g.n_positions,
                    mask=problem.mask,
                    exchanges=options.get("exchanges", True),
                )
                stats["polish_moves"] = result.moves
                if result.clock_stopped:
                    stats["clock_stopped"] = ["polish"]
                codes, simulation = result.codes, result.sim
        wall = time.perf_counter() - start
        return Solution(
            codes,
            None,
            SolveInfo(solver=self.name, status=Status.HEURISTIC, wall_s=wall, extra=stats),
            simulation=simulation,
        )
