"""Whole departures: the D2H lane as a queue of whole tensors, for the integral relaxation.

The LP bound's lanes are fluid: memory falls as an offload's bytes leave. A real swapped tensor
is freed only once its whole copy is done, and the D2H lane carries whole tensors first in first
out, in production order (step-model.md, "Copy lanes"), so at any moment the tensors whose
copies are done are a prefix of that order. On graphs whose tensors take a large share of the
forward pass to copy (CNNs: one VGG activation, 4 ms of an 11 ms step) the fluid lanes free
memory no plan can free. formulations/lp-bound.md, "Whole departures".
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


def whole_departure_positions(
    keep_all: np.ndarray, budget: float, n_ops: int, count: int
) -> list[int]:
    """Forward positions where keeping everything tops the budget: the first, the one most
    over it, and ``count`` more spread between (only forward positions: no rerun runs there, so
    the lane's fluid bytes by a position's start are what can have left by its op)."""
    over = np.flatnonzero(keep_all[:n_ops] > budget)
    if not len(over) or count <= 0:
        return []
    picks = {int(over[0]), int(over[np.argmax(keep_all[over])])}
    picks.update(over[np.linspace(0, len(over) - 1, count).astype(int)].tolist())
    return sorted(picks)


class QueueColumns(NamedTuple):
    """What the queue's rows read of the integral relaxation (lpbound.py): its variables per
    saved tensor (``W``: swapped) and per position (``G`` kept bytes, ``Qp`` swapped bytes
    produced, ``dep`` fluid bytes departed, ``arr`` arrived, ``Freed`` freed after arrival), and
    the constants in the model's units (bytes and durations of the step, the D2H bandwidth,
    one copy's latency, and each position's capacity)."""

    W: np.ndarray
    G: np.ndarray
    Qp: np.ndarray
    dep: np.ndarray
    arr: np.ndarray
    Freed: np.ndarray
    nbytes: np.ndarray
    dur: np.ndarray
    bw_d: float
    lat: float
    cap: np.ndarray


def add_whole_departures(
    lp, graph, saved, columns: QueueColumns, positions, *, sure_ok: bool
) -> np.ndarray:
    """Rows for each forward position k in ``positions``; returns the binaries.

    Binary ``e[x, k]``, non-increasing along the swapped tensors' production order: every
    swapped tensor up to x has left by k. ``a[x, k] = b W e`` (linearised) is x's bytes if it
    has; the bytes gone, ``sum a``, are at most what the fluid lane moved, ``dep[k]``; memory
    counts every swapped tensor produced by k except those gone and no longer read in forward:
    ``G + Qp - D <= cap`` (and with the prefetches, ``+ arr - Freed``). Tensors produced at k
    are not candidates (they are being made); those made at k-1 are (a stall before k lets them
    leave). With ``sure_ok`` (a duplex link that no collective shares) a tensor whose whole
    queue, every swappable tensor up to it, fits in the compute between its producer's end and
    k has left whatever the plan does: it needs no binary and counts as gone once swapped."""
    W, G, Qp, dep, arr, Freed, nbytes, dur, bw_d, lat, cap = columns
    P = np.concatenate([[0.0], np.cumsum(dur)])  # compute time before each position
    prod, last_fwd = graph.producer, graph.last_forward_use
    order = [
        i
        for i in sorted(range(len(saved)), key=lambda i: (int(prod[saved[i]]), int(saved[i])))
        if lp.ub[W[i]] > 0.0
    ]
    queued = np.cumsum([lat + float(nbytes[saved[i]]) / bw_d for i in order])
    binaries: list[int] = []
    for k in positions:
        moved_idx, moved_coef = [dep[k]], [-1.0]  # bytes gone by k - dep[k] <= 0
        freed_idx, freed_coef = [], []  # bytes gone by k and no longer read in forward
        prev_e = None
        for j, i in enumerate(order):
            t = saved[i]
            p = int(prod[t])
            if p >= k:
                break
            b = float(nbytes[t])
            if sure_ok and P[k] >= P[p + 1] + queued[j]:
                var, weight = int(W[i]), b  # gone once swapped: b W
            else:
                e = int(lp.vars(1, ub=1.0)[0])
                binaries.append(e)
                if prev_e is not None:
                    lp.le([e, prev_e], [1.0, -1.0], 0.0)
                prev_e = e
                var, weight = int(lp.vars(1, ub=b)[0]), 1.0  # a = b W e
                lp.le([var, e], [1.0, -b], 0.0)
                lp.le([var, W[i]], [1.0, -b], 0.0)
                lp.le([var, W[i], e], [-1.0, b, b], b)
            moved_idx.append(var)
            moved_coef.append(weight)
            if int(last_fwd[t]) < k:
                freed_idx.append(var)
                freed_coef.append(weight)
        if not freed_idx:
            continue
        lp.le(moved_idx, moved_coef, 0.0)
        D = int(lp.vars(1)[0])
        lp.eq(freed_idx + [D], freed_coef + [-1.0], 0.0)
        lp.le([G[k], Qp[k], D], [1.0, 1.0, -1.0], float(cap[k]))
        lp.le([G[k], Qp[k], D, arr[k], Freed[k]], [1.0, 1.0, -1.0, 1.0, -1.0], float(cap[k]))
    return np.array(binaries, dtype=int)
