"""Baseline plans: keep everything, recompute what can be rebuilt from kept tensors, swap all."""

from __future__ import annotations

import time

import numpy as np

from ..core.graph import ActivationGraph
from ..core.plan import RECOMPUTE, SWAP, UNSAVED, SolveInfo
from ..core.stepmodel import keep_all_codes
from .base import Problem, Solution

__all__ = ["KeepAll", "RecomputeAll", "SwapAll", "keep_all_codes", "rebuild_cost",
           "recompute_all_codes", "swap_all_codes"]


def swap_all_codes(graph: ActivationGraph) -> np.ndarray:
    """Offload every saved tensor (vDNN's policy)."""
    return np.where(graph.is_saved, SWAP, UNSAVED).astype(np.int8)


def rebuild_cost(graph: ActivationGraph) -> np.ndarray:
    """Seconds of forward compute to rebuild each tensor once (its rerun ops); one bincount
    over all (tensor, op) pairs, not a sum per tensor (50,003 ops: 0.1 s, not 0.35)."""
    reruns = graph.rerun_ops
    lengths = np.fromiter((len(ops) for ops in reruns), dtype=np.int64, count=len(reruns))
    flat = np.fromiter((q for ops in reruns for q in ops), dtype=np.int64,
                       count=int(lengths.sum()))
    owner = np.repeat(np.arange(len(reruns)), lengths)
    return np.bincount(owner, weights=graph.forward_s[flat], minlength=len(reruns))


def recompute_all_codes(graph: ActivationGraph) -> np.ndarray:
    """Recompute every saved tensor that can be rebuilt from tensors that stay on the device.

    Recomputing a tensor whose rebuild reads another recomputed tensor chains the rebuilds back
    to the start of the step (and rebuilds everything at once), so chains are cut: tensors are
    taken cheapest to rebuild per byte first, and one is recomputed only if no tensor its rebuild
    reads, and no recomputed tensor whose rebuild reads it, is recomputed. Random groups are
    recomputed whole or not at all.
    """
    codes = keep_all_codes(graph)
    cost = rebuild_cost(graph)
    nbytes = np.maximum(graph.tensor_bytes, 1)
    readers: dict[int, list[int]] = {}
    for t in graph.saved:
        for f in graph.rerun_frontier[t]:
            readers.setdefault(f, []).append(int(t))
    order = sorted(graph.saved, key=lambda t: (cost[t] / nbytes[t], t))
    for t in order:
        if codes[t] == RECOMPUTE or not graph.can_recompute[t]:
            continue
        members = list(graph.group_of(int(t)))
        ok = all(
            graph.can_recompute[m]
            and all(codes[f] != RECOMPUTE for f in graph.rerun_frontier[m])
            and all(codes[r] != RECOMPUTE for r in readers.get(m, ()))
            for m in members
        )
        if ok:
            codes[members] = RECOMPUTE
    return codes


class _Baseline:
    name = "baseline"
    options: frozenset[str] = frozenset()
    make = staticmethod(keep_all_codes)

    def is_available(self) -> bool:
        return True

    def solve(self, problem: Problem, **options) -> Solution:
        start = time.perf_counter()
        codes = self.make(problem.graph)
        return Solution(codes, None, SolveInfo(solver=self.name, status="baseline",
                                               wall_s=time.perf_counter() - start))


class KeepAll(_Baseline):
    name = "keep-all"
    make = staticmethod(keep_all_codes)


class RecomputeAll(_Baseline):
    name = "recompute-all"
    make = staticmethod(recompute_all_codes)


class SwapAll(_Baseline):
    name = "swap-all"
    make = staticmethod(swap_all_codes)
