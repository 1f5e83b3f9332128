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

The first step of a context at new input shapes is traced op by op and checked against the
plan; later steps of the same shapes are named by its saves (runtime/checked_step.py). Those of a
plan that rebuilds nothing run with hooks alone (no dispatch mode: the plan acts at its saves
and at the backward nodes that unpack them, formulations/step-model.md, "Hook positions"); those
of a plan that rebuilds count positions and record recipes op by op. The state of each step is
its ``Step`` (runtime/step.py), or for a step of hooks alone its ``HookedStep``
(runtime/hooked_step.py, which runs from tables laid out once per checked step); ``Run`` owns
the context.

Gradients are bit-identical to plain training. A tensor modified in place after it was saved
raises, as autograd would; a plan made for another graph or model is refused on the first
forward, and a later step that saves another tensor than the checked step did is refused by
name. torch is imported here and in the profiler only.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import PlanError
from ..core.graph import ActivationGraph
from ..core.pipeline import StagePlan
from ..core.plan import Plan
from .checked_step import CheckedStep, hook_coverage, mark_handled, resolve_node_ops
from .hooked_step import HookedProgram, HookedStep
from .lanes import lanes_for
from .pool import host_pool
from .positions import PlanPositions, RunLog
from .saved_hooks import SavedTensorHooks
from .stats import RunStats
from .step import HOOKED, SKIMMED, TRACED, Step, StepContext
from .step_hooks import EndForwardOnBackward, ForwardHook, input_signature
from .step_tracers import RecordingTracer, SkimTracer
from .trace import LiveStorages, ModulePaths

__all__ = ["Run", "RunStats", "apply", "refuse_what_the_checker_refuses"]

# the checker's verdicts on the plans run lately (a context per step: one walk per plan), by the
# plan object's identity (held, so that no other plan takes its id) and the graph's digest
_VERDICTS: OrderedDict[tuple[int, str], tuple[Plan, Any]] = OrderedDict()


def refuse_what_the_checker_refuses(plan: Plan, graph: ActivationGraph | None, who: str) -> None:
    """A runner runs no plan the checker refuses: with the graph, the whole checker
    (check/validate.py: decisions, schedule, memory, step time and the plan's claims); without
    it, what the plan alone shows (swaps where the device is the host, restrictions it breaks,
    a prefetch not after its offload's free). PlanError names the first fault."""
    from ..check.validate import restriction_violations, validate

    if graph is None:
        faults = [str(v) for v in restriction_violations(plan)]
        schedule = plan.schedule
        assert schedule is not None  # (a complete plan)
        for name, free in schedule.d2h_free.items():
            issue = schedule.h2d_issue.get(name)
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


class Run:
    """The context ``apply`` returns: it owns the plan, the model's hooks for the context's life
    and the step running now (runtime/step.py); ``stats`` holds what the steps did, ``log`` what
    the last step did, ``end_step()`` lets go of a finished step."""

    def __init__(
        self,
        plan: Plan,
        model: torch.nn.Module,
        graph: ActivationGraph | None,
        prefetch_ahead: int = 2,
        smaller_inputs: bool = False,
        trace_every_step: bool = False,
        micro_batch_plans: tuple[Plan, ...] = (),
        tracked_with: Run | None = None,
    ):
        # a pipeline stage's plan each micro-batch (StagePlan.plans): the n-th forward since
        # the context was entered runs micro-batch n mod M's, as torch's schedules run the
        # micro-batches' forwards in order on every stage
        self.micro_batch_plans = micro_batch_plans or (plan,)
        for other in self.micro_batch_plans:
            if other is not plan:
                other.require_complete("apply")
                if graph is not None:
                    other.check_graph(graph)
                refuse_what_the_checker_refuses(other, graph, "apply")
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
        moves = any(d != "keep" for p in self.micro_batch_plans for d in p.decisions.values())
        self._acting: dict[int, _PlanActs] = {
            id(p): _PlanActs.of(p, graph) for p in self.micro_batch_plans
        }
        self._forwards = 0  # forwards since the context was entered (the micro-batch's index)
        self._select(plan)
        self._check_device()
        if graph is not None:
            # the graph gives every offloaded storage's size: one pinned slab for what an
            # earlier plan on this graph left no buffer for (a context per step, or the loop's
            # next plan, allocates nothing)
            self.pool.reserve_missing(
                {
                    name: int(graph.tensors[graph.tensor_index[name]].bytes)
                    for p in self.micro_batch_plans
                    for name, d in p.decisions.items()
                    if d == "swap" and name in graph.tensor_index
                }
            )
        # device storages by storage key; shared with another context's (a rank's stages),
        # so that both track what the rank holds
        self.live: LiveStorages = tracked_with.live if tracked_with is not None else LiveStorages()
        self.planned_bytes = dict(plan.extra.get("tensor_bytes", {}))
        # a plan made at a larger input shape runs a smaller one: every saved tensor no larger
        # than planned, the same ops, so no point of the step holds more than planned
        self.smaller_inputs = bool(smaller_inputs)
        self.device_index = (
            (device.index if device.index is not None else torch.cuda.current_device())
            if self.cuda
            else -1
        )
        self.current_step: Step | HookedStep | None = None
        self._step_context: StepContext | None = None  # (made once per plan and entry)
        self._program: HookedProgram | None = None  # the checked step's, for hooked steps
        self._last_log = RunLog()  # the log of a step no longer held
        self._stack: contextlib.ExitStack | None = None
        self._paths: ModulePaths | None = None
        self.plan_checked = False  # a step has shown the model saves what the plan names
        # nothing to move: once a step is checked, steps of the same input shapes run untraced
        # (unless every step is to be traced and tracked, as asked)
        self.moves_nothing = not moves and not trace_every_step
        self._signature: tuple[Any, ...] | None = None
        # once a step of these input shapes is checked, later steps need no name from a tracer:
        # they are named by its saves (runtime/checked_step.py); a plan that rebuilds nothing
        # runs them with hooks alone, one that rebuilds counts positions and records recipes
        distinct = len(self._acting) > 1  # (a checked step names one plan's handling)
        self.can_skim = graph is not None and moves and not trace_every_step and not distinct
        self.checked: CheckedStep | None = None
        self._saved_hooks = SavedTensorHooks(self)
        self._forward_hook: ForwardHook | None = None  # while entered

    def _select(self, plan: Plan) -> None:
        """The plan the next step runs (a pipeline stage's micro-batch's)."""
        acts = self._acting[id(plan)]
        self.plan = plan
        self._step_context = None
        # with the graph, the executor acts at the plan's own positions (and logs where it did)
        self.positions = acts.positions
        # recipes (and RNG states) are kept only when something will be rebuilt
        self.needs_recipes = acts.needs_recipes
        self.recipe_ops = acts.recipe_ops

    def _check_device(self) -> None:
        """A plan's times are the hardware's it was made for: warn when this device is another."""
        hw = self.plan.hardware
        assert hw is not None
        if self.cuda:
            here = torch.cuda.get_device_name(self.device)
            tokens = [
                tok
                for tok in ("a100", "h100", "h200", "l4", "l40", "v100", "a10")
                if tok in hw.name.lower()
            ]
            differs = hw.name.startswith("cpu") or bool(
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
                stacklevel=4,
            )

    @property
    def log(self) -> RunLog:
        """What the last step did, by position (runtime/positions.py): ``log.schedule`` is where
        it released, prefetched and rebuilt each tensor."""
        return self.current_step.log if self.current_step is not None else self._last_log

    def end_step(self) -> None:
        """Let go of the last step once its backward has run (its log is kept): a context held
        across steps (the loop's, one per plan) holds nothing of the step before."""
        step = self.current_step
        if step is not None and not step.active:
            self._last_log = step.log
            self.current_step = None

    # ------------------------------------------------------------ context
    def __enter__(self) -> Run:
        self._stack = contextlib.ExitStack()
        self.stats = RunStats()  # what the steps of this entry do (a context may be re-entered)
        self._step_context = None
        self._forwards = 0
        self._stack.callback(self._remove_paths)
        self._stack.callback(self._saved_hooks.close)
        forward = self._stack.enter_context(ForwardHook(self))
        self._forward_hook = forward
        self._stack.enter_context(EndForwardOnBackward(self, forward))
        entered = _entered_runs()
        entered.append(self)
        self._stack.callback(entered.remove, self)
        return self

    def forward_running(self) -> bool:
        """Whether the model's forward is running now (a model called inside another's)."""
        return self._forward_hook is not None and self._forward_hook.depth > 0

    def end_forward(self) -> None:
        """Another context's model starts its forward outside this one's: this step's forward
        (and what ran after it, the loss) is over, so its saved-tensor hooks come off and the
        other model's saves go to its own step (a rank running several pipeline stages)."""
        self._end_forward(backward=False)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        stack, self._stack = self._stack, None
        try:
            if exc_type is None:
                self._end_forward(backward=False)
            else:  # the user's exception propagates unchanged; the step is dropped unchecked
                step = self.current_step
                if step is not None:
                    step.finished = False
                    try:
                        self._end_forward(backward=False)
                    except Exception:  # noqa: BLE001 - never mask the user's exception
                        pass
        finally:
            if stack is not None:
                stack.close()
            self._forward_hook = None
            self.stats.host_pool_bytes = self.pool.nbytes

    # ------------------------------------------------------------ the hooks' calls
    def begin_forward(self, args: Any, kwargs: Any) -> None:
        """The model's forward begins: a step of the kind these inputs take (runtime/step.py)."""
        self.stats.steps += 1
        for other in _entered_runs():
            if other is not self and not other.forward_running():
                other.end_forward()
        if len(self.micro_batch_plans) > 1:
            self._end_forward(backward=False)  # (the step before keeps its own plan)
            plans = self.micro_batch_plans
            self._select(plans[self._forwards % len(plans)])
        self._forwards += 1
        if self.moves_nothing or self.can_skim:
            signature = input_signature(args, kwargs)
            if self.plan_checked and signature == self._signature:
                if self.moves_nothing:
                    self._end_forward(backward=False)
                    self._remove_paths()  # (no module hook either)
                    self.end_step()
                    self.current_step = None  # no tracer, no hook: plain training
                    self.stats.untraced_steps += 1
                    return
                if self.checked is not None:
                    self._begin(HOOKED if self.checked.hooked else SKIMMED, self.checked)
                    return
            self._signature = signature
            self.checked = None  # new shapes: traced and checked again
        self._begin(TRACED, None)

    def forward_returned(self) -> None:
        if self.current_step is not None:
            self.current_step.finished = True

    def forward_left(self) -> None:
        """The model's forward is over, returned or raised: what runs next (the loss) runs
        outside every module."""
        if self._paths is not None:
            self._paths.leave_root()

    def backward_called(self) -> None:
        """The backward is called after the forward: the forward is over."""
        self._end_forward(backward=True)
        self.stats.backward_started = True

    # ------------------------------------------------------------ steps
    def _context(self) -> StepContext:
        if self._step_context is not None:
            return self._step_context
        self._step_context = StepContext(
            plan=self.plan,
            graph=self.graph,
            positions=self.positions,
            lanes=self.lanes,
            pool=self.pool,
            device=self.device,
            device_index=self.device_index,
            live=self.live,
            stats=self.stats,
            prefetch_ahead=self.prefetch_ahead,
            recipe_ops=self.recipe_ops,
            planned_bytes=self.planned_bytes,
            smaller_inputs=self.smaller_inputs,
        )
        return self._step_context

    def _paths_for_step(self) -> ModulePaths:
        """The module paths a tracer names ops by, hooked on every module while steps need them
        (a hooked step runs without them)."""
        if self._paths is None:
            # the root's path is entered and left by the context's own forward hooks
            self._paths = ModulePaths(self.model, hook_root=False)
        # a new step starts at the root: whatever an interrupted step left on the stack goes
        self._paths.reset("model")
        return self._paths

    def _remove_paths(self) -> None:
        if self._paths is not None:
            self._paths.remove()
            self._paths = None

    def _begin(self, kind: str, checked: CheckedStep | None) -> None:
        self._end_forward(backward=False)
        if self.current_step is not None:
            self._last_log = self.current_step.log
            # let go of the step before (what autograd still holds of it stays): its host
            # buffers go back to the pool for this one to borrow
            self.current_step = None
        step: Step | HookedStep
        if kind == HOOKED:
            self._remove_paths()
            step = HookedStep(self._context(), self._hooked_program(checked))
            self.stats.skimmed_steps += 1
            self.stats.hooked_steps += 1
        else:
            paths = self._paths_for_step()
            step = Step(self._context(), kind, checked, paths)
            if kind == SKIMMED:
                step.tracer = SkimTracer(self.model, step, paths)
                self.stats.skimmed_steps += 1
            else:
                if self.can_skim:
                    step.saves = []
                    step.skeletons = {} if self.needs_recipes else None
                step.tracer = RecordingTracer(self.model, step, paths, self.needs_recipes)
            step.tracer.__enter__()
        self.current_step = step
        step.active = True
        self._saved_hooks.on(step)

    def _hooked_program(self, checked: CheckedStep | None) -> HookedProgram:
        """The tables a step of hooks alone runs from: made once per checked step."""
        assert checked is not None and self.positions is not None
        program = self._program
        if program is None or program.checked is not checked:
            program = HookedProgram.of(checked, self.plan.decisions, self.positions)
            self._program = program
        return program

    def _end_forward(self, backward: bool) -> None:
        step = self.current_step
        if step is None or not step.active:
            return
        step.active = False
        self._saved_hooks.off()
        if isinstance(step, HookedStep):
            step.end_forward(backward)
            return
        tracer, step.tracer = step.tracer, None  # no cycle keeps the step (and its host buffers)
        try:
            step.end_forward(backward)
            if tracer is not None:
                tracer.__exit__(None, None, None)
        finally:
            if isinstance(tracer, (RecordingTracer, SkimTracer)):
                # the tracer's own cycle (its lifetime tracker calls back into it) would
                # otherwise hold the step, and through it the model, until the cyclic collector
                tracer.step = None
            if step.kind == TRACED and step.finished:
                # a forward that raised proves nothing about the plan: the user's error stands
                self._check_saved(step)
                if step.saves is not None and self.plan_checked:
                    self.checked = self._checked_step(step)

    def _check_saved(self, step: Step) -> None:
        """Without the graph, the plan's tensors are the model's: every one was saved."""
        if not self.plan_checked and step.packed:
            missing = sorted(set(self.plan.decisions) - step.packed)
            if missing and self.graph is None:
                more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
                raise PlanError(
                    f"plan tensor(s) {', '.join(map(repr, missing[:3]))}{more} were not "
                    "saved in this step: the plan was made for another model or input shape"
                )
            self.plan_checked = True

    def _checked_step(self, step: Step) -> CheckedStep:
        """What later steps of these input shapes are named by, and whether they can run with
        hooks alone: a plan that rebuilds nothing, acting only where this step ran a hook."""
        assert step.saves is not None and self._signature is not None
        saves = resolve_node_ops(step.saves, step.seq_to_op, step.base)
        why = ""
        if self.needs_recipes:
            why = "the plan rebuilds: its recipes are recorded op by op"
        elif self.positions is not None and self.graph is not None:
            why = hook_coverage(saves, self.positions, self.graph.n_ops)
            if not why:
                saves = mark_handled(saves, self.plan.decisions, self.positions, self.graph.n_ops)
        return CheckedStep(self._signature, tuple(saves), step.skeletons, not why, why)


_THREAD = threading.local()


def _entered_runs() -> list[Run]:
    """The contexts entered on this thread, in order (several: one per pipeline stage of a
    rank)."""
    runs = getattr(_THREAD, "runs", None)
    if runs is None:
        runs = _THREAD.runs = []
    return runs


@dataclass(frozen=True)
class _PlanActs:
    """Where one plan acts: its positions (with the graph, when it moves anything) and the ops
    whose recipes its rebuilds need."""

    positions: PlanPositions | None
    needs_recipes: bool
    recipe_ops: frozenset[int] | None

    @staticmethod
    def of(plan: Plan, graph: ActivationGraph | None) -> _PlanActs:
        moves = any(d != "keep" for d in plan.decisions.values())
        recipes = any(d == "recompute" for d in plan.decisions.values())
        return _PlanActs(
            PlanPositions.of(plan, graph) if graph is not None and moves else None,
            recipes,
            _recipe_ops(plan, graph) if recipes else None,
        )


def _recipe_ops(plan: Plan, graph: ActivationGraph | None) -> frozenset[int] | None:
    """With the graph, only the ops a rebuild may rerun keep recipes (the closures of the
    recomputed tensors, their in-place writers included, and of the saved tensors those read,
    which a rebuild runs again once released): the other ops are named, not recorded."""
    if graph is None:
        return None
    ops: set[int] = set()
    stack = [graph.tensor_index[n] for n, d in plan.decisions.items() if d == "recompute"]
    seen: set[int] = set()
    while stack:
        t = stack.pop()
        if t not in seen:
            seen.add(t)
            ops.update(graph.rerun_ops[t])
            stack.extend(graph.rerun_frontier[t])
    return frozenset(ops)


def apply(
    plan: Plan | StagePlan,
    model: torch.nn.Module,
    graph: ActivationGraph | None = None,
    *,
    smaller_inputs: bool = False,
    trace_every_step: bool = False,
    tracked_with: Run | None = None,
) -> Run:
    """Context manager running training steps of ``model`` under ``plan``.

    ``graph`` (optional) is the graph the plan was made for: its digest is checked against the
    plan's and its tensors' dtypes against the model's. Without it the plan's tensor names are
    checked against the tensors the model saves, on the first forward. Every saved tensor must
    have the bytes it was planned with; ``smaller_inputs`` accepts fewer (a plan made at the
    largest sequence length of a bucket runs the shorter ones: no point holds more than planned).

    Args:
        plan: a closed plan for the model's step, or a pipeline stage's plans (``StagePlan``:
            the n-th forward in the context runs micro-batch n mod M's plan, as torch's
            schedules run a stage's micro-batches in order; enter the context around whole
            ``schedule.step()`` calls).
        model: the torch module it was made for.
        graph: the graph it was made for: the executor then acts at the plan's positions.
        smaller_inputs: allow steps smaller than the profiled one.
        trace_every_step: trace and track every step, as the first one is (slower: for
            measuring what the steps hold, ``run.stats.peak_activation_bytes``, when several
            are in flight at once, as a pipeline stage's micro-batches are).
        tracked_with: another context whose tracked tensors this one's count with (the
            stages of one pipeline rank: ``stats.peak_activation_bytes`` is then the rank's).

    Returns:
        The Run, a context manager: steps inside it run under the plan (``run.stats``).

    Raises:
        PlanError: a plan for another model or graph, or one the checker refuses.
    """
    micro_batch_plans: tuple[Plan, ...] = ()
    if isinstance(plan, StagePlan):
        micro_batch_plans, plan = plan.plans, plan.plans[0]
    if tracked_with is not None and not isinstance(tracked_with, Run):
        raise TypeError(
            f"apply: tracked_with must be another apply() context, got {type(tracked_with).__name__}"
        )
    if not isinstance(plan, Plan):
        raise TypeError(
            f"apply: plan must be a slackswap.Plan or StagePlan, got {type(plan).__name__}"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"apply: model must be a torch.nn.Module, got {type(model).__name__}")
    if hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
        raise PlanError(
            "apply: the model is torch.compile'd; the executor runs eager models. "
            "Either apply the plan to model._orig_mod and call that, or keep the "
            "compiled model and run it inside slackswap.checkpointed(model._orig_mod, "
            "plan, graph) (plans with keep and recompute only)"
        )
    return Run(
        plan,
        model,
        graph,
        smaller_inputs=smaller_inputs,
        trace_every_step=trace_every_step,
        micro_batch_plans=micro_batch_plans,
        tracked_with=tracked_with,
    )
