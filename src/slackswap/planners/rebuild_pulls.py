"""Rebuilds pull others along (formulations/lp-bound.md, "Rebuilds pull others along"): rows
that keep a recomputed tensor resident from the first use of another whose rebuild reruns it,
added to the LP bound on graphs small enough (PULL_CELLS)."""

from __future__ import annotations

import numpy as np

from ..core.graph import ActivationGraph
from .limits import PULL_DEPTH, PULL_VARS_PER_TENSOR
from .lpmodel import LinearModel


def rebuild_pulls(
    lp: LinearModel,
    graph: ActivationGraph,
    saved,
    column: dict[int, int],
    R,
    u_position,
    nbytes,
    S: int,
) -> np.ndarray | None:
    """rebuild_pull[x, chain, z] (lp-bound.md, "Rebuilds pull others along"): a recomputed x is
    rebuilt by its first backward use; its rerun reads its frontier, and a recomputed frontier
    tensor is rebuilt then too (or earlier), as is a recomputed output of any op rerun for it,
    recursively, and a rebuilt tensor lives until its last use. So where every tensor of such a
    chain from x is recomputed, its last, z, is resident from x's first use on, earlier than its
    own. One variable per chain, at least the AND of its decisions; per z and position the OR of the
    chains covering it (never counted twice). A kept frontier tensor is not extended here: x
    may be rebuilt earlier than its first use (pulled by another), when the kept one is still
    resident."""
    covers: dict[int, dict[int, list[int]]] = {}  # z's column -> first position -> chain variables
    chains_left = PULL_VARS_PER_TENSOR * len(saved)
    for i, x in enumerate(saved):
        if not graph.can_recompute[x]:
            continue
        ux = int(u_position[i])
        # (tensor, chain of R columns from x to it) in breadth-first order
        frontier = [(int(x), [i])]
        seen = {int(x)}
        for _ in range(PULL_DEPTH - 1):
            nxt = []
            for y, chain in frontier:
                reached = {int(t) for t in graph.rerun_frontier[y]}
                reached |= {int(o) for q in graph.rerun_ops[y] for o in graph.op_outputs[q]}
                for z in sorted(reached - seen):
                    j = column.get(z)
                    if j is None:
                        continue
                    seen.add(z)
                    uz = int(u_position[j])
                    if graph.can_recompute[z]:
                        nxt.append((z, chain + [j]))
                        if ux < uz:  # rebuilt with x, before its own first use
                            covers.setdefault(j, {}).setdefault(ux, []).append(
                                _and(lp, [R[c] for c in chain + [j]])
                            )
                            chains_left -= 1
                    if chains_left <= 0:
                        break
                if chains_left <= 0:
                    break
            frontier = nxt
            if chains_left <= 0 or not frontier:
                break
        if chains_left <= 0:
            break
    if not covers:
        return None
    starts: dict[int, list[tuple[int, float]]] = {}
    ends: dict[int, list[tuple[int, float]]] = {}
    for j, by_position in covers.items():
        # resident from the earliest active chain's position to u_z - 1: per segment between the
        # chains' distinct positions, held if any chain started by then is active
        positions = sorted(by_position) + [int(u_position[j])]
        active: list[int] = []
        for a, first in enumerate(positions[:-1]):
            active += by_position[first]
            held = lp.vars(1, ub=1.0)[0]
            for v in active:
                lp.le([v, held], [1, -1], 0.0)
            add_to(starts, first, (held, nbytes[int(saved[j])]))
            add_to(ends, positions[a + 1] - 1, (held, nbytes[int(saved[j])]))
    return lp.running_sum(S, starts, ends)


def _and(lp: LinearModel, variables: list[int]) -> int:
    """A variable at least the AND of binary ``variables``."""
    v = lp.vars(1, ub=1.0)[0]
    lp.le(list(variables) + [v], [1.0] * len(variables) + [-1.0], len(variables) - 1.0)
    return v


def add_to(d: dict, k: int, item) -> None:
    """Appends ``item`` to ``d[k]``: the rows of a running sum, by position."""
    d.setdefault(int(k), []).append(item)
