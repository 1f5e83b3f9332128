"""Baseline plans: keep everything, recompute what can be rebuilt from kept tensors, swap all,
and the checkpointing users configure by hand: every block checkpointed (HF
``gradient_checkpointing``), and every block under torch's selective checkpointing that saves
the matrix products and attention (torchtitan's op-level SAC list)."""

from __future__ import annotations

import time

import numpy as np

from ..core.codes import keep_all_codes
from ..core.graph import ActivationGraph
from ..core.plan import KEEP, RECOMPUTE, SWAP, UNSAVED, SolveInfo
from ..core.regions import numbered_blocks, op_regions
from ..core.status import Status
from .base import Problem, Solution

__all__ = [
    "CheckpointBlocks",
    "CheckpointBlocksSavingMatmuls",
    "KeepAll",
    "RecomputeAll",
    "SwapAll",
    "checkpoint_blocks_codes",
    "keep_all_codes",
    "rebuild_cost",
    "recompute_all_codes",
    "swap_all_codes",
]


def swap_all_codes(graph: ActivationGraph, min_swap_bytes: int = 0) -> np.ndarray:
    """Offload every saved tensor (vDNN's policy) the hardware swaps: those under its
    ``min_swap_bytes`` stay."""
    codes = np.where(graph.is_saved, SWAP, UNSAVED).astype(np.int8)
    codes[graph.is_saved & (graph.tensor_bytes < min_swap_bytes)] = KEEP
    return codes


def rebuild_cost(graph: ActivationGraph) -> np.ndarray:
    """Seconds of forward compute to rebuild each tensor once (its rerun ops); one bincount
    over all (tensor, op) pairs, not a sum per tensor (50,003 ops: 0.1 s, not 0.35)."""
    reruns = graph.rerun_ops
    lengths = np.fromiter((len(ops) for ops in reruns), dtype=np.int64, count=len(reruns))
    flat = np.fromiter((q for ops in reruns for q in ops), dtype=np.int64, count=int(lengths.sum()))
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
    frontier = graph.rerun_frontier
    can = graph.can_recompute.tolist()
    readers: dict[int, list[int]] = {}
    for t in graph.saved.tolist():
        for f in frontier[t]:
            readers.setdefault(f, []).append(t)
    recomputed = [False] * len(graph.tensors)  # codes as a list: per-element numpy reads cost more
    order = sorted(graph.saved.tolist(), key=lambda t: (cost[t] / nbytes[t], t))
    for t in order:
        if recomputed[t] or not can[t]:
            continue
        members = graph.group_of(t)
        ok = True
        for m in members:
            if not can[m]:
                ok = False
                break
            for f in frontier[m]:
                if recomputed[f]:
                    ok = False
                    break
            for r in readers.get(m, ()):
                if recomputed[r]:
                    ok = False
                    break
            if not ok:
                break
        if ok:
            for m in members:
                recomputed[m] = True
    codes[np.flatnonzero(recomputed)] = RECOMPUTE
    return codes


# what torchtitan's selective activation checkpointing saves in a block (its _save_list): matrix
# products and the attention kernels; everything else in the block is rerun in backward
SAC_SAVED_OPS = frozenset(
    {
        "aten.mm.default",
        "aten.addmm.default",
        "aten.bmm.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
    }
)


def checkpoint_blocks_codes(
    graph: ActivationGraph, saving: frozenset[str] = frozenset()
) -> np.ndarray:
    """Every block of a stack checkpointed (``core.regions``): a tensor made inside a block and
    read only there is recomputed, unless its op is in ``saving`` (torch's selective
    checkpointing policy); what leaves a block (its output, read by the next) stays, as the
    checkpoint's input does. Embeddings, heads and the loss run plainly. A random group is
    recomputed whole or kept whole."""
    of_op = op_regions(graph)
    blocks = numbered_blocks(of_op)
    codes = keep_all_codes(graph)
    producer = graph.producer.tolist()
    readers: dict[int, set[str]] = {}
    for i, inputs in enumerate(graph.op_inputs):
        for t in inputs:
            readers.setdefault(t, set()).add(of_op[i])
    for t in graph.saved.tolist():
        p = producer[t]
        region = of_op[p] if p >= 0 else ""
        if region not in blocks:
            continue
        inside = readers.get(t, set()) | {of_op[r] for r in graph.saved_for_index[t]}
        if inside - {region}:
            continue  # leaves the block: the next block's checkpoint input
        if str(graph.ops[p].extra.get("aten", "")) in saving:
            continue
        codes[t] = RECOMPUTE
    codes[(codes == RECOMPUTE) & ~graph.can_recompute] = KEEP
    for members in graph.rng_groups.values():
        group = list(members)
        if (codes[group] == RECOMPUTE).any() and not (codes[group] == RECOMPUTE).all():
            codes[group] = KEEP
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
        return Solution(
            codes,
            None,
            SolveInfo(solver=self.name, status=Status.BASELINE, wall_s=time.perf_counter() - start),
        )


class KeepAll(_Baseline):
    name = "keep-all"
    make = staticmethod(keep_all_codes)


class RecomputeAll(_Baseline):
    name = "recompute-all"
    make = staticmethod(recompute_all_codes)


class SwapAll(_Baseline):
    name = "swap-all"
    make = staticmethod(swap_all_codes)

    def solve(self, problem: Problem, **options) -> Solution:
        start = time.perf_counter()
        codes = swap_all_codes(problem.graph, problem.hardware.min_swap_bytes)
        return Solution(
            codes,
            None,
            SolveInfo(solver=self.name, status=Status.BASELINE, wall_s=time.perf_counter() - start),
        )


class CheckpointBlocks(_Baseline):
    name = "checkpoint-blocks"
    make = staticmethod(checkpoint_blocks_codes)


class CheckpointBlocksSavingMatmuls(_Baseline):
    name = "checkpoint-blocks-sac"

    @staticmethod
    def make(graph: ActivationGraph) -> np.ndarray:
        return checkpoint_blocks_codes(graph, SAC_SAVED_OPS)
