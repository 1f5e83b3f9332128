"""Repeated blocks: a deep model's step is a prefix, the same block many times, and a suffix.

The exact planner cannot search a 640-layer step's model in its time limit, but it can solve the
same step with a tenth of the blocks, whose plan, stretched back (block j of B takes the
decisions of block floor(j * Bc / B) of Bc), keeps the coarse plan's proportions: the same share
of each block's tensors swapped, recomputed and kept, at the same depth, so the same overhead and,
with the budget scaled by the keep-all peaks, about the same fit. The stretched plan is only a
start: it is repaired to the budget with the step model's rules and simulated like any other
(formulations/milp.md, "Repeated blocks").

Blocks are found from the graph alone: two ops match when their tensor sizes, flags and every
reference (inputs, saved_for, alive_until, rebuilt_before, RNG group mates, collectives), taken
relative to the op's own position inside the repeated run and by index outside it, are equal.
Which decisions a tensor may take (pins, ``allowed=``) is not compared: the coarse graph takes
the rows of its own tensors, and a stretched decision a tensor may not take is replaced
(``consistent``; a saved tensor whose coarse copy is not saved gets one the same way). A graph
with no long periodic run gets no coarse start.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..core.errors import GraphError
from ..core.graph import ActivationGraph, Collective
from ..core.plan import KEEP, RECOMPUTE, SWAP
from .limits import REPEATS_MAX_NARROWED, REPEATS_MAX_PERIOD, REPEATS_MIN_BLOCKS


@dataclass(frozen=True)
class RepeatedBlocks:
    """Ops ``start + j * period + i`` (block j < ``count``, i < ``period``) all match op
    ``start + i``."""

    start: int
    period: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.period * self.count


def op_signatures(graph: ActivationGraph, region: tuple[int, int] | None = None) -> np.ndarray:
    """One integer per op; equal integers for ops that match. Without ``region``: the op's own
    shape only (sizes, counts, flags). With it: every reference too, relative to the op for
    targets inside ``region`` (ops lo..hi-1), by index for targets outside (a tensor of the
    prefix every block reads, the loss op a tensor lives to)."""
    producer = graph.producer.tolist()
    out_pos = {}
    for outs in graph.op_outputs:
        for j, t in enumerate(outs):
            out_pos[t] = j
    op_index = graph.op_index
    collectives: dict[int, list[tuple]] = {}
    for c in graph.collectives:
        collectives.setdefault(op_index[c.op], []).append((c.phase, c.d2h_bytes, c.h2d_bytes))
    saved_for = graph.saved_for_index
    nbytes = graph.tensor_bytes.tolist()
    groups = graph.rng_groups
    lo, hi = region if region is not None else (0, 0)
    interned: dict[tuple, int] = {}
    ids = np.empty(graph.n_ops, dtype=np.int64)
    for k, op in enumerate(graph.ops):

        def ref(o: int, k: int = k) -> tuple[str, int]:
            return ("relative", o - k) if lo <= o < hi else ("at", o)

        def named(name: str | None) -> tuple | bool:
            if region is None or name is None:
                return name is None
            return ref(op_index[name])

        outputs = []
        for t in graph.op_outputs[k]:
            tensor = graph.tensors[t]
            if region is None:
                links: tuple = (len(saved_for[t]), tensor.group is None)
            else:
                mates = (
                    ()
                    if tensor.group is None
                    else tuple(
                        sorted((ref(producer[m]), out_pos[m]) for m in groups.get(tensor.group, ()))
                    )
                )
                links = (tuple(ref(s) for s in saved_for[t]), tensor.group is None, mates)
            outputs.append(
                (nbytes[t], links, named(tensor.alive_until), named(tensor.rebuilt_before))
            )
        inputs = (
            len(graph.op_inputs[k])
            if region is None
            else tuple((ref(producer[t]), out_pos[t]) for t in graph.op_inputs[k])
        )
        key = (
            op.recomputable,
            bool(op.unit),
            bool(op.param_unit),
            op.unit == op.param_unit,
            len(op.inputs),
            inputs,
            tuple(outputs),
            tuple(sorted(collectives.get(k, ()))),
        )
        ids[k] = interned.setdefault(key, len(interned))
    return ids


def _longest_run(ids: np.ndarray, p: int) -> tuple[int, int]:
    """(start, whole blocks) of the longest run of ops with period ``p``."""
    same = np.concatenate(([0], (ids[:-p] == ids[p:]).astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(same))
    if edges.size == 0:
        return 0, 1
    starts, ends = edges[::2], edges[1::2]
    i = int(np.argmax(ends - starts))
    return int(starts[i]), (int(ends[i] - starts[i]) + p) // p


def find_repeats(
    graph: ActivationGraph, min_blocks: int = REPEATS_MIN_BLOCKS
) -> RepeatedBlocks | None:
    """The longest periodic run of ops (the shortest period among equally long runs), if it has
    at least ``min_blocks`` blocks. Periods come from the ops' own shapes; each run is then
    narrowed to where every reference repeats too (op_signatures), longest shape run first,
    until no shape run left is longer than the best narrowed one (a shape period can be an
    artifact: blocks of two ops of one shape, one reading a shared tensor and one the op
    before, repeat with period 1 in shape, 2 in references). Times are not compared: a
    profile's repeated layers differ by its noise, and the coarse graph keeps its own blocks'
    times. A graph whose ops rerun with others (Op.rerun_with: a checkpoint graph) is not
    coarsened: those references cross the blocks."""
    if any(op.rerun_with for op in graph.ops):
        return None
    shapes = op_signatures(graph)
    n = shapes.size
    runs = []  # (ops covered, -period, start) of each period's longest shape run
    for p in range(1, min(REPEATS_MAX_PERIOD, n // min_blocks) + 1):
        start, count = _longest_run(shapes, p)
        if count >= min_blocks:
            runs.append((count * p, -p, start))
    runs.sort(reverse=True)
    best: tuple[int, int, int] | None = None  # (ops covered, period, start), references too
    for covered, neg_p, start in runs[:REPEATS_MAX_NARROWED]:
        if best is not None and best[0] >= covered:
            break  # narrowing never covers more than the shape run it starts from
        p = -neg_p
        begin, count = _longest_run(op_signatures(graph, (start, start + covered)), p)
        if count >= min_blocks and (best is None or count * p > best[0]):
            best = (count * p, p, begin)
    if best is None:
        return None
    covered, p, start = best
    return RepeatedBlocks(start=start, period=p, count=covered // p)


@dataclass(frozen=True)
class Coarse:
    """A coarse graph (``blocks`` of the original's repeats) and, per original tensor, the index
    of the coarse tensor whose decision it takes (-1: not saved)."""

    graph: ActivationGraph
    blocks: int
    source: np.ndarray

    def stretch(self, coarse_codes: np.ndarray) -> np.ndarray:
        """The original graph's decisions from the coarse graph's."""
        codes = np.full(self.source.size, -1, dtype=np.int8)
        mapped = self.source >= 0
        codes[mapped] = coarse_codes[self.source[mapped]]
        return codes


def coarsen(graph: ActivationGraph, repeats: RepeatedBlocks, blocks: int) -> Coarse | None:
    """The graph with ``blocks`` of its repeated blocks: the first ``blocks - 1``, then the last
    one and everything after it (references into the dropped blocks follow the shift). None if
    some reference cannot be carried over."""
    a, p, count = repeats.start, repeats.period, repeats.count
    if not 2 <= blocks < count:
        raise ValueError(f"coarsen: blocks must be in [2, {count}), got {blocks}")
    n = graph.n_ops
    cut, resume = a + (blocks - 1) * p, a + (count - 1) * p  # ops [cut, resume) are dropped
    shift = resume - cut
    ops = graph.ops
    op_index = graph.op_index
    producer = graph.producer
    out_pos = {t: j for outs in graph.op_outputs for j, t in enumerate(outs)}

    def carried_op(o: int, from_first: bool) -> int | None:
        if not cut <= o < resume:
            return o
        o = o + shift if from_first else o - shift
        return o if 0 <= o < n and not cut <= o < resume else None

    def op_name(name: str | None, from_first: bool) -> str | None:
        if name is None:
            return None
        o = carried_op(op_index[name], from_first)
        if o is None:
            raise LookupError(name)
        return ops[o].name

    def tensor_name(name: str, from_first: bool) -> str:
        t = graph.tensor_index.get(name)
        if t is None:
            return name  # not a graph tensor (a parameter, an input): kept as it is
        o = carried_op(int(producer[t]), from_first)
        outs = None if o is None else graph.op_outputs[o]
        if outs is None or out_pos[t] >= len(outs):
            raise LookupError(name)
        return graph.tensors[outs[out_pos[t]]].name

    kept = [k for k in range(n) if not cut <= k < resume]
    try:
        new_ops = {}
        for k in kept:
            first = k < cut
            new_ops[ops[k].name] = replace(
                ops[k], inputs=tuple(dict.fromkeys(tensor_name(x, first) for x in ops[k].inputs))
            )
        new_tensors = []
        for t, tensor in enumerate(graph.tensors):
            q = int(producer[t])
            if cut <= q < resume:
                continue
            first = q < cut
            # a reader in the dropped blocks stands for its copy in the last block where that
            # copy reads this tensor (block blocks-2's output, read by the last block); a tensor
            # every block reads (made before them) is saved for the kept blocks' readers only
            saved_for: list[str] = []
            for reader in tensor.saved_for:
                try:
                    name = op_name(reader, first)
                except LookupError:
                    continue  # its copy would be past the end: the kept readers stand for it
                if (
                    name is not None
                    and name not in saved_for
                    and (name == ops[q].name or tensor.name in new_ops[name].inputs)
                ):
                    saved_for.append(name)
            new_tensors.append(
                replace(
                    tensor,
                    saved_for=tuple(saved_for),
                    alive_until=op_name(tensor.alive_until, first),
                    rebuilt_before=op_name(tensor.rebuilt_before, first),
                )
            )
    except LookupError:
        return None
    collectives = tuple(c for c in graph.collectives if not cut <= op_index[c.op] < resume)
    try:
        coarse = ActivationGraph(
            name=f"{graph.name} ({blocks} of {count} repeated blocks)",
            ops=tuple(new_ops.values()),
            tensors=tuple(new_tensors),
            optimizer_s=graph.optimizer_s,
            collectives=tuple(
                Collective(c.name, c.op, c.phase, c.d2h_bytes, c.h2d_bytes) for c in collectives
            ),
        )
    except GraphError:
        return None  # the blocks' references do not carry over (the coarse start is optional)
    # block j of count takes the decisions of coarse block floor(j * blocks / count)
    coarse_index = coarse.tensor_index
    source = np.full(len(graph.tensors), -1, dtype=np.int64)
    for t in graph.saved:
        q = int(producer[t])
        if a <= q < repeats.end:
            j, i = divmod(q - a, p)
            c = j * blocks // count
            q = a + c * p + i if c < blocks - 1 else resume + i
        name = graph.tensors[graph.op_outputs[q][out_pos[int(t)]]].name
        ct = coarse_index[name]
        source[t] = ct if coarse.is_saved[ct] else -1
    return Coarse(coarse, blocks, source)


def consistent(graph: ActivationGraph, codes: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """Stretched decisions made valid for the original graph: each tensor's decision one it may
    take (else swap, keep or recompute, the first it may), an RNG group recomputed all together
    or not at all (else its recomputed members swapped where they may be, else kept)."""
    codes = codes.copy()
    can_recompute = graph.can_recompute
    for t in graph.saved:
        t = int(t)
        allowed = [
            c
            for c in (KEEP, SWAP, RECOMPUTE)
            if (mask is None or mask[t, c]) and (c != RECOMPUTE or can_recompute[t])
        ]
        if codes[t] not in allowed:
            codes[t] = next((c for c in (SWAP, KEEP, RECOMPUTE) if c in allowed), KEEP)
    for members in graph.rng_groups.values():
        decided = {int(codes[m]) for m in members}
        if RECOMPUTE in decided and len(decided) > 1:
            for m in members:
                if codes[m] == RECOMPUTE:
                    codes[m] = SWAP if mask is None or mask[m, SWAP] else KEEP
    return codes
