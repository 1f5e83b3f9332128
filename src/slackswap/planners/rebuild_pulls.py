"""Rebuilds pull others along (formulations/lp-bound.md, "Rebuilds pull others along"): rows
that keep a recomputed tensor resident from the first use of another whose rebuild reruns it,
however long the chain between them, and that charge a second run of an op two rebuilds at
different positions both rerun. Added to the integral relaxation on graphs small enough
(PULL_CELLS)."""

from __future__ import annotations

import numpy as np

from ..core.graph import ActivationGraph
from .limits import PULL_POINTS_PER_TENSOR, SHARED_RERUN_PAIRS_PER_OP
from .lpmodel import LinearModel


def pull_targets(graph: ActivationGraph, x: int) -> set[int]:
    """The tensors a rebuild of ``x`` brings back with it when they are recomputed: what its
    reruns read (its frontier) and what they make."""
    reached = {int(t) for t in graph.rerun_frontier[x]}
    reached |= {int(o) for q in graph.rerun_ops[x] for o in graph.op_outputs[q]}
    reached.discard(int(x))
    return reached


class RebuildPulls:
    """The pull variables of one relaxation and the rows between them.

    ``rebuilt[j][b]`` (``pulled[z, b]`` in lp-bound.md): recomputed z (column j) is rebuilt by
    position b, one of its pull points (positions before its own first use from which a rebuild
    may hold it). A recomputed x is rebuilt by its first backward use; its rerun reads its
    frontier, and a recomputed frontier tensor is rebuilt then too (or earlier), as is a
    recomputed output of any op rerun for it, and a rebuilt tensor lives until its last use.
    So ``rebuilt[z, b'] >= rebuilt(x, b) + R[z] - 1`` (pull_row) for each x that pulls z and
    each b where x is rebuilt by then (its first use: R[x]; its own pull points), b' the first
    pull point of z at or after b; rebuilt by b means rebuilt by every later point
    (pull_monotone); z is resident from each b it is rebuilt by to its first use. A kept
    frontier tensor is not extended here: x may be rebuilt earlier than its first use (pulled
    by another), when the kept one is still resident."""

    def __init__(
        self,
        lp: LinearModel,
        graph: ActivationGraph,
        saved,
        column: dict[int, int],
        R,
        u_position,
    ) -> None:
        self.lp, self.graph, self.saved, self.R = lp, graph, saved, R
        self.u = [int(v) for v in u_position]
        can = graph.can_recompute
        self.targets: dict[int, list[int]] = {}
        for i, x in enumerate(saved):
            if can[x]:
                self.targets[i] = sorted(
                    column[z] for z in pull_targets(graph, int(x)) if z in column and can[z]
                )
        self.shared = self._shared_reruns(column)
        # the rebuilt variables a second run weighs against: binary (a fraction of an early
        # rebuild would buy a fraction of a rerun); the others are ANDs of binaries already
        self.binaries: set[int] = set()
        points = self._points()
        self.points = points
        self.rebuilt: dict[int, dict[int, int]] = {}
        for j, ordered in points.items():
            cols = lp.vars(len(ordered), ub=1.0)
            self.rebuilt[j] = {b: int(v) for b, v in zip(ordered, cols)}
            for a in range(len(ordered) - 1):  # pull_monotone
                lp.le([cols[a], cols[a + 1]], [1.0, -1.0], 0.0)
        for i, pulled in self.targets.items():
            sources = [(self.u[i], int(R[i]))] + list(self.rebuilt.get(i, {}).items())
            for j in pulled:
                for b, source in sources:
                    point = self.rebuilt_by(j, b)
                    if point is not None:  # pull_row
                        lp.le([source, int(R[j]), point], [1.0, 1.0, -1.0], 1.0)

    def _shared_reruns(self, column: dict[int, int]) -> dict[int, list[tuple[int, int]]]:
        """Per op, pairs (x, y) of recomputable saved tensors whose rebuilds both rerun it, x's
        first use before y's (at most SHARED_RERUN_PAIRS_PER_OP, nearest first uses first)."""
        users: dict[int, list[int]] = {}
        for i in self.targets:
            for q in self.graph.rerun_ops[int(self.saved[i])]:
                users.setdefault(int(q), []).append(i)
        shared: dict[int, list[tuple[int, int]]] = {}
        for q, cols in users.items():
            pairs = [(a, b) for a in cols for b in cols if self.u[a] < self.u[b]]
            pairs.sort(key=lambda p: (self.u[p[1]] - self.u[p[0]], p))
            if pairs:
                shared[q] = pairs[:SHARED_RERUN_PAIRS_PER_OP]
        return shared

    def _points(self) -> dict[int, list[int]]:
        """Each column's pull points: the first uses of the tensors that pull it, directly or
        through a chain of pulls (each pull point of a puller is one of the pulled), and of
        those that share a rerun with it earlier (where it may be rebuilt with them). At most
        PULL_POINTS_PER_TENSOR, spread over the range; a dropped point is rounded up to the next
        kept one, which holds less."""
        graph, saved, u = self.graph, self.saved, self.u
        points: dict[int, set[int]] = {j: set() for j in self.targets}
        for pairs in self.shared.values():
            for x, y in pairs:
                points[y].add(u[x])
        changed = True
        while changed:  # pulls run from later-produced tensors to earlier ones: a few passes
            changed = False
            for i in sorted(self.targets, key=lambda c: -int(graph.producer[saved[c]])):
                reach = points[i] | {u[i]}
                for j in self.targets[i]:
                    new = {b for b in reach if b < u[j]} - points[j]
                    if new:
                        points[j] |= new
                        changed = True
        kept: dict[int, list[int]] = {}
        for j, found in points.items():
            ordered = sorted(found)
            if len(ordered) > PULL_POINTS_PER_TENSOR:
                picks = np.linspace(0, len(ordered) - 1, PULL_POINTS_PER_TENSOR)
                ordered = [ordered[p] for p in sorted(set(picks.round().astype(int).tolist()))]
            if ordered:
                kept[j] = ordered
        return kept

    def rebuilt_by(self, j: int, b: int) -> int | None:
        """The variable of column j's first pull point at or after position b (rebuilt by then
        if rebuilt by b); None where there is none before its own first use."""
        ordered = self.points.get(j)
        if not ordered:
            return None
        k = int(np.searchsorted(ordered, b))
        return None if k == len(ordered) else self.rebuilt[j][ordered[k]]

    def second_runs(self) -> dict[int, int]:
        """Per op rerun by two rebuilds, a variable at least 1 where it runs twice: x and y both
        recomputed and y not rebuilt by x's first use (second_run). Rebuilds at two positions
        each rerun it (a rebuild's intermediates are freed with it); one rebuild of both holds
        y from x's first use, which the pull rows count."""
        lp, R = self.lp, self.R
        second: dict[int, int] = {}
        for q, pairs in self.shared.items():
            v = int(lp.vars(1, ub=1.0)[0])
            second[q] = v
            for x, y in pairs:
                early = self.rebuilt_by(y, self.u[x])
                if early is not None:
                    self.binaries.add(early)
                idx = [int(R[x]), int(R[y]), v] + ([early] if early is not None else [])
                lp.le(idx, [1.0, 1.0, -1.0] + ([-1.0] if early is not None else []), 1.0)
        return second

    def held(self, nbytes, S: int) -> np.ndarray:
        """Bytes held per position by rebuilds ahead of their tensors' first uses."""
        starts: dict[int, list[tuple[int, float]]] = {}
        ends: dict[int, list[tuple[int, float]]] = {}
        for j, ordered in self.points.items():
            size = nbytes[int(self.saved[j])]
            bounds = ordered + [self.u[j]]
            for a, first in enumerate(ordered):
                add_to(starts, first, (self.rebuilt[j][first], size))
                add_to(ends, bounds[a + 1] - 1, (self.rebuilt[j][first], size))
        return self.lp.running_sum(S, starts, ends)


def rebuild_pulls(
    lp: LinearModel, graph: ActivationGraph, saved, column: dict[int, int], R, u_position
) -> RebuildPulls | None:
    """The pull rows of a relaxation (None: no tensor can be rebuilt)."""
    pulls = RebuildPulls(lp, graph, saved, column, R, u_position)
    return pulls if pulls.targets else None


def add_to(d: dict, k: int, item) -> None:
    """Appends ``item`` to ``d[k]``: the rows of a running sum, by position."""
    d.setdefault(int(k), []).append(item)
