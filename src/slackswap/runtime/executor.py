"""apply(): run real torch training steps under a plan.

Under ``with slackswap.apply(plan, model) as run:`` the forward pass is traced at aten-op
granularity (the profiler's tracer, so tensors have the same names) and every tensor autograd
saves goes through saved-tensor hooks:

- keep: the tensor itself is held;
- swap: its storage is copied to host memory (a reusable pool sized from the plan; pinned, on a
  side stream with events, on CUDA) and brought back before its backward use, prefetched ahead
  following the plan's schedule;
- recompute: nothing is held; before its backward use the ops that produced it run again
  (recursively through tensors that were not saved), with the RNG state they first ran with.

Gradients are bit-identical to plain training. A tensor modified in place after it was saved
raises, as autograd would; a plan made for another graph or model is refused on the first
forward. torch is imported here and in the profiler only.
"""

from __future__ import annotations

import contextlib
import heapq
import warnings
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..core.errors import PlanError
from ..core.graph import ActivationGraph
from ..core.plan import Plan
from .lanes import lanes_for
from .pool import host_pool
from .positions import PlanPositions, RunLog
from .reloads import Reloads
from .saved_hooks import SavedTensorHooks
from .step_hooks import AtPosition, EndForwardOnBackward, ForwardHook
from .step_tracers import RecordingTracer, Skeleton, SkimTracer
from .trace import LiveStorages, ModulePaths, Tracer, storage_key


@dataclass
class RunStats:
    """What the executor did in the steps run under it (accumulated; peak is the maximum)."""

    steps: int = 0
    peak_activation_bytes: int = (
        0  # the tensors it tracks (not gradients): SimResult.tensor_peak_bytes
    )
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    recomputed_bytes: int = 0
    recompute_s: float = 0.0
    wait_s: float = 0.0
    host_pool_bytes: int = 0
    # steps run untraced: a plan that keeps everything is checked (names, bytes, peak) on the
    # first step of a context and on any step whose inputs change shape; the others run as
    # plain training (peak_activation_bytes is the traced steps')
    untraced_steps: int = 0
    # steps of a plan that rebuilds nothing run with positions counted and saved tensors named
    # by the checked step's order of saves, without per-op naming (SkimTracer)
    skimmed_steps: int = 0
    # a backward has been called in the context (a step that failed after it cannot be run
    # again as if nothing happened: gradients may have been accumulated)
    backward_started: bool = False


@dataclass
class _Step:
    tracer: Tracer | None
    paths: ModulePaths | None
    handles_left: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    host: dict[str, tuple[torch.UntypedStorage, int, Any]] = field(default_factory=dict)
    device_copy: dict[str, torch.UntypedStorage] = field(default_factory=dict)
    rng: dict[int, Any] = field(default_factory=dict)
    dirty: set[str] = field(default_factory=set)
    packed: set[str] = field(default_factory=set)
    seen: set[str] = field(default_factory=set)
    kept: dict[str, torch.UntypedStorage] = field(default_factory=dict)
    # storages released by their last reader, held until the backward node that read them is
    # done: a rebuild in that node may read them too (as the step model says: a tensor lives
    # through its last use's position)
    lingering: dict[str, torch.UntypedStorage] = field(default_factory=dict)
    node: Any = None  # the autograd node unpacking now
    swap_order: list[str] = field(default_factory=list)
    taken: list = field(default_factory=list)
    recipes: dict[str, Any] = field(default_factory=dict)
    rewrites: dict[str, list] = field(default_factory=dict)  # in-place writes, in forward order
    written: dict[str, int] = field(default_factory=dict)  # in-place writes so far, per tensor
    active: bool = False
    checked: bool = False
    finished: bool = False  # the model's forward returned (it did not raise)
    verified: set[str] = field(default_factory=set)  # tensors whose dtype and bytes were checked
    # positions (runtime/positions.py): the op the forward runs next, the position the step is
    # at, swapped tensors held until their d2h_free (a heap by that position), prefetches in
    # flight and what the step did
    next_op: int = 0
    position: int = -1
    holding: dict[str, torch.Tensor] = field(default_factory=dict)
    release_heap: list = field(default_factory=list)
    arrived: dict[str, Any] = field(default_factory=dict)
    seq_to_op: dict[int, int] = field(default_factory=dict)
    pending_hooks: list = field(default_factory=list)
    issue_cursor: int = 0  # the prefetch positions (PlanPositions.issue_order) handled
    skim: bool = False  # counted, not named (SkimTracer)
    pack_index: int = 0  # saves so far in a skimmed step
    pack_log: list | None = None  # (position, name, module) of each save, in a checked step
    skeletons: dict | None = None  # op -> Skeleton of its recipes, in a checked step
    log: RunLog = field(default_factory=RunLog)


# the checker's verdicts on the plans run lately (a context per step: one walk per plan), by the
# plan object's identity (held, so that no other plan takes its id) and the graph's digest
_VERDICTS: OrderedDict = OrderedDict()


def refuse_what_the_checker_refuses(plan: Plan, graph: ActivationGraph | None, who: str) -> None:
    """A runner runs no plan the checker refuses: with the graph, the whole checker
    (check/validate.py: decisions, schedule, memory, step time and the plan's claims); without
    it, what the plan alone shows (swaps where the device is the host, restrictions it breaks,
    a prefetch not after its offload's free). PlanError names the first fault."""
    from ..check.validate import restriction_violations, validate

    if graph is None:
        faults = [str(v) for v in restriction_violations(plan)]
        for name, free in plan.schedule.d2h_free.items():
            issue = plan.schedule.h2d_issue.get(name)
            if issue is not None and issue <= free:
                faults.append(
                    f"schedule: h2d_issue[{name!r}] = {issue} is not after its d2h_free {free}"
                )
        if faults:
            raise PlanError(f"{who}: the plan breaks its own rules: {faults[0]}")
        return
    key = (id(plan), graph.digest)
    verdict = _VERDICTS.get(key)
    if verdict is None or verdict[0] is not plan:
        verdict = (plan, validate(graph, plan))
        _VERDICTS[key] = verdict
        while len(_VERDICTS) > 16:
            _VERDICTS.popitem(last=False)
    _VERDICTS.move_to_end(key)
    checked = verdict[1]
    if not checked.ok:
        more = len(checked.violations) - 1
        raise PlanError(
            f"{who}: the checker refuses this plan: {checked.violations[0]}"
            + (f" (and {more} more)" if more else "")
        )


class Run(SavedTensorHooks, Reloads):
    """The context ``apply`` returns; ``stats`` holds what the steps did."""

    def __init__(
        self,
        plan: Plan,
        model: torch.nn.Module,
        graph: ActivationGraph | None,
        prefetch_ahead: int = 2,
        smaller_inputs: bool = False,
    ):
        if graph is not None:
            plan.check_graph(graph)
        if "checkpoint_graph" in plan.extra or (
            graph is not None and "checkpoint_graph" in graph.extra
        ):
            raise PlanError(
                "apply: this plan is for a graph made by slackswap.checkpoint_graph "
                "(torch's checkpoint reruns what it rebuilds, dropout masks drawn in "
                "place included): run it with slackswap.checkpointed, or plan the "
                "profiled graph itself for apply"
            )
        plan.require_complete("apply")
        refuse_what_the_checker_refuses(plan, graph, "apply")
        self.plan = plan
        self.model = model
        self.graph = graph
        self.stats = RunStats()
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.device = device
        self.cuda = device.type == "cuda"
        self.pool = host_pool(plan, device, pinned=self.cuda)
        self.lanes = lanes_for(device)  # chosen once: the CUDA streams or host copies
        self.prefetch_ahead = prefetch_ahead
        # with the graph, the executor acts at the plan's own positions (and logs where it did)
        moves = any(d != "keep" for d in plan.decisions.values())
        self._positions = PlanPositions.of(plan, graph) if graph is not None and moves else None
        # recipes (and RNG states) are kept only when something will be rebuilt
        self.needs_recipes = any(d == "recompute" for d in plan.decisions.values())
        # with the graph, only the ops a rebuild may rerun keep recipes (the closures of the
        # recomputed tensors, their in-place writers included, and of the saved tensors those
        # read, which a rebuild runs again once released): the other ops are named, not recorded
        self.recipe_ops: frozenset[int] | None = None
        if graph is not None and self.needs_recipes:
            ops: set[int] = set()
            stack = [graph.tensor_index[n] for n, d in plan.decisions.items() if d == "recompute"]
            seen: set[int] = set()
            while stack:
                t = stack.pop()
                if t not in seen:
                    seen.add(t)
                    ops.update(graph.rerun_ops[t])
                    stack.extend(graph.rerun_frontier[t])
            self.recipe_ops = frozenset(ops)
        self._issue_at, self._need_at = self._prefetch_schedule(plan, graph)
        self._check_device()
        if graph is not None:
            # the graph gives every offloaded storage's size: one pinned slab for what an
            # earlier plan on this graph left no buffer for (a context per step, or the loop's
            # next plan, allocates nothing)
            self.pool.reserve_missing(
                {
                    name: int(graph.tensors[graph.tensor_index[name]].bytes)
                    for name, d in plan.decisions.items()
                    if d == "swap" and name in graph.tensor_index
                }
            )
        self._live = LiveStorages()  # device storages by storage key
        self._planned_bytes = dict(plan.extra.get("tensor_bytes", {}))
        # a plan made at a larger input shape runs a smaller one: every saved tensor no larger
        # than planned, the same ops, so no point of the step holds more than planned
        self._smaller_inputs = bool(smaller_inputs)
        self._rebuild_depth = 0
        self._device_index = (
            (device.index if device.index is not None else torch.cuda.current_device())
            if self.cuda
            else -1
        )
        self._step: _Step | None = None
        self._last_log = RunLog()  # the log of a step no longer held
        self._stack: contextlib.ExitStack | None = None
        self._checked = False
        # nothing to move: once a step is checked, steps of the same input shapes run untraced
        self._moves_nothing = all(d == "keep" for d in plan.decisions.values())
        self._signature: tuple | None = None
        # once a step of these input shapes is checked, later steps need no name from the
        # tracer: they count positions, name each saved tensor by its place in the checked
        # step's order of saves, and a plan that rebuilds records its recipes from the checked
        # step's (the names of each recipe op's tensors by their place in its arguments:
        # SkimTracer)
        self._can_skim = graph is not None and not self._moves_nothing
        self._pack_order: list[tuple[int, str | None, str]] | None = None
        self._skeletons: dict[int, Skeleton] | None = None

    @staticmethod
    def _prefetch_schedule(plan: Plan, graph: ActivationGraph | None):
        """Per swapped tensor, the backward position at which the plan issues its prefetch (the
        plan's own schedule), and each saved tensor's first backward position (where the plan
        rebuilds or reads it): the executor's clock in backward is the tensors it is asked for."""
        if graph is None or not any(d == "swap" for d in plan.decisions.values()):
            return None, None
        from ..core.codes import decision_codes
        from ..core.stepmodel import first_backward_need

        issue = dict(plan.schedule.h2d_issue)
        first = first_backward_need(graph, decision_codes(graph, plan), plan.schedule)
        need = {graph.tensors[t].name: int(first[t]) for t in graph.saved}
        return issue, need

    def _check_device(self) -> None:
        """A plan's times are the hardware's it was made for: warn when this device is another."""
        hw = self.plan.hardware
        if self.cuda:
            here = torch.cuda.get_device_name(self.device)
            tokens = [
                tok
                for tok in ("a100", "h100", "h200", "l4", "l40", "v100", "a10")
                if tok in hw.name.lower()
            ]
            differs = hw.name.startswith("cpu") or (
                tokens and not any(tok in here.lower() for tok in tokens)
            )
        else:
            here = "cpu"
            differs = not hw.name.startswith("cpu")
        if differs:
            warnings.warn(
                f"plan was made for hardware {hw.name!r} but runs on {here!r} "
                f"({self.device}): its copy and rebuild positions were timed for the "
                "former",
                stacklevel=3,
            )

    @property
    def log(self) -> RunLog:
        """What the last step did, by position (runtime/positions.py): ``log.schedule`` is where
        it released, prefetched and rebuilt each tensor."""
        return self._step.log if self._step is not None else self._last_log

    def _drop_step(self) -> None:
        """Let go of the last step once its backward has run (its log is kept): a context
        held across steps (the loop's, one per plan) holds nothing of the step before."""
        if self._step is not None and not self._step.active:
            self._last_log = self._step.log
            self._step = None

    # ------------------------------------------------------------ positions
    def _release_due(self, step: _Step, after: int) -> None:
        """Hand back the device memory of every swapped tensor whose d2h_free is at or before
        position ``after``, once its offload is done (the compute stream waits on it)."""
        heap = step.release_heap
        while heap and heap[0][0] <= after:
            _, name = heapq.heappop(heap)
            if step.holding.pop(name, None) is not None:
                self.lanes.release(step.host[name][2])
                step.log.add("release", name, after)

    def _next_position(self, step: _Step) -> int:
        """A forward op is about to run: the step moves to its position and does what the plan
        does before it (releases after the previous one, hooks on the nodes made so far,
        prefetches issued within the forward); returns the position."""
        op = step.next_op
        step.next_op = op + 1
        step.position = op
        positions = self._positions
        if positions is not None:
            if step.release_heap:
                self._release_due(step, op - 1)
            if step.pending_hooks:
                self._hook_nodes(step)
            if (
                step.issue_cursor < len(positions.issue_order)
                and positions.issue_order[step.issue_cursor] <= op
            ):
                self._issue_due(step, op)
            step.seq_to_op.setdefault(torch._C._autograd._get_sequence_nr() - 1, op)
        return op

    def _hook_nodes(self, step: _Step) -> None:
        """The backward nodes of the ops whose positions have events: a pre-hook there moves
        the step to that position (the node exists once the op's autograd wrapper returns)."""
        positions = self._positions
        for op, refs in step.pending_hooks:
            for ref in refs:
                t = ref()
                node = None if t is None else t.grad_fn
                if node is not None:
                    q = positions.backward_position(op)
                    node.register_prehook(AtPosition(self, step, q))
                    break
        step.pending_hooks.clear()

    def _issue_due(self, step: _Step, q: int) -> None:
        """Issue the prefetches the plan issues at or before position ``q`` (in forward or
        backward) and that are not yet issued."""
        positions = self._positions
        order = positions.issue_order
        while step.issue_cursor < len(order) and order[step.issue_cursor] <= q:
            for name in positions.issue_at[order[step.issue_cursor]]:
                if (
                    name in step.host
                    and name not in step.device_copy
                    and step.handles_left.get(name, 0) > 0
                ):
                    step.device_copy[name] = self._bring_back(step, name)
            step.issue_cursor += 1

    def _at_backward(self, step: _Step, q: int) -> None:
        """The backward pass reached position ``q``: release, prefetch and rebuild what the plan
        does at or before it and has not yet done."""
        if q <= step.position:
            return
        step.position = q
        positions = self._positions
        if step.release_heap:
            self._release_due(step, q - 1)
        with _disable_current_modes():
            self._issue_due(step, q)
            # a rebuild runs at its position when the backward reaches it; where that node does
            # not run (its output is off the loss's path), at the tensor's first use if any
            for name in positions.rebuild_at.get(q, ()):
                if (
                    name in step.packed
                    and name not in step.device_copy
                    and step.handles_left.get(name, 0) > 0
                ):
                    self._materialize(step, name)

    # ------------------------------------------------------------ memory tracking
    def _track(self, t: torch.Tensor, key=None, nbytes: int | None = None) -> None:
        """Count a device storage as resident while any tensor object we know of uses it."""
        if t.get_device() != self._device_index:
            return
        if nbytes is None:
            nbytes = t.untyped_storage().nbytes()
        self._live.add(t, key or storage_key(t), nbytes)
        self.stats.peak_activation_bytes = max(self.stats.peak_activation_bytes, self._live.peak)

    # ------------------------------------------------------------ context
    def __enter__(self) -> Run:
        self._stack = contextlib.ExitStack()
        self.stats = RunStats()  # what the steps of this entry do (a context may be re-entered)
        # module paths first, so the model's own pre-hook has pushed its name when a step begins
        self._paths = ModulePaths(self.model)
        self._stack.callback(self._paths.remove)
        self._stack.enter_context(
            torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        )
        self._stack.enter_context(ForwardHook(self))
        self._stack.enter_context(EndForwardOnBackward(self))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        stack, self._stack = self._stack, None
        try:
            if exc_type is None:
                self._end_forward()
            else:  # the user's exception propagates unchanged; the step is dropped unchecked
                step = self._step
                if step is not None:
                    step.finished = False
                    try:
                        self._end_forward()
                    except Exception:  # noqa: BLE001 - never mask the user's exception
                        pass
        finally:
            if stack is not None:
                stack.close()
            self.stats.host_pool_bytes = self.pool.nbytes

    # ------------------------------------------------------------ forward tracing
    def _begin_forward(self, skim: bool = False) -> None:
        self._end_forward()
        if self._step is not None:
            self._last_log = self._step.log
        self._paths.reset(self._paths.stack[-1] if self._paths.stack else "model")
        step = _Step(tracer=None, paths=self._paths)
        self._step = step
        if skim:
            step.skim = True
            step.tracer = SkimTracer(self, step, self._paths)
            self.stats.skimmed_steps += 1
        else:
            if self._can_skim:
                step.pack_log = []
                step.skeletons = {} if self.needs_recipes else None
            step.tracer = RecordingTracer(self, step, self._paths)
        step.tracer.__enter__()
        step.active = True

    def _end_forward(self) -> None:
        step = self._step
        if step is None or not step.active:
            return
        step.active = False
        if step.release_heap:
            self._release_due(step, min(step.next_op - 1, self._positions.n_ops - 1))
        if step.pending_hooks:
            self._hook_nodes(step)
        tracer, step.tracer = step.tracer, None  # no cycle keeps the step (and its host buffers)
        try:
            tracer.__exit__(None, None, None)
        finally:
            # the tracer's own cycle (its lifetime tracker calls back into it) would otherwise
            # hold the run, and through it the model, until the cyclic collector runs
            tracer.step = tracer.run = None
            if not step.checked and step.finished:
                # a forward that raised proves nothing about the plan: the user's error stands
                step.checked = True
                self._check_plan(step)
            if step.pack_log is not None and step.finished and self._checked:
                self._pack_order = step.pack_log  # the order of saves later steps are named by
                self._skeletons = step.skeletons

    def _check_plan(self, step: _Step) -> None:
        if not self._checked and step.seen:
            missing = sorted(set(self.plan.decisions) - step.packed)
            if missing and self.graph is None:
                more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
                raise PlanError(
                    f"plan tensor(s) {', '.join(map(repr, missing[:3]))}{more} were not "
                    "saved in this step: the plan was made for another model or input shape"
                )
            self._checked = True

    # ------------------------------------------------------------ hooks


def apply(
    plan: Plan,
    model: torch.nn.Module,
    graph: ActivationGraph | None = None,
    *,
    smaller_inputs: bool = False,
) -> Run:
    """Context manager running training steps of ``model`` under ``plan``.

    ``graph`` (optional) is the graph the plan was made for: its digest is checked against the
    plan's and its tensors' dtypes against the model's. Without it the plan's tensor names are
    checked against the tensors the model saves, on the first forward. Every saved tensor must
    have the bytes it was planned with; ``smaller_inputs`` accepts fewer (a plan made at the
    largest sequence length of a bucket runs the shorter ones: no point holds more than planned).

    Args:
        plan: a closed plan for the model's step.
        model: the torch module it was made for.
        graph: the graph it was made for: the executor then acts at the plan's positions.
        smaller_inputs: allow steps smaller than the profiled one.

    Returns:
        The Run, a context manager: steps inside it run under the plan (``run.stats``).

    Raises:
        PlanError: a plan for another model or graph, or one the checker refuses.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"apply: plan must be a slackswap.Plan, got {type(plan).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"apply: model must be a torch.nn.Module, got {type(model).__name__}")
    if hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
        raise PlanError(
            "apply: the model is torch.compile'd; the executor runs eager models. "
            "Either apply the plan to model._orig_mod and call that, or keep the "
            "compiled model and run it inside slackswap.checkpointed(model._orig_mod, "
            "plan, graph) (plans with keep and recompute only)"
        )
    return Run(plan, model, graph, smaller_inputs=smaller_inputs)
