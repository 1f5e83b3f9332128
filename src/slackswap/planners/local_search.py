"""Improve a plan's decisions one tensor at a time, each move judged by the simulator.

Planners that reason about memory and copy lanes in aggregate (the SlackSwap heuristic, the LP
relaxation with integral decisions) get most decisions right and a few wrong: a D2H backlog at
the end of the forward pass, one tensor too many recomputed. The step model's exact rules decide
here: a move changes one tensor's decision (a whole RNG group when recompute is involved), the
plan is expanded with its default schedule (yielding to the budget) and simulated, and the move
is kept when it lowers (bytes over the budget, step time, peak). Moves are tried latest-produced
tensor first; while the plan stalls or tops the budget the best move of a tier is taken (below),
otherwise the first improving one, until no move improves or time runs out. At a local optimum
of single moves, exchanges follow: a recomputed tensor takes a cheaper-to-rerun tensor's keep or
swap and that one is recomputed instead (one move alone tops the budget or the lanes; the pair
does not). formulations/local-search.md has the moves and why they are the ones tried.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..check.simulate import SimResult, simulate_decisions
from ..core.graph import ActivationGraph
from ..core.hardware import Hardware
from ..core.plan import KEEP, RECOMPUTE, SWAP
from .baselines import rebuild_cost
from .limits import REPAIR_ROUNDS  # tuning constants: docs/tuning.md


@dataclass(frozen=True)
class SearchResult:
    codes: np.ndarray
    sim: SimResult
    moves: int  # accepted moves
    evaluations: int  # plans simulated
    wall_s: float
    complete: bool  # stopped at a local optimum (no single move improves), not by a limit
    work: int = 0  # positions simulated in all (evaluations x the step's positions)
    clock_stopped: bool = False  # the clock cap, not the work limit, ended it


def _key(sim: SimResult, budget: int) -> tuple[int, float, int, int]:
    """Bytes over the device budget and over the host memory (a move that fills the host past
    ``host_memory_bytes`` is as unfit as one over the budget), then the step, then the peak, then
    the bytes copied: a copy that buys neither time nor headroom is dropped (its lane time is
    what an exchange needs)."""
    host = sim.hardware.host_memory_bytes if sim.hardware is not None else 0
    over_host = max(0, sim.swapped_bytes - host) if host else 0
    return (
        max(0, sim.peak_bytes - budget) + over_host,
        round(sim.step_time_s, 15),
        sim.peak_bytes,
        sim.swapped_bytes,
    )


def _units(graph: ActivationGraph) -> dict[int, tuple[int, ...]]:
    """For each saved tensor, the tensors that must change with it when recompute is involved."""
    return {int(t): graph.group_of(int(t)) for t in graph.saved}


def _rerun_together(graph: ActivationGraph) -> dict[int, tuple[int, ...]]:
    """For each saved tensor, its RNG group and the other saved outputs of its op, with theirs:
    one rerun of an op rebuilds all its outputs, so a move that stops rebuilding one of them
    saves time only if it stops rebuilding all that are rebuilt (a layer norm's output and its
    statistics; formulations/local-search.md, "Units")."""
    parent = {int(t): int(t) for t in graph.saved}

    def root(t: int) -> int:
        while parent[t] != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    first_of_op: dict[int, int] = {}
    for t in parent:
        op = int(graph.producer[t])
        siblings = (first_of_op.setdefault(op, t),) if op >= 0 else ()  # (inputs: no op)
        for m in (*graph.group_of(t), *siblings):
            if m in parent:
                parent[root(m)] = root(t)
    members: dict[int, list[int]] = {}
    for t in sorted(parent):
        members.setdefault(root(t), []).append(t)
    return {t: tuple(members[root(t)]) for t in parent}


# Moves tried. With no overflow and no stall: those that can shorten the step (fewer reruns,
# fewer copies), the first improving one taken. With a stall or an overflow, in tiers, the best
# move of the first tier that has an improving one: dropping a copy (swap -> keep), then
# trading it for a rerun (swap -> recompute), then every other move. Moves to keep whose extra
# residency would top the budget where it is added are not simulated.
_CLEAN = {RECOMPUTE: (KEEP, SWAP), SWAP: (KEEP,), KEEP: ()}
_TIERS = (
    {RECOMPUTE: (), SWAP: (KEEP,), KEEP: ()},
    {RECOMPUTE: (), SWAP: (RECOMPUTE,), KEEP: ()},
    {RECOMPUTE: (KEEP, SWAP), SWAP: (), KEEP: (SWAP, RECOMPUTE)},
)
STALL_TOLERANCE_S = 1e-9


def _exchange_trials(
    graph: ActivationGraph,
    codes: np.ndarray,
    cost: np.ndarray,
    units: dict[int, tuple[int, ...]],
    mask: np.ndarray | None,
    together: dict[int, tuple[int, ...]],
):
    """The decisions of each exchange in the order tried: for each pair of ``_exchanges``, ``t``
    kept first (no copy), then swapped (where keeping tops the budget), with every tensor
    rebuilt by the same reruns (``_rerun_together``)."""
    for t, u in _exchanges(graph, codes, cost, units, mask):
        stopped = _rebuilt_with(t, codes, together)
        for target in (KEEP, SWAP):
            if mask is not None and not all(mask[m, target] for m in stopped):
                continue
            trial = codes.copy()
            trial[list(units[u])] = RECOMPUTE
            trial[list(stopped)] = target
            yield trial


def _rebuilt_with(t: int, codes: np.ndarray, together: dict[int, tuple[int, ...]]) -> list[int]:
    """The recomputed tensors whose reruns a move that stops rebuilding ``t`` must stop too."""
    return [m for m in together[t] if codes[m] == RECOMPUTE]


def _exchanges(
    graph: ActivationGraph,
    codes: np.ndarray,
    cost: np.ndarray,
    units: dict[int, tuple[int, ...]],
    mask: np.ndarray | None,
) -> list[tuple[int, int]]:
    """Pairs (t, u): recomputed ``t`` is kept or swapped and ``u`` (kept or swapped) is
    recomputed instead, where ``u``'s rerun is the cheaper, dearest saving first (formulations/
    local-search.md, "Exchanges"). One tensor of each RNG group stands for the group."""
    recomputed = sorted(
        {min(units[int(t)]) for t in graph.saved if codes[t] == RECOMPUTE},
        key=lambda t: (-cost[t], t),
    )
    if not recomputed:
        return []
    can = graph.can_recompute
    others = [
        min(units[int(u)])
        for u in graph.saved
        if codes[u] != RECOMPUTE
        and int(u) == min(units[int(u)])
        and all(can[m] and (mask is None or mask[m, RECOMPUTE]) for m in units[int(u)])
        and all(codes[m] == codes[u] for m in units[int(u)])
    ]
    others.sort(key=lambda u: (cost[u], u))
    group_cost = {t: float(sum(cost[m] for m in units[t])) for t in [*recomputed, *others]}
    pairs = [(t, u) for t in recomputed for u in others if group_cost[u] < group_cost[t]]
    pairs.sort(key=lambda p: (group_cost[p[1]] - group_cost[p[0]], p))
    return pairs


def _gaps(sim: SimResult) -> dict[int, tuple[int, int]]:
    """Per tensor resident in two pieces (offloaded, or freed and rebuilt): the points between."""
    exp = sim.expansion
    keep = ~exp.iv_transient
    tensors, starts, ends = exp.iv_tensor[keep], exp.iv_start[keep], exp.iv_end[keep]
    first_end: dict[int, int] = {}
    last_start: dict[int, int] = {}
    for t, s_, e_ in zip(tensors.tolist(), starts.tolist(), ends.tolist()):
        first_end[t] = min(first_end.get(t, e_), e_)
        last_start[t] = max(last_start.get(t, s_), s_)
    return {
        t: (first_end[t] + 1, last_start[t] - 1)
        for t in first_end
        if last_start[t] - 1 >= first_end[t] + 1
    }


def _keeping_fits(sim: SimResult, gaps: dict, t: int, nbytes: int, budget: int) -> bool:
    """Would keeping ``t`` resident through its gap stay within the budget (others unchanged)?
    A move that fails this could only fit by making other copies wait: not worth simulating."""
    if t not in gaps:
        return True
    lo, hi = gaps[t]
    return int(sim.memory_bytes[lo : hi + 1].max()) + nbytes <= budget


def improve(
    graph: ActivationGraph,
    hw: Hardware,
    budget: int,
    codes: np.ndarray,
    time_limit_s: float = 5.0,
    max_work: int | None = None,
    mask: np.ndarray | None = None,
    exchanges: bool = False,
) -> SearchResult:
    """Descent from ``codes`` until no single move (nor, with ``exchanges``, exchange) improves;
    never worse than the start. ``mask``: the decisions each tensor may take (moves to others
    are never tried). ``exchanges``: the heuristic's polish asks for them (a dear rerun its rules
    chose); the exact planner's starts do not (taking the first improving exchange there led two
    reference rows to worse plans, GPT-2 XL at 20-30%, and no row to a better one).

    ``max_work`` bounds the positions simulated in all (each evaluation simulates the step's
    ``2n`` positions): a limit on work, the same on any machine, so the same start gives the same
    plan; ``time_limit_s`` is only a cap on the clock."""
    return _Descent(graph, hw, budget, codes, time_limit_s, max_work, mask, exchanges).run()


class _Descent:
    """One local search: it owns the plan so far (decisions, simulation, value) and the count of
    plans simulated; each move is judged by ``attempt`` against the value."""

    def __init__(self, graph, hw, budget, codes, time_limit_s, max_work, mask, exchanges) -> None:
        self.start = time.perf_counter()
        self.exchanges = exchanges
        self.graph, self.hw, self.budget, self.mask = graph, hw, budget, mask
        self.time_limit_s, self.max_work = time_limit_s, max_work
        self.units = _units(graph)
        self.together = _rerun_together(graph)
        self.rerun_cost = rebuild_cost(graph)
        self.order = sorted(
            (int(t) for t in graph.saved), key=lambda t: (-int(graph.producer[t]), t)
        )
        self.codes = np.array(codes, dtype=np.int8, copy=True)
        self.evaluations, self.moves = 0, 0
        self.timed_out = self.clock = False
        sim = self.simulate(self.codes)
        self.take((self.codes, sim, _key(sim, budget)))
        self.moves = 0

    def simulate(self, codes: np.ndarray) -> SimResult:
        self.evaluations += 1
        return simulate_decisions(self.graph, codes, self.hw, self.budget)

    def take(self, candidate: tuple) -> None:
        self.codes, self.sim, self.value = candidate
        self.gaps = _gaps(self.sim)
        self.moves += 1

    def out_of_time(self) -> bool:
        if not self.timed_out:
            if (
                self.max_work is not None
                and self.evaluations * self.graph.n_positions >= self.max_work
            ):
                self.timed_out = True
            elif time.perf_counter() - self.start > self.time_limit_s:
                self.timed_out = self.clock = True
        return self.timed_out

    def trial_of(self, t: int, target: int) -> np.ndarray | None:
        codes, mask, graph = self.codes, self.mask, self.graph
        if codes[t] == RECOMPUTE and target != RECOMPUTE:
            members: Sequence[int] = _rebuilt_with(t, codes, self.together)
        else:
            members = self.units[t] if target == RECOMPUTE else (t,)
        if mask is not None and not all(mask[m, target] for m in members):
            return None
        if target == RECOMPUTE and not all(graph.can_recompute[m] for m in members):
            return None
        nbytes = graph.tensor_bytes
        if target == KEEP and not all(
            _keeping_fits(self.sim, self.gaps, m, int(nbytes[m]), self.budget) for m in members
        ):
            return None
        trial = codes.copy()
        trial[list(members)] = target
        return trial

    def attempt(self, t: int, target: int) -> tuple | None:
        """(decisions, simulation, value) of one move, or None if it is not worth simulating."""
        trial = self.trial_of(t, target)
        if trial is None:
            return None
        sim = self.simulate(trial)
        return trial, sim, _key(sim, self.budget)

    def exchange(self) -> tuple | None:
        """The first exchange that improves the plan (None: none does, or out of work)."""
        for trial in _exchange_trials(
            self.graph, self.codes, self.rerun_cost, self.units, self.mask, self.together
        ):
            if self.out_of_time():
                return None
            sim = self.simulate(trial)
            if _key(sim, self.budget) < self.value:
                return trial, sim, _key(sim, self.budget)
        return None

    def lane_trade(self) -> tuple | None:
        """The first lane trade that improves the plan (None: none does, or out of work).

        A recomputed tensor ``t`` takes the copy lanes of a swapped tensor ``s`` (t -> swap,
        s -> keep), and the memory that adds is covered again by the rules' own cover
        (``repaired``), until the plan fits (at most ``REPAIR_ROUNDS`` rounds). Pairs are
        tried dearest ``t`` first, then the swapped tensors whose copy takes at least ``t``'s
        lane time before the others, each cheapest to rerun first.
        formulations/local-search.md, "Lane trades"."""
        graph, units, cost, mask = self.graph, self.units, self.rerun_cost, self.mask
        codes, nbytes = self.codes, graph.tensor_bytes
        recomputed = sorted(
            {min(units[int(t)]) for t in graph.saved if codes[t] == RECOMPUTE},
            key=lambda t: (-float(cost[list(units[t])].sum()), t),
        )
        swapped = sorted(
            (int(s) for s in graph.saved if codes[s] == SWAP), key=lambda s: (cost[s], s)
        )
        for t in recomputed:
            members = _rebuilt_with(t, codes, self.together)
            if mask is not None and not all(mask[m, SWAP] for m in members):
                continue
            if not all(graph.is_saved[m] for m in members):
                continue
            need = int(nbytes[list(members)].sum())
            # those whose copy alone makes room for t's first, then the smaller ones (the lanes
            # may have had room for part of t's copy already)
            for s in sorted(swapped, key=lambda s: int(nbytes[s]) < need):
                if mask is not None and not mask[s, KEEP]:
                    continue
                if self.out_of_time():
                    return None
                trial = codes.copy()
                trial[list(members)] = SWAP
                trial[s] = KEEP
                tried = self.repaired(trial, protected={s, *members})
                if tried is not None and tried[2] < self.value:
                    return tried
        return None

    def repaired(self, trial: np.ndarray, protected: set[int]) -> tuple | None:
        """``trial`` simulated, and while it tops the budget, the heuristic's cover judged by
        the simulator: at the point most over it, the kept tensor resident there that is
        cheapest to rerun per byte is recomputed, or the smallest whose copy covers the excess
        (else the largest) is swapped, whichever of those that lower the excess gives the
        faster step (not those in ``protected``); at most REPAIR_ROUNDS rounds."""
        budget = self.budget
        sim = self.simulate(trial)
        for _ in range(REPAIR_ROUNDS):
            over = sim.memory_bytes - budget
            p = int(np.argmax(over))
            if over[p] <= 0:
                break
            best = None
            excess = _key(sim, budget)[0]
            for move in self.cover_moves(trial, sim, p, int(over[p]), protected):
                if self.out_of_time():
                    return None
                moved_sim = self.simulate(move)
                key = _key(moved_sim, budget)
                # of the moves that lower the excess, the faster step (a swap that covers it all
                # at once can stall far more than two cheap reruns that cover it in turn)
                if key[0] < excess and (best is None or key[1:] + key[:1] < best[2]):
                    best = (move, moved_sim, key[1:] + key[:1])
            if best is None:
                return None
            trial, sim = best[0], best[1]
        if sim.memory_bytes.max() > budget:
            return None
        return trial, sim, _key(sim, budget)

    def cover_moves(
        self, trial: np.ndarray, sim: SimResult, p: int, excess: int, protected: set[int]
    ) -> list[np.ndarray]:
        """The cover's two candidates at point ``p`` (``repaired``)."""
        graph, units, cost, mask = self.graph, self.units, self.rerun_cost, self.mask
        nbytes = graph.tensor_bytes
        exp = sim.expansion
        live = exp.iv_tensor[(exp.iv_start <= p) & (exp.iv_end >= p) & ~exp.iv_transient]
        kept = [
            x
            for x in np.unique(live).tolist()
            if x in units and x not in protected and trial[x] == KEEP
        ]
        moves = []
        rebuild, price = None, np.inf
        for x in kept:
            group = units[x]
            if all(
                trial[m] == KEEP and graph.can_recompute[m] and (mask is None or mask[m, RECOMPUTE])
                for m in group
            ):
                each = float(cost[list(group)].sum()) / max(1, int(nbytes[list(group)].sum()))
                if each < price:
                    rebuild, price = group, each
        if rebuild is not None:
            move = trial.copy()
            move[list(rebuild)] = RECOMPUTE
            moves.append(move)
        swappable = [x for x in kept if mask is None or mask[x, SWAP]]
        if swappable:
            covering = [x for x in swappable if int(nbytes[x]) >= excess]
            x = (
                min(covering, key=lambda x: (int(nbytes[x]), x))
                if covering
                else max(swappable, key=lambda x: (int(nbytes[x]), -x))
            )
            move = trial.copy()
            move[x] = SWAP
            moves.append(move)
        return moves

    def best_of_tiers(self) -> tuple | None:
        """Stalled or over the budget: the best improving move of the first tier that has one."""
        candidate = None
        for tier in _TIERS:
            for t in self.order:
                if self.out_of_time():
                    break
                for target in tier[int(self.codes[t])]:
                    tried = self.attempt(t, target)
                    if (
                        tried is not None
                        and tried[2] < self.value
                        and (candidate is None or tried[2] < candidate[2])
                    ):
                        candidate = tried
            if candidate is not None:
                return candidate
        return None

    def run(self) -> SearchResult:
        order = self.order
        position = 0  # where the clean scan resumes
        unimproved = 0  # clean moves tried in a row without improvement
        while not self.out_of_time():
            clean = self.value[0] == 0 and self.sim.stall_s <= STALL_TOLERANCE_S
            candidate = None
            if not clean:
                candidate = self.best_of_tiers()
                if candidate is None:
                    break  # no move helps: a local optimum (or out of time)
            elif unimproved >= len(order):
                # a full cycle of single moves found nothing: the exchanges, then a local optimum
                candidate = self.exchange() if self.exchanges else None
                if candidate is None and self.exchanges:
                    candidate = self.lane_trade()
                if candidate is None:
                    break
            else:
                t = order[position]
                position = (position + 1) % len(order)
                unimproved += 1
                for target in _CLEAN[int(self.codes[t])]:
                    tried = self.attempt(t, target)
                    if tried is not None and tried[2] < self.value:
                        candidate = tried
                        break
                if candidate is None:
                    continue
            self.take(candidate)
            unimproved = 0
        return SearchResult(
            codes=self.codes,
            sim=self.sim,
            moves=self.moves,
            evaluations=self.evaluations,
            wall_s=time.perf_counter() - self.start,
            complete=not self.timed_out,
            work=self.evaluations * self.graph.n_positions,
            clock_stopped=self.clock,
        )
