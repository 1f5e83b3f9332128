"""A plan as a torch selective-checkpoint policy (``torch.utils.checkpoint``)."""

from __future__ import annotations

import warnings

from ..core.errors import PlanError
from ..core.graph import ActivationGraph
from ..core.plan import Plan
from .checkpoint_regions import (
    RegionOp,
    checkpoint_regions,
    op_kind,
)


def checkpoint_policy(plan: Plan, graph: ActivationGraph):
    """A torch.utils.checkpoint selective-checkpoint policy with ``plan``'s recomputes.

    Ops of ``graph`` that produce a saved tensor the plan keeps or offloads get MUST_SAVE;
    all others PREFER_RECOMPUTE: those whose tensors the plan recomputes, those whose outputs
    backward never reads (views, in-place ops, intermediates), and ops whose outputs are
    later written in place (a dropout mask drawn in place): torch must rerun those with the
    in-place op, so they get PREFER_RECOMPUTE too (checkpoint restores the RNG state); with one
    draw rerun, every draw is (the restored RNG state is the forward's at the start). Calls are
    matched to the graph's ops in order, so checkpoint the same forward that was profiled (the
    whole model call); a call that does not match the graph's next op is saved; the graph's first
    op with no match ahead starts the next step. Use with ``create_selective_checkpoint_contexts``.

    Around the whole model call, backward rebuilds the whole forward at once and the step peaks
    where plain training does: to get the plan's peak use :class:`checkpointed`, which
    checkpoints one block at a time with this plan.

    Args:
        plan: a plan for ``graph``.
        graph: the graph it was made for.

    Returns:
        The policy, for ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

    Raises:
        PlanError: the plan is for another graph.
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
    # the recompute restores one RNG state at the checkpoint's start: a draw it reruns matches
    # the forward's only if every draw before it reruns too, so one rerun draw reruns them all
    draws = [i for i, op in enumerate(graph.ops) if op.extra.get("random")]
    if any(steps[i][1] for i in draws):
        for i in draws:
            steps[i] = (steps[i][0], True)
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
        try:
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
                offloads.tag(func, swaps, getattr(ctx, "op_output", None), step.outputs)
                return CheckpointPolicy.MUST_CPU_OFFLOAD
            return CheckpointPolicy.MUST_SAVE
        finally:
            if compiling and offloads is not None:
                offloads.op_done()  # (the nodes traced so far are this op's or earlier ones')

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
            self.offloads.outside = set(self.offloads.saved_instead)
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
        pass would not offload it) or "not compiled"; per swap the compiled forward does not
        save, the nodes it saves in its place that were offloaded for it (``stand_ins``); the
        schedule is torch's."""
        if self.offloads is None:
            return {"swaps": {}}
        return {
            "swaps": self.offloads.report(),
            "stand_ins": {k: list(v) for k, v in self.offloads.stand_ins.items()},
            "compiled_graphs": list(self.offloads.graphs),
            "schedule": "torch's activation-offloading pass (offload after the producer, "
            "reload before the first use), not the plan's",
        }

    def __enter__(self):

        import torch._dynamo.config as dynamo_config
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        buffers = list(self.model.buffers())
        state = {t.untyped_storage().data_ptr() for t in buffers}
        # A region's Python side effects (HF's kernel hub sets a context variable in each
        # RMSNorm) make torch.compile refuse the checkpoint and run the region eagerly, where no
        # swap can be offloaded. Plain training runs them once; so does a compiled checkpoint
        # that does not replay them in its recompute (eager checkpointing replays them: twice).
        self._dynamo_patch = dynamo_config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
        self._dynamo_patch.__enter__()
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
            # a kept tensor written in place later is cached as its writes leave it
            # (checkpoint_regions.cached_writes); a region that writes no state (batch norm's
            # statistics) reruns unshielded: the shield is a Python mode over every rerun op
            mutable = any(op.cached_write for op in steps)
            shield = any(op.writes_state for op in steps)

            def context(_steps=steps, _offloads=self.offloads, _mutable=mutable, _shield=shield):
                import torch

                forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(
                    _region_policy(_steps, _offloads), allow_cache_entry_mutation=_mutable
                )
                if torch.compiler.is_compiling() or not _shield:
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
        patch, self._dynamo_patch = getattr(self, "_dynamo_patch", None), None
        if patch is not None:
            patch.__exit__(*exc)
        if getattr(self, "_hook", None) is not None:
            self._hook.remove()
            self._hook = None
        for name, module in self.modules.items():
            before = self._saved.pop(name, None)
            if before is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = before
