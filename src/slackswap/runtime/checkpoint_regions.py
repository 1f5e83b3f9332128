"""The graph torch's checkpoint runs: the model's blocks as checkpoint regions (region_of,
checkpoint_regions), what a region's replay reruns beyond the plan (RegionOp), the pins that
keep a plan to what a region can do (boundary_pins), and the graph a plan for it is made on
(checkpoint_graph).
"""

from __future__ import annotations

from typing import NamedTuple

from ..core.graph import ActivationGraph
from ..core.plan import Plan
from ..core.regions import op_regions as _op_regions
from ..core.regions import region_of

__all__ = [
    "RegionOp",
    "boundary_pins",
    "checkpoint_graph",
    "checkpoint_regions",
    "op_kind",
    "region_of",
]

# one op, several aten names: the eager profile records the kernel the device ran (batch norm as
# native_batch_norm on CPU, cudnn_batch_norm on CUDA), torch.compile traces its functional form
_SAME_OP = {
    "aten._native_batch_norm_legit": "aten.native_batch_norm",
    "aten._native_batch_norm_legit_functional": "aten.native_batch_norm",
    "aten._native_batch_norm_legit_no_training": "aten.native_batch_norm",
    "aten.cudnn_batch_norm": "aten.native_batch_norm",
    "aten.miopen_batch_norm": "aten.native_batch_norm",
    "aten._batch_norm_with_update": "aten.native_batch_norm",
    "aten._batch_norm_with_update_functional": "aten.native_batch_norm",
}


def op_kind(aten_name: str) -> str:
    """The name a policy matches a call by: ``aten_name`` with the kernels of one op (the
    profile's and the compiler's) under one name, so that each gets the plan's decision instead
    of an unknown op's (saved)."""
    packet, _, overload = aten_name.rpartition(".")
    if packet in _SAME_OP:
        return f"{_SAME_OP[packet]}.default"
    return aten_name


class RegionOp(NamedTuple):
    """One op of a checkpointed region, as its policy treats it."""

    aten: str
    recompute: bool  # PREFER_RECOMPUTE under torch.compile
    swaps: tuple[str, ...]  # the saved outputs the plan swaps
    eager_recompute: bool  # PREFER_RECOMPUTE in eager mode
    # every output the profile named, in order: (name, shape, saved); under torch.compile the
    # traced nodes of a swapping op's outputs are found by them (CompiledOffloads.tag)
    outputs: tuple[tuple[str, tuple[int, ...], bool], ...] = ()
    # cached by the eager policy though written in place later (a kept dropout mask: its
    # empty_like and the bernoulli_ and div_ that fill it): the region's recompute takes the
    # cache as it is after the writes (``cached_writes``)
    cached_write: bool = False
    # writes state a rerun must not write again (batch norm's running statistics): the
    # region's recompute runs shielded (checkpoint._shielded_recompute)
    writes_state: bool = False


def checkpoint_regions(
    plan: Plan, graph: ActivationGraph, regions: list[str] | None = None
) -> dict[str, list[RegionOp]]:
    """Per region (module path) that the plan recomputes or swaps something in: its ops in
    order (``RegionOp``: the aten name, whether the policy reruns it, compiled and eager, and the
    saved outputs the plan swaps: offloaded by torch's pass under torch.compile). ``regions``:
    the module paths to use instead of ``region_of``'s."""
    plan.check_graph(graph)
    of_op = _op_regions(graph, regions)  # a region around another runs unwrapped
    cached = _cached_by_plan(graph, of_op, plan)
    out: dict[str, list[RegionOp]] = {}
    wanted: set[str] = set()
    for i, op in enumerate(graph.ops):
        name = of_op[i]
        if not name:
            continue
        keeps = [graph.tensors[t].name for t in graph.op_outputs[i] if graph.is_saved[t]]
        rebuilt = any(plan.decisions.get(k) == "recompute" for k in keeps)
        swaps = tuple(k for k in keeps if plan.decisions.get(k) == "swap")
        recompute = rebuilt or _rerun_regardless(graph, i, weigh_unread=not swaps)
        if i in cached:  # the plan's decision on what it makes or writes, alone
            eager = cached[i]
        else:
            eager = recompute or _saved_elsewhere_only(graph, i, of_op)
        if rebuilt or swaps:
            wanted.add(name)
        outputs = tuple(
            (
                graph.tensors[t].name,
                tuple(int(d) for d in graph.tensors[t].extra.get("shape", ())),
                bool(graph.is_saved[t]),
            )
            for t in graph.op_outputs[i]
        )
        out.setdefault(name, []).append(
            RegionOp(
                str(op.extra.get("aten", "")),
                recompute,
                swaps,
                eager,
                outputs,
                cached_write=i in cached
                and not cached[i]
                and bool(graph.op_writes[i] or any(graph.writers[t] for t in graph.op_outputs[i])),
                writes_state=not op.recomputable or bool(op.extra.get("writes_state")),
            )
        )
    return {name: ops for name, ops in out.items() if name in wanted}


def _saved_elsewhere_only(graph: ActivationGraph, i: int, of_op: list[str]) -> bool:
    """Whether op ``i``'s saved outputs are read by backward ops outside its region alone (a
    block's output, saved by the next block's norm). In eager mode the region's checkpoint then
    has nothing to save for them: the reader outside saves them as usual, while a cached copy
    (MUST_SAVE) would be held until the region's backward ends, because the checkpoint's
    recompute stops at the region's last save and never takes it back (0.25 MiB per block on
    TinyGPT above the plan)."""
    outs = [t for t in graph.op_outputs[i] if graph.is_saved[t]]
    return bool(outs) and all(of_op[r] != of_op[i] for t in outs for r in graph.saved_for_index[t])


def _rerun_regardless(
    graph: ActivationGraph, i: int, weigh_unread: bool = True, cached: frozenset[int] = frozenset()
) -> bool:
    """Whether the region policy reruns op ``i`` whatever the plan says (PREFER_RECOMPUTE), as
    checkpoint_policy: views and intermediates backward never reads, ops that may not run again
    and ops whose outputs are written in place later (a dropout mask drawn in place: rerun with
    the in-place op, the RNG state restored); and (``weigh_unread``) an op whose outputs backward
    does not read outweigh the ones it keeps (batch norm's output beside its saved statistics):
    torch caches every output of a saved op, so it is cheaper to rerun it from its inputs than
    to hold it twice. ``cached``: ops the eager policy caches though their outputs are written in
    place later (``cached_writes``): those follow the plan's decision."""
    op = graph.ops[i]
    outs = graph.op_outputs[i]
    if (
        not op.recomputable
        or op.extra.get("rerun_by_checkpoint")
        or (i not in cached and any(graph.writers[t] for t in outs))
        or not any(graph.is_saved[t] for t in outs)
    ):
        return True
    if not weigh_unread:
        return False
    kept = sum(int(graph.tensor_bytes[t]) for t in outs if graph.is_saved[t])
    unread = sum(int(graph.tensor_bytes[t]) for t in outs if not graph.is_saved[t])
    return unread > kept


def _region_reruns(
    graph: ActivationGraph, of_op: list[str], cached: frozenset[int] = frozenset()
) -> dict[str, list[int]]:
    """Per region, the ops torch's (eager) checkpoint reruns whenever it reruns the region,
    whatever the plan rebuilds: it runs the region's forward again from its start until the
    region's last op that saves a tensor has saved it (early stop), computing every op its
    policy does not cache (``_rerun_regardless``; ``cached``: ops that follow the plan's
    decision on what they write, ``cached_writes``)."""
    last_save: dict[str, int] = {}
    for i, region in enumerate(of_op):
        if region and len(graph.saved_by_op[i]):
            last_save[region] = i
    out: dict[str, list[int]] = {}
    for i, region in enumerate(of_op):
        # (an op with no output of the graph, a buffer's in-place update, runs shielded and
        # holds nothing)
        if (
            region in last_save
            and i <= last_save[region]
            and len(graph.op_outputs[i])
            and (
                _rerun_regardless(graph, i, cached=cached) or _saved_elsewhere_only(graph, i, of_op)
            )
        ):
            out.setdefault(region, []).append(i)
    return out


class RegionDraws(NamedTuple):
    """What torch's eager checkpoint may cache of a graph's regions, and how their draws are tied
    (``cached_writes``)."""

    # per op whose rerun follows the plan's decision on tensors: those tensors (a cached
    # write's producer and writers: the written tensor; a random op: its saved outputs)
    follows: dict[int, tuple[int, ...]]
    # per region whose draws may be cached: the saved tensors tying them (one RNG group)
    draws: dict[str, tuple[int, ...]]
    # the random ops of the other regions: rerun whatever the plan says
    rerun: frozenset[int]


def cached_writes(graph: ActivationGraph, of_op: list[str]) -> RegionDraws:
    """What torch's eager checkpoint may cache though it is written in place after it is made
    (a dropout mask: ``empty_like``, then ``bernoulli_`` and ``div_`` into it), and what ties the
    region's random draws.

    Selective checkpointing caches an op's output where the op runs; a tensor written in place
    later is cached as it ends up, after its writes (``allow_cache_entry_mutation``). So the
    recompute may take it from the cache, its producer and writers all returning the cached
    tensor, when: only ops of its region save it (the cache holds it until the region's
    recompute, past the backward of a reader outside, which a plan counts it to), its producer
    makes it alone and its writers write it alone and make nothing (each returns the cache), all
    of them in one region and rerunnable, and no other op reads it between its producer and its
    last writer (that op's rerun would read the written tensor). Kept, it is cached; recomputed,
    its producer and writers rerun (the step model's rebuild: producer, then writers).

    The checkpoint restores the RNG state at the region's start for its recompute, so a rerun
    draw matches the forward's only if every draw before it in the region is rerun too: a region
    caches its draws all together or none. Each random op must then follow the plan: a writer of
    such a tensor, or an op whose saved outputs the policy caches when kept (``native_dropout``
    on CUDA, when backward reads its output too). The tensors they write or make are the
    region's tie (one ``Tensor.group`` in ``checkpoint_graph``). In a region with any other draw
    (one the checkpoint reruns regardless), every draw reruns (``RegionDraws.rerun``).
    """
    follows: dict[int, tuple[int, ...]] = {}
    written: dict[int, tuple[int, ...]] = {}  # (tensor: its producer and writers)
    for t, writers in enumerate(graph.writers):
        if not writers or not graph.is_saved[t]:
            continue
        p = int(graph.producer[t])
        region = of_op[p]
        ops = (p, *writers)
        if (
            not region
            or any(of_op[i] != region for i in ops)
            or any(
                not graph.ops[i].recomputable or graph.ops[i].extra.get("rerun_by_checkpoint")
                for i in ops
            )
            or graph.op_outputs[p] != (t,)
            or any(of_op[r] != region for r in graph.saved_for_index[t])
            or any(graph.op_outputs[w] or graph.op_writes[w] != {t} for w in writers)
            or any(t in graph.op_inputs[j] for j in range(p + 1, writers[-1]) if j not in writers)
        ):
            continue
        written[t] = ops
    drawn_by: dict[int, int] = {w: t for t, ops in written.items() for w in ops[1:]}
    draws: dict[str, list[int]] = {}
    drawing: dict[str, list[int]] = {}
    untied: set[str] = set()
    for i, op in enumerate(graph.ops):
        region = of_op[i]
        if not op.extra.get("random") or not region:
            continue
        drawing.setdefault(region, []).append(i)
        saved = [t for t in graph.op_outputs[i] if graph.is_saved[t]]
        if i in drawn_by:
            draws.setdefault(region, []).append(drawn_by[i])
        elif (
            saved
            and not any(graph.writers[t] for t in graph.op_outputs[i])
            and not _rerun_regardless(graph, i)
            and not _saved_elsewhere_only(graph, i, of_op)
        ):
            follows[i] = tuple(saved)
            draws.setdefault(region, []).extend(saved)
        else:
            untied.add(region)
    for region in untied:  # a draw the checkpoint reruns anyway: all the region's rerun
        draws.pop(region, None)
        for i in drawing[region]:
            follows.pop(i, None)
            if i in drawn_by:
                written.pop(drawn_by[i], None)
    for t, ops in written.items():
        for i in ops:
            follows[i] = (t,)
    rerun = frozenset(i for region in untied for i in drawing[region])
    return RegionDraws(follows, {r: tuple(dict.fromkeys(ts)) for r, ts in draws.items()}, rerun)


def _cached_by_plan(graph: ActivationGraph, of_op: list[str], plan: Plan) -> dict[int, bool]:
    """Per op of ``cached_writes``, whether the eager policy reruns it under ``plan`` (True:
    a tensor it follows is recomputed, or it is a draw the checkpoint reruns regardless) or
    caches it. A plan that recomputes one of a region's draws and keeps another (one not made
    for ``checkpoint_graph``, whose group ties them) gets them all rerun: the kept ones hold
    less than it says, never other values."""
    found = cached_writes(graph, of_op)
    tensors = {t for ts in found.follows.values() for t in ts}
    rerun = {t: plan.decisions.get(graph.tensors[t].name) == "recompute" for t in tensors}
    for tied in found.draws.values():
        if any(rerun[t] for t in tied):
            for t in tied:
                rerun[t] = True
    out = {i: any(rerun[t] for t in ts) for i, ts in found.follows.items()}
    out.update((i, True) for i in found.rerun)
    return out


def boundary_pins(graph: ActivationGraph, regions: list[str] | None = None) -> dict[str, str]:
    """Pins that make a plan what ``checkpointed`` can run exactly
    (``g = checkpoint_graph(graph); ss.solve(g, budget, pins=boundary_pins(g))``): every saved
    tensor a region reads but does not produce is held by torch's checkpoint as the region's
    input, and every tensor an op outside any region saves is held by autograd, whatever a plan
    says: plan them as kept. On a ``checkpoint_graph``, what the checkpoint reruns anyway is
    pinned to recompute.

    Args:
        graph: the step.
        regions: the module paths to checkpoint (default: the model's blocks).

    Returns:
        The pins, by tensor name, for ``solve(pins=...)``.
    """
    of_op = _op_regions(graph, regions)
    pins: dict[str, str] = {}
    for i, op in enumerate(graph.ops):  # the checkpoint reruns these whatever a plan says
        if of_op[i] and op.extra.get("rerun_by_checkpoint"):
            for t in graph.op_outputs[i]:
                if graph.is_saved[t] and graph.can_recompute[t]:
                    pins[graph.tensors[t].name] = "recompute"
    for i, name in enumerate(of_op):
        if not name:
            for t in graph.saved_by_op[i]:
                pins[graph.tensors[t].name] = "keep"
            continue
        for t in graph.op_inputs[i]:
            producer = int(graph.producer[t])
            if graph.is_saved[t] and (producer < 0 or of_op[producer] != name):
                pins[graph.tensors[t].name] = "keep"
    return pins


def checkpoint_graph(
    graph: ActivationGraph, regions: list[str] | None = None, compiled: bool = False
) -> ActivationGraph:
    """``graph`` as torch's checkpoint runs it under ``checkpointed``, for plans that simulate
    what the exported policy holds (``solve(g, budget, pins=boundary_pins(g))``):

    - backward reruns a region at once, before its first backward op that reads a saved tensor
      (its entry): every tensor a region makes and saves for its own ops alone is rebuilt by
      then when a plan recomputes it (``Tensor.rebuilt_before``);
    - in eager mode (``compiled=False``) the region's ops that a plan may not rerun (batch norm
      updating its statistics; a tensor written in place later that cannot be cached with its
      writes) are rerun by the checkpoint anyway, with the RNG state restored and the buffers
      shielded: they become rebuildable here (``extra["rerun_by_checkpoint"]``) and
      ``boundary_pins`` recomputes their saved outputs. A dropout mask drawn in place is cached
      as filled when the plan keeps it (``cached_writes``), so the plan decides it; the draws of
      one region share a ``Tensor.group`` (recomputed all or none: the recompute restores one
      RNG state at the region's start). Under torch.compile (``compiled=True``) the recompute is functional (batch norm
      reruns without touching its statistics) and rerun the same way, but random draws and the
      masks they fill are saved instead (``_region_policy``): those stay as profiled.
    - in eager mode the checkpoint reruns a region's forward from its start to its last save,
      every op its policy does not cache, whatever the plan rebuilds there: each op of the
      region reruns with those (``Op.rerun_with``), so their outputs count while the region is
      rebuilt. A compiled backward recomputes only what its graph reads.
    - under torch.compile (``compiled=True``) the compiled backward returns every parameter
      gradient at its end, where eager autograd adds each into ``.grad`` at once: each op's
      backward also holds the parameter gradients made so far (the profile's
      ``extra["param_grad_bytes"]``), counted in its backward workspace (one compiled graph;
      with graph breaks each graph returns its own earlier: this counts more, never less).

    Plans for this graph are for ``checkpointed`` alone: ``ss.apply`` refuses them (its rebuilds
    would rerun such an op without the ops that write its output in place). Plans for ``graph``
    itself assume each tensor is rebuilt just before its first use, which the policy does not do
    (a BN ResNet at 50%: 51 MiB measured against 40 simulated).

    Args:
        graph: the profiled step.
        regions: the module paths to checkpoint (default: the model's blocks).
        compiled: the graph as the compiled backward runs it (its parameter gradients at its
            end).

    Returns:
        The graph a plan for ``checkpointed`` is made on.
    """
    from dataclasses import replace

    if "checkpoint_graph" in graph.extra:
        raise ValueError(
            f"checkpoint_graph: graph {graph.name!r} is one already (its rebuilds and "
            "gradients would be counted twice): pass the profiled graph"
        )
    of_op = _op_regions(graph, regions)
    ops = _acting_anywhere(graph.ops)
    saved_under_compile = _drawn(graph) if compiled else set()
    # in eager mode a tensor written in place later may be cached with its writes; the draws of
    # a region are cached all together or rerun all together (cached_writes)
    found = cached_writes(graph, of_op) if not compiled else RegionDraws({}, {}, frozenset())
    cached, draws = frozenset(found.follows), found.draws
    for i, op in enumerate(ops):
        # an op whose output is written in place later (Op.writes) and cannot be cached with
        # its writes is rerun by the checkpoint with its writers whatever a plan says, as one
        # that may not run again is
        written = any(graph.writers[t] for t in graph.op_outputs[i]) and i not in cached
        if (
            of_op[i]
            and (not op.recomputable or written or i in found.rerun)
            and graph.op_outputs[i]
            and i not in saved_under_compile
        ):
            extra = {**op.extra, "rerun_by_checkpoint": True}
            if not op.recomputable:  # (its recompute runs shielded)
                extra["writes_state"] = True
            ops[i] = replace(op, recomputable=True, extra=extra)
        elif i in saved_under_compile and written:
            ops[i] = replace(op, recomputable=False)  # saved by the compiled policy
    if not compiled:
        # a rebuild in a region reruns with it what the checkpoint reruns there anyway: their
        # outputs are alive during the rerun (the residual add after a block's last batch norm)
        marked_rerun = replace(graph, ops=tuple(ops))
        for region, members in _region_reruns(marked_rerun, of_op, cached).items():
            for i, name in enumerate(of_op):
                if name == region:
                    ops[i] = replace(
                        ops[i], rerun_with=tuple(ops[q].name for q in members if q != i)
                    )
    if compiled and graph.extra.get("parameter_gradients") != "made":
        # (a profile with gradients made in the step counts them already)
        held = 0  # parameter gradients made by the backward so far (it runs the ops in reverse)
        for i in range(len(ops) - 1, -1, -1):
            held += int(ops[i].extra.get("param_grad_bytes", 0))
            # those waiting for a parameter's other readers are in the workspace already
            more = held - int(ops[i].extra.get("param_grad_waiting_bytes", 0))
            if more > 0:
                ops[i] = replace(
                    ops[i],
                    backward_workspace_bytes=ops[i].backward_workspace_bytes + more,
                    rerun_workspace_bytes=ops[i].rerun_workspace_bytes + more,
                )
    marked = replace(
        graph,
        ops=tuple(ops),
        extra={
            **graph.extra,
            "checkpoint_graph": {
                "regions": list(regions) if regions is not None else "per block",
                "compiled": bool(compiled),
            },
        },
    )
    return _rebuilt_at_entry(marked, of_op, draws)


# the profiler's paths of the model's own ops and of those outside it: no checkpoint wraps them
# (``checkpointed`` refuses a plan that rebuilds there)
_UNWRAPPED = ("model", "step")


def _rebuilt_at_entry(
    marked: ActivationGraph, of_op: list[str], draws: dict[str, tuple[int, ...]]
) -> ActivationGraph:
    """``marked`` with each region's rebuildable tensors rebuilt by its entry (its last op that
    saves something: the first to run in backward), each region's draws in one RNG group, and
    each region's inputs held: torch's checkpoint keeps the tensors a region reads from outside
    for its recompute until the region's backward is over (the backward of its first op that
    saves something), saved for backward or not (the embeddings' sum a lone dropout module
    reads: 0.25 MiB on a small GPT-2 the model did not count). An input made saved this way is
    kept by ``boundary_pins``; a region the plan rebuilds nothing in runs unwrapped and holds
    less than this says."""
    from dataclasses import replace

    entry: dict[str, int] = {}
    first_save: dict[str, int] = {}
    for i, name in enumerate(of_op):
        if name and len(marked.saved_by_op[i]):
            entry[name] = max(entry.get(name, i), i)
            first_save.setdefault(name, i)
    held: dict[int, list[str]] = {}
    for i, name in enumerate(of_op):
        if name in first_save and name not in _UNWRAPPED:
            for t in marked.op_inputs[i]:
                if not marked.is_saved[t] and of_op[int(marked.producer[t])] != name:
                    holders = held.setdefault(t, [])
                    if marked.ops[first_save[name]].name not in holders:
                        holders.append(marked.ops[first_save[name]].name)
    tied = {t: region for region, ts in draws.items() for t in ts}
    tensors = []
    for t, tensor in enumerate(marked.tensors):
        if t in tied:  # one RNG state restored for the region: its draws rerun all or none
            tensor = replace(tensor, group=f"rng:checkpoint:{tied[t]}")
        if t in held:  # a region's input the checkpoint holds for its recompute
            tensor = replace(tensor, saved_for=tuple(held[t]))
        region = of_op[int(marked.producer[t])] if marked.producer[t] >= 0 else ""
        readers = marked.saved_for_index[t]
        if (
            region in entry
            and marked.is_saved[t]
            and marked.can_recompute[t]
            and all(of_op[q] == region for q in readers)
        ):
            tensor = replace(tensor, rebuilt_before=marked.ops[entry[region]].name)
        tensors.append(tensor)
    return replace(marked, tensors=tuple(tensors))


def _acting_anywhere(ops) -> list:
    """The ops with every position a hook position: torch's checkpoint and a compiled graph act
    at any op, not only where a saved-tensor hook runs (formulations/step-model.md, "Hook
    positions")."""
    from dataclasses import replace

    return [
        op
        if op.hook_after and op.hook_backward
        else replace(op, hook_after=True, hook_backward=True)
        for op in ops
    ]


def _drawn(graph: ActivationGraph) -> set[int]:
    """Ops that draw random numbers or make a tensor a random op fills in place (a dropout mask:
    ``empty_like``, then ``bernoulli_``): under torch.compile their results are saved."""
    random = {i for i, op in enumerate(graph.ops) if op.extra.get("random")}
    # an in-place draw (aten.bernoulli_.float: the op's name ends with "_") fills its input
    in_place = {
        i
        for i in random
        if str(graph.ops[i].extra.get("aten", "")).partition(".")[2].split(".")[0].endswith("_")
    }
    filled = {t for i in in_place for t in graph.op_inputs[i]}
    return random | {int(graph.producer[t]) for t in filled if graph.producer[t] >= 0}
