"""A plan as a torch selective-checkpoint policy (``torch.utils.checkpoint``)."""

from __future__ import annotations

import warnings
from typing import NamedTuple

from ..core.errors import PlanError
from ..core.graph import ActivationGraph
from ..core.plan import Plan


def checkpoint_policy(plan: Plan, graph: ActivationGraph):
    """A torch.utils.checkpoint selective-checkpoint policy with ``plan``'s recomputes.

    Ops of ``graph`` that produce a saved tensor the plan keeps or offloads get MUST_SAVE;
    all others PREFER_RECOMPUTE: those whose tensors the plan recomputes, those whose outputs
    backward never reads (views, in-place ops, intermediates), and ops whose outputs are
    later written in place (a dropout mask drawn in place): torch must rerun those with the
    in-place op, so they get PREFER_RECOMPUTE too (checkpoint restores the RNG state). Calls are
    matched to the graph's ops in order, so checkpoint the same forward that was profiled (the
    whole model call); a call that does not match the graph's next op is saved; the graph's first
    op with no match ahead starts the next step. Use with ``create_selective_checkpoint_contexts``.

    Around the whole model call, backward rebuilds the whole forward at once and the step peaks
    where plain training does: to get the plan's peak use :class:`checkpointed`, which
    checkpoints one block at a time with this plan.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    plan.check_graph(graph)
    if plan.count("swap"):
        raise PlanError(
            f"checkpoint_policy: plan has {plan.count('swap')} swapped tensor(s), which a policy "
            "of its own cannot run (eager checkpointing has no offload; torch.compile's pass "
            "needs its nodes marked): run the plan with slackswap.checkpointed under "
            "torch.compile, or with slackswap.apply"
        )
    steps = []
    for i, op in enumerate(graph.ops):
        keeps = [graph.tensors[t].name for t in graph.op_outputs[i] if graph.is_saved[t]]
        # torch caches a saved output where it is made: one written in place later cannot be
        # (Op.writes), so its op reruns with the writers
        written = any(graph.writers[t] for t in graph.op_outputs[i])
        recompute = (
            not op.recomputable
            or written
            or not keeps
            or any(plan.decisions.get(name) == "recompute" for name in keeps)
        )
        steps.append((op_kind(str(op.extra.get("aten", ""))), recompute))
    cursor = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs):
        key = bool(getattr(ctx, "is_recompute", False))
        i = cursor[key]
        name = op_kind(str(func))
        while i < len(steps) and steps[i][0] != name:
            i += 1
        if i >= len(steps):
            if name != steps[0][0]:
                return CheckpointPolicy.MUST_SAVE
            # the graph's first op again with no match ahead: a new step (the graph's tail,
            # the loss, ran outside the checkpointed call)
            i = 0
        cursor[key] = i + 1
        if cursor[key] >= len(steps):
            cursor[key] = 0
        return CheckpointPolicy.PREFER_RECOMPUTE if steps[i][1] else CheckpointPolicy.MUST_SAVE

    return policy


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


def region_of(module_path: str) -> str:
    """The checkpoint region an op's module belongs to: its path up to and including the first
    numbered component (``blocks.3``, ``model.layers.7``, ``layer2.1``: one block of a stack),
    else the module itself (``transformer.wte``, ``head``). "" (the model's own ops) is no region.
    A region that contains another (``transformer`` around ``transformer.h.0``) is dropped by
    ``checkpoint_regions``: its own ops run unwrapped."""
    parts = module_path.split(".") if module_path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return module_path


def _module_of(op) -> str:
    return str(op.extra.get("module", op.name.split("/")[0] if "/" in op.name else ""))


class RegionOp(NamedTuple):
    """One op of a checkpointed region, as its policy treats it."""

    aten: str
    recompute: bool  # PREFER_RECOMPUTE under torch.compile
    swaps: tuple[str, ...]  # the saved outputs the plan swaps
    eager_recompute: bool  # PREFER_RECOMPUTE in eager mode


def checkpoint_regions(
    plan: Plan, graph: ActivationGraph, regions: list[str] | None = None
) -> dict[str, list[RegionOp]]:
    """Per region (module path) that the plan recomputes or swaps something in: its ops in
    order (``RegionOp``: the aten name, whether the policy reruns it, compiled and eager, and the
    saved outputs the plan swaps: offloaded by torch's pass under torch.compile). ``regions``:
    the module paths to use instead of ``region_of``'s."""
    plan.check_graph(graph)
    of_op = _op_regions(graph, regions)  # a region around another runs unwrapped
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
        eager = recompute or _saved_elsewhere_only(graph, i, of_op)
        if rebuilt or swaps:
            wanted.add(name)
        out.setdefault(name, []).append(
            RegionOp(str(op.extra.get("aten", "")), recompute, swaps, eager)
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


def _rerun_regardless(graph: ActivationGraph, i: int, weigh_unread: bool = True) -> bool:
    """Whether the region policy reruns op ``i`` whatever the plan says (PREFER_RECOMPUTE), as
    checkpoint_policy: views and intermediates backward never reads, ops that may not run again
    and ops whose outputs are written in place later (a dropout mask drawn in place: rerun with
    the in-place op, the RNG state restored); and (``weigh_unread``) an op whose outputs backward
    does not read outweigh the ones it keeps (batch norm's output beside its saved statistics):
    torch caches every output of a saved op, so it is cheaper to rerun it from its inputs than
    to hold it twice."""
    op = graph.ops[i]
    outs = graph.op_outputs[i]
    if (
        not op.recomputable
        or op.extra.get("rerun_by_checkpoint")
        or any(graph.writers[t] for t in outs)
        or not any(graph.is_saved[t] for t in outs)
    ):
        return True
    if not weigh_unread:
        return False
    kept = sum(int(graph.tensor_bytes[t]) for t in outs if graph.is_saved[t])
    unread = sum(int(graph.tensor_bytes[t]) for t in outs if not graph.is_saved[t])
    return unread > kept


def _region_reruns(graph: ActivationGraph, of_op: list[str]) -> dict[str, list[int]]:
    """Per region, the ops torch's (eager) checkpoint reruns whenever it reruns the region,
    whatever the plan rebuilds: it runs the region's forward again from its start until the
    region's last op that saves a tensor has saved it (early stop), computing every op its
    policy does not cache (``_rerun_regardless``)."""
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
            and (_rerun_regardless(graph, i) or _saved_elsewhere_only(graph, i, of_op))
        ):
            out.setdefault(region, []).append(i)
    return out


def _same_model(model, graph: ActivationGraph) -> None:
    """The model's parameters are the profiled model's (names, shapes, dtypes): a plan made for
    another width or with a block fewer is refused (PlanError naming the first difference)."""
    from .profiler import model_parameters

    recorded = graph.extra.get("parameters")
    if recorded is None:  # a graph not from ss.profile: nothing to compare with
        return
    mine = model_parameters(model)
    for a, b in zip(recorded, mine):
        if list(a) != list(b):
            raise PlanError(
                f"checkpointed: the graph was profiled on another model: parameter "
                f"{a[0]!r} {a[1]} {a[2]} there, {b[0]!r} {b[1]} {b[2]} here"
            )
    if len(recorded) != len(mine):
        extra = mine[len(recorded)][0] if len(mine) > len(recorded) else recorded[len(mine)][0]
        raise PlanError(
            f"checkpointed: the graph was profiled on another model: "
            f"{len(recorded)} parameters there, {len(mine)} here (first unmatched: "
            f"{extra!r})"
        )


def _shielded_recompute(recompute_context, buffers: set[int], state=()):
    """The recompute's context, plus a mode that hands every op copies of the model's buffers:
    batch norm in training updates its running statistics in place (its schema does not say
    so), and the recompute would update them a second time. Its outputs do not depend on them.
    ``state`` (the model's buffers) is also put back as it was when the recompute ends: ops that
    run outside the mode (a region compiled in pieces around a graph break) cannot change it
    either."""
    import contextlib

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    class ShieldBuffers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(
                isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in buffers
                for a in args
            ):
                with _disable_current_modes():  # the copy is no op of the region
                    args = tuple(
                        a.clone()
                        if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in buffers
                        else a
                        for a in args
                    )
            return func(*args, **(kwargs or {}))

    stack = contextlib.ExitStack()

    class Both:
        def __enter__(self):
            with _disable_current_modes():
                self.before = [(t, t.detach().clone()) for t in state]
            stack.enter_context(recompute_context)
            stack.enter_context(ShieldBuffers())
            return self

        def __exit__(self, *exc):
            try:
                return stack.__exit__(*exc)
            finally:
                with _disable_current_modes(), torch.no_grad():
                    for t, value in self.before:
                        if not torch.equal(t, value):
                            t.copy_(value)

    return Both()


def _op_regions(graph: ActivationGraph, regions: list[str] | None) -> list[str]:
    """Per op, the region ``checkpointed`` wraps it in ("" none): ``region_of``, or the longest of
    ``regions`` containing its module; a region around another is not wrapped (its own ops run
    plainly)."""

    def region(path: str) -> str:
        if regions is None:
            return region_of(path)
        inside = [r for r in regions if path == r or path.startswith(r + ".")]
        return max(inside, key=len) if inside else ""

    of_op = [region(_module_of(op)) for op in graph.ops]
    names = set(of_op) - {""}
    nested = {r for r in names if any(o != r and o.startswith(r + ".") for o in names)}
    return ["" if r in nested else r for r in of_op]


def boundary_pins(graph: ActivationGraph, regions: list[str] | None = None) -> dict[str, str]:
    """Pins that make a plan what ``checkpointed`` can run exactly
    (``g = checkpoint_graph(graph); ss.solve(g, budget, pins=boundary_pins(g))``): every saved
    tensor a region reads but does not produce is held by torch's checkpoint as the region's
    input, and every tensor an op outside any region saves is held by autograd, whatever a plan
    says: plan them as kept. On a ``checkpoint_graph``, what the checkpoint reruns anyway is
    pinned to recompute."""
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
    - in eager mode (``compiled=False``) the region's ops that a plan may not rerun (a dropout
      mask drawn in place, batch norm updating its statistics) are rerun by the checkpoint
      anyway, with the RNG state restored and the buffers shielded: they become rebuildable
      here (``extra["rerun_by_checkpoint"]``) and ``boundary_pins`` recomputes their saved
      outputs. Under torch.compile (``compiled=True``) the recompute is functional (batch norm
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
    (a BN ResNet at 50%: 51 MiB measured against 40 simulated)."""
    from dataclasses import replace

    if "checkpoint_graph" in graph.extra:
        raise ValueError(
            f"checkpoint_graph: graph {graph.name!r} is one already (its rebuilds and "
            "gradients would be counted twice): pass the profiled graph"
        )
    of_op = _op_regions(graph, regions)
    ops = list(graph.ops)
    saved_under_compile = _drawn(graph) if compiled else set()
    for i, op in enumerate(ops):
        # an op whose output is written in place later (Op.writes) is rerun by the checkpoint
        # with its writers whatever a plan says, as one that may not run again is
        written = any(graph.writers[t] for t in graph.op_outputs[i])
        if (
            of_op[i]
            and (not op.recomputable or written)
            and graph.op_outputs[i]
            and i not in saved_under_compile
        ):
            ops[i] = replace(op, recomputable=True, extra={**op.extra, "rerun_by_checkpoint": True})
        elif i in saved_under_compile and written:
            ops[i] = replace(op, recomputable=False)  # saved by the compiled policy
    if not compiled:
        # a rebuild in a region reruns with it what the checkpoint reruns there anyway: their
        # outputs are alive during the rerun (the residual add after a block's last batch norm)
        marked_rerun = replace(graph, ops=tuple(ops))
        for region, members in _region_reruns(marked_rerun, of_op).items():
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
    entry: dict[str, int] = {}
    for i, name in enumerate(of_op):
        if name and len(marked.saved_by_op[i]):
            entry[name] = max(entry.get(name, i), i)
    tensors = []
    for t, tensor in enumerate(marked.tensors):
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


def _region_policy(steps: list[RegionOp], offloads=None):
    """A selective-checkpoint policy for one region: the k-th call of an aten op gets the
    decision of the k-th op of that name in the region's profile (modulo their count: a compiler
    tracing the region again starts over); forward and recompute count separately. An op the
    profile did not see is saved. Under torch.compile random ops are always saved: the compiled
    recompute would draw them again (torch restores the RNG state for eager recomputes only).
    An op whose saved output the plan swaps gets MUST_CPU_OFFLOAD, and its traced node carries
    the tensors' names (``offloads``, compile/offload.py: what torch's pass makes of them)."""
    from torch.utils.checkpoint import CheckpointPolicy

    by_name: dict[str, list[RegionOp]] = {}
    for step in steps:
        by_name.setdefault(op_kind(step.aten), []).append(step)
    seen: dict[tuple[bool, str], int] = {}

    def policy(ctx, func, *args, **kwargs):
        import torch

        name = op_kind(str(func))
        decisions = by_name.get(name)
        if decisions is None:
            return CheckpointPolicy.MUST_SAVE
        key = (bool(getattr(ctx, "is_recompute", False)), name)
        k = seen.get(key, 0)
        seen[key] = k + 1
        compiling = torch.compiler.is_compiling()
        if compiling and _is_random(name):
            return CheckpointPolicy.MUST_SAVE
        step = decisions[k % len(decisions)]
        swaps = step.swaps
        if step.recompute if compiling else step.eager_recompute:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if swaps and not key[0] and offloads is not None:
            if not compiling:  # eager checkpointing has no offload: saved, and said
                offloads.ran_eagerly(swaps)
                return CheckpointPolicy.MUST_SAVE
            offloads.tag(func, swaps)
            return CheckpointPolicy.MUST_CPU_OFFLOAD
        return CheckpointPolicy.MUST_SAVE

    return policy


def _is_random(aten_name: str) -> bool:
    from .trace import RANDOM_OPS

    return any(word in aten_name for word in RANDOM_OPS)


class checkpointed:  # noqa: N801 - a context manager used like a function
    """Run ``model`` with ``plan``'s recomputes through torch's own selective checkpointing:
    ``with ss.checkpointed(model, plan, graph): loss_fn(model(x)).backward()``.

    Each region (``region_of``: one block of a stack; or the module paths given as ``regions``)
    that the plan recomputes in is wrapped in ``torch.utils.checkpoint.checkpoint`` (non-reentrant,
    RNG state preserved) with a policy saving what the plan keeps and recomputing what it
    recomputes. Backward then rebuilds one region at a time, so the
    step's peak follows the plan's instead of rebuilding the whole forward at once. Works on a
    ``torch.compile``d model whose modules are these (compile the model inside the context, or
    wrap before compiling). Swaps run under torch.compile through torch's activation-offloading
    pass (compiled_offload.py; ``info`` says what ran of each); a region that runs eagerly saves
    its swaps, with a warning.
    torch's checkpoint holds each region's inputs and reruns a region at once, at its first
    backward op: plan for ``checkpoint_graph(graph)`` with ``pins=boundary_pins(graph)``, so that
    the plan keeps the inputs, rebuilds where the policy does, and simulates what the policy
    holds (``ss.checkpointed(model, plan, checkpoint_graph(graph))``).
    As with any checkpointing, a region's forward must not change state its recompute reads: call
    HF models with ``use_cache=False`` (HF does so for its own gradient checkpointing).
    """

    def __init__(self, model, plan: Plan, graph: ActivationGraph, regions: list[str] | None = None):
        from .executor import refuse_what_the_checker_refuses

        self.model = model
        plan.check_graph(graph)
        refuse_what_the_checker_refuses(plan, graph, "checkpointed")
        _same_model(model, graph)
        self.inputs = graph.extra.get("inputs")
        self.steps = checkpoint_regions(plan, graph, regions)
        modules = dict(model.named_modules())
        missing = [r for r in self.steps if r not in modules]
        if missing:
            raise ValueError(
                f"checkpointed: region {missing[0]!r} of the graph is no module of "
                "this model (profile the model you run)"
            )
        self.modules = {r: modules[r] for r in self.steps}
        self._saved: dict[str, object] = {}
        # swaps run through torch's offloading pass under torch.compile (compiled_offload.py)
        self.offloads = None
        if plan.count("swap"):
            from .compiled_offload import CompiledOffloads

            device = next((p.device for p in model.parameters()), None)
            self.offloads = CompiledOffloads(cuda=device is not None and device.type == "cuda")
            # swaps torch's checkpoint cannot offload: in an op it reruns (written in place
            # later, or one that may not run again), or in no region (the model's own ops)
            offered = {
                n for ops in self.steps.values() for op in ops if not op.recompute for n in op.swaps
            }
            rerun = {
                n for ops in self.steps.values() for op in ops if op.recompute for n in op.swaps
            }
            self.offloads.recomputed_instead = rerun
            self.offloads.saved_instead = set(plan.tensors("swap")) - offered - rerun
            self.offloads._outside = set(self.offloads.saved_instead)
            self.offloads.requested = set(plan.tensors("swap"))
            if rerun or self.offloads.saved_instead:
                warnings.warn(
                    f"checkpointed: of the plan's {plan.count('swap')} swaps, {len(rerun)} are "
                    f"in ops torch's checkpoint reruns (recomputed instead) and "
                    f"{len(self.offloads.saved_instead)} in ops outside every region (saved "
                    "instead): checkpointed.info['swaps'] names them",
                    RuntimeWarning,
                    stacklevel=2,
                )

    @property
    def info(self) -> dict:
        """What ran of the plan's swaps: per tensor "offloaded" by torch's pass, "saved" (the
        pass would not offload it) or "not compiled"; the schedule is torch's."""
        if self.offloads is None:
            return {"swaps": {}}
        return {
            "swaps": self.offloads.report(),
            "compiled_graphs": list(self.offloads.graphs),
            "schedule": "torch's activation-offloading pass (offload after the producer, "
            "reload before the first use), not the plan's",
        }

    def __enter__(self):

        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        buffers = list(self.model.buffers())
        state = {t.untyped_storage().data_ptr() for t in buffers}
        if self.offloads is not None:
            self.offloads.__enter__()
        self._hook = (
            self.model.register_forward_pre_hook(self._check_inputs, with_kwargs=True)
            if self.inputs is not None
            else None
        )
        for name, module in self.modules.items():
            forward = module.forward
            self._saved[name] = module.__dict__.get("forward")
            steps = self.steps[name]

            # decided when the checkpoint asks for its contexts, not when the region is called:
            # with a graph break in the region, torch.compile runs the checkpoint eagerly after
            # tracing the call, and its recompute must then be shielded (it replays the
            # region's Python, batch norm's statistics updates included); a compiled recompute
            # replays no mutation and takes torch's own contexts. Made here, outside any traced
            # frame: torch.compile accepts a plain function as context_fn, not a closure it
            # traced being made.
            def context(_steps=steps, _offloads=self.offloads):
                import torch

                forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(
                    _region_policy(_steps, _offloads)
                )
                if torch.compiler.is_compiling():
                    return forward_ctx, recompute_ctx
                return forward_ctx, _shielded_recompute(recompute_ctx, state, buffers)

            def wrapped(*args, _forward=forward, _context=context, **kwargs):
                return checkpoint(
                    _forward,
                    *args,
                    use_reentrant=False,
                    context_fn=_context,
                    preserve_rng_state=True,
                    **kwargs,
                )

            module.forward = wrapped
        return self

    def _check_inputs(self, module, args, kwargs):
        """The step's inputs are no larger than the profile's (a longer sequence holds more
        than the plan says): PlanError otherwise, before the forward runs."""
        from .profiler import input_shapes

        given = input_shapes((*args, kwargs) if kwargs else args)
        recorded = self.inputs
        fits = len(given) == len(recorded) and all(
            dt == rdt and len(shape) == len(rshape) and all(a <= b for a, b in zip(shape, rshape))
            for (shape, dt), (rshape, rdt) in zip(given, recorded)
        )
        if not fits:
            raise PlanError(
                f"checkpointed: the inputs {given} are not the profiled ones "
                f"{recorded} (or smaller): the plan holds what it says only for "
                "the step it was made for; profile and plan this shape"
            )

    def __exit__(self, *exc) -> None:
        if self.offloads is not None:
            self.offloads.__exit__(*exc)
        if getattr(self, "_hook", None) is not None:
            self._hook.remove()
            self._hook = None
        for name, module in self.modules.items():
            before = self._saved.pop(name, None)
            if before is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = before
