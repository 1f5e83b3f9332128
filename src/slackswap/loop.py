"""Planning inside the training loop: ``with ss.planned(model, loss_fn, budget) as loop``.

Each step falls in a bucket: the shapes of its input tensors, every dimension rounded up to the
next power of two (sequence lengths 65-128 share one), and what else changes the traced step
(the modules' train/eval modes, which parameters require grad, their dtypes, and the non-tensor
arguments). The first step of a bucket is profiled (a warm-up and a timed forward and backward;
ss.profile puts back what they write, the loop the RNG) and planned at once by the heuristic,
and trained under that plan; the exact planner refines the plan in a child process
(refine.py), paused while the loop profiles another bucket (so that its load is not in the
profile's op times), and the loop switches to its plan at the next step boundary once it is
ready and the simulator proves it faster. Gradients do not depend on the plan (the executor
rebuilds bit-identical tensors), so a switch never changes training.

A bucket's plan is made at the largest shape seen in it: a step whose shape the plan's shape
dominates (no dimension larger) runs that plan, its saved tensors no larger than planned, so no
point of the step holds more than the planned peak; a step with a larger dimension is profiled
and planned again. A step whose traced ops do not match its bucket's plan (a route that depends
on the data) is undone (RNG and buffers) and profiled again; if it differs again, the bucket's
steps run without a plan from then on, said once in a warning. At most ``max_plans`` buckets keep
plans, the least recently used dropped first (its refinement cancelled). Leaving the context
cancels every refinement.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .core.errors import InfeasibleBudget, PlanError
from .core.graph import ActivationGraph
from .core.hardware import Hardware
from .core.plan import Plan
from .core.units import is_smallest
from .refinements import Refinements
from .solve import smallest_budget, solve

log = logging.getLogger("slackswap")

__all__ = ["PlannedLoop", "Switch", "bucket_of", "planned"]


def _shapes(inputs) -> tuple:
    """The shapes and dtypes of every tensor in ``inputs`` (a tensor, tuple/list or dict)."""
    import torch

    if isinstance(inputs, torch.Tensor):
        return ((tuple(inputs.shape), str(inputs.dtype)),)
    if isinstance(inputs, dict):
        return tuple(item for k in sorted(inputs) for item in _shapes(inputs[k]))
    if isinstance(inputs, (tuple, list)):
        return tuple(item for x in inputs for item in _shapes(x))
    return ()


def _arguments(inputs) -> tuple:
    """The non-tensor arguments among ``inputs`` (by position or name), as a hashable key: they
    can change the traced step (a flag, a mode string)."""
    import torch

    if isinstance(inputs, torch.Tensor):
        return ()
    if isinstance(inputs, dict):
        return tuple(
            (
                k,
                _arguments(inputs[k])
                if isinstance(inputs[k], (dict, list, tuple))
                else None
                if isinstance(inputs[k], torch.Tensor)
                else _key(inputs[k]),
            )
            for k in sorted(inputs)
        )
    if isinstance(inputs, (tuple, list)):
        return tuple(
            _arguments(x)
            if isinstance(x, (dict, list, tuple))
            else None
            if isinstance(x, torch.Tensor)
            else _key(x)
            for x in inputs
        )
    return (_key(inputs),)


def _key(value) -> Any:
    try:
        hash(value)
        return (type(value).__name__, value)
    except TypeError:
        return (type(value).__name__, repr(value))


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << math.ceil(math.log2(n))


def bucket_of(shapes: tuple) -> tuple:
    """The bucket of a shape signature: each dimension rounded up to a power of two."""
    return tuple((tuple(_pow2(d) for d in shape), dtype) for shape, dtype in shapes)


def _dominates(big: tuple, small: tuple) -> bool:
    return len(big) == len(small) and all(
        db == ds and len(sb) == len(ss) and all(b >= s for b, s in zip(sb, ss))
        for (sb, db), (ss, ds) in zip(big, small)
    )


def step_signature(model) -> tuple:
    """What of the model changes the traced step besides its inputs: each module's training
    flag, and each parameter's requires_grad and dtype."""
    return (
        tuple(m.training for m in model.modules()),
        tuple((p.requires_grad, str(p.dtype)) for p in model.parameters()),
    )


@dataclass(frozen=True)
class Switch:
    """A plan change, made between steps ``step - 1`` and ``step``."""

    step: int
    bucket: tuple
    source: str  # "heuristic" (a new bucket or shape), the refining solver's name, or "plain"
    predicted_step_time_s: float | None


@dataclass
class _Bucket:
    shapes: tuple
    graph: ActivationGraph
    plan: Plan
    steps: int = 0
    # the plan's context, entered for each of its steps: after its first step of given input
    # shapes, the later ones are skimmed (runtime/executor.py), not traced op by op
    run: Any = None

    def context(self, model):
        """The plan's context (made again when the plan is switched)."""
        from .runtime.executor import apply

        if self.run is None or self.run.plan is not self.plan:
            self.run = apply(self.plan, model, graph=self.graph, smaller_inputs=True)
        return self.run


@dataclass
class PlannedLoop:
    """What ``planned`` returns: call ``step(inputs)`` for each training step (forward, loss,
    backward under the bucket's plan); the optimizer stays the caller's."""

    model: Any
    loss_fn: Callable
    budget: Any
    hardware: Hardware | str | None = None
    refine_solver: str | None = "cpsat"
    refine_time_limit_s: float = 30.0
    max_plans: int = 8
    # how a step calls the model and makes its output (None: the model on the inputs); the
    # profile runs it so that a trainer's own loss computation is the one planned
    forward: Callable | None = None
    switches: list[Switch] = field(default_factory=list)
    last_stats: Any = None
    last_plan: Plan | None = None
    steps: int = 0
    _buckets: OrderedDict = field(default_factory=OrderedDict)
    _refinements: Refinements | None = None
    _mismatches: dict = field(default_factory=dict)
    _plain: set = field(default_factory=set)
    _open: Any = None  # the apply context ``forward_step`` left open for the backward

    def __post_init__(self) -> None:
        check_loop_options(self.budget, self.hardware, "planned")

    def __enter__(self) -> PlannedLoop:
        if self.refine_solver is not None:
            self._refinements = Refinements(self.refine_solver, self.refine_time_limit_s)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Cancel every refinement (running or queued): nothing outlives the loop."""
        self.end_step()
        if self._refinements is not None:
            self._refinements.close()
            self._refinements = None

    # ------------------------------------------------------------ the step
    def step(self, inputs):
        """One training step on ``inputs`` (a tensor, a tuple of positional arguments or a dict
        of keyword arguments): forward, ``loss_fn``, backward, under the plan of the inputs'
        bucket. Returns the loss."""
        return self.around(inputs, lambda: self._forward_backward(inputs))

    def _forward_backward(self, inputs):
        loss = self.loss_fn(self._call(inputs))
        loss.backward()
        return loss

    def around(self, inputs, body: Callable[[], Any]):
        """Run ``body()`` (one training step on ``inputs``, forward through backward, as a
        trainer runs it) under the plan of the inputs' bucket; returns what it returns. The
        bucket is profiled with ``loss_fn`` on the model's output, which must make the loss the
        way ``body`` does (the same ops). A body whose forward is not the plan's is undone (RNG
        and buffers) and run again under a new profile, as ``step`` does."""
        return self._under_plan(inputs, lambda bucket: self._run_planned(bucket, body), body)

    def forward_step(self, inputs, forward: Callable[[], Any]):
        """For trainers that run the backward themselves (Lightning): run ``forward()`` (the
        step's forward and loss, as the trainer computes them) under the plan of the inputs'
        bucket, and leave the plan's context open for the backward; ``end_step()`` closes it
        once the backward has run. A forward that is not the plan's is undone and run again
        under a new profile, as ``step`` does (it has run no backward)."""
        self.end_step()
        return self._under_plan(inputs, lambda bucket: self._open_planned(bucket, forward), forward)

    def end_step(self) -> None:
        """Close the context ``forward_step`` left open (after the step's backward)."""
        run, self._open = self._open, None
        if run is not None:
            run.__exit__(None, None, None)
            run.end_step()
            self.last_stats = run.stats

    def _under_plan(
        self, inputs, attempt: Callable[[_Bucket], tuple[bool, Any]], plain: Callable[[], Any]
    ):
        """The step under its bucket's plan (``attempt``); a step whose traced ops do not match
        the plan is undone and profiled again at these inputs, and a bucket whose steps differ
        again runs ``plain`` from then on, said once in a warning."""
        shapes = _shapes(inputs)
        if not shapes:
            raise ValueError(
                "planned: step() needs the inputs as a tensor, tuple or dict of "
                "tensors (their shapes choose the plan)"
            )
        key = (bucket_of(shapes), _arguments(inputs), step_signature(self.model))
        self._adopt_refinements()
        self.steps += 1
        if key in self._plain:
            return plain()
        bucket = self._boundary(key, shapes, inputs)
        done, out = attempt(bucket)
        if done:
            bucket.steps += 1
            return out
        self._mismatches[key] = self._mismatches.get(key, 0) + 1
        self._drop(key)
        if self._mismatches[key] >= 2:
            self._plain.add(key)
            self.switches.append(Switch(self.steps - 1, key[0], "plain", None))
            warnings.warn(
                f"planned: the traced step of bucket {key[0]} differs from batch to batch at "
                "the same shapes (a route that depends on the data, such as a mixture of "
                "experts' top-k choice): slackswap cannot plan it, and its steps run without a "
                "plan from now on",
                RuntimeWarning,
                stacklevel=3,
            )
            return plain()
        bucket = self._new_bucket(key, shapes, inputs)
        done, out = attempt(bucket)
        if not done:  # it changed between two runs on the same inputs
            self._mismatches[key] = 2
            self._plain.add(key)
            self._drop(key)
            warnings.warn(
                f"planned: the traced step of bucket {key[0]} is not the same twice "
                "on the same inputs: its steps run without a plan",
                RuntimeWarning,
                stacklevel=3,
            )
            return plain()
        bucket.steps += 1
        return out

    def _snapshot(self):
        """What a step that turns out not to be its plan's has changed and must put back: every
        RNG stream, the model's attributes and buffers (runtime/training_state.py) and the
        buffers' values."""
        from .runtime.training_state import TrainingState

        return (
            TrainingState(self.model),
            [(b, b.detach().clone()) for b in self.model.buffers()],
        )

    def _undo(self, snapshot, mismatch: Exception) -> None:
        import torch

        log.info(
            "planned: step %d does not match its bucket's plan (%s); profiling again",
            self.steps,
            mismatch,
        )
        state, buffers = snapshot
        state.restore()
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)

    def _open_planned(self, bucket: _Bucket, forward: Callable[[], Any]) -> tuple[bool, Any]:

        snapshot = self._snapshot()
        run = bucket.context(self.model)
        run.__enter__()
        try:
            out = forward()
        except PlanError as exc:
            run.__exit__(type(exc), exc, None)
            self._undo(snapshot, exc)
            return False, None
        except BaseException as exc:
            run.__exit__(type(exc), exc, None)
            raise
        self._open = run
        self.last_plan = bucket.plan
        return True, out

    def _run_planned(self, bucket: _Bucket, body: Callable[[], Any]) -> tuple[bool, Any]:
        """(True, what ``body`` returned) run under the bucket's plan; (False, None), with the
        RNG and the model's buffers put back and nothing run backward, when its forward is not
        the plan's."""

        snapshot = self._snapshot()
        with bucket.context(self.model) as run:
            try:
                loss = body()
            except PlanError as exc:
                if run.stats.backward_started:
                    raise  # not the forward's: the plan itself failed, never retried silently
                mismatch: PlanError | None = exc
            else:
                mismatch = None
        run.end_step()
        if mismatch is not None:
            self._undo(snapshot, mismatch)
            return False, None
        self.last_stats = run.stats
        self.last_plan = bucket.plan
        return True, loss

    def _call(self, inputs):
        import torch

        if isinstance(inputs, dict):
            return self.model(**inputs)
        if isinstance(inputs, (tuple, list)) and not isinstance(inputs, torch.Tensor):
            return self.model(*inputs)
        return self.model(inputs)

    def _boundary(self, key: tuple, shapes: tuple, inputs) -> _Bucket:
        """The bucket's plan for this step: a new one if this shape is not covered."""
        bucket = self._buckets.get(key)
        if bucket is not None and not _dominates(bucket.shapes, shapes):
            bucket = None  # a larger shape in this bucket: plan again at it
        if bucket is None:
            return self._new_bucket(key, shapes, inputs)
        self._buckets.move_to_end(key)
        return bucket

    def _new_bucket(self, key: tuple, shapes: tuple, inputs) -> _Bucket:
        from .runtime.profiler import ProfileError, profile

        paused = self._refinements.paused() if self._refinements else contextlib.nullcontext()
        try:
            with paused:  # (the profile puts back every RNG stream and attribute it changes)
                graph = profile(
                    self.model,
                    inputs,
                    self.loss_fn,
                    warmup=1,
                    repeat=1,
                    name=f"{type(self.model).__name__}-bucket{len(self._buckets)}",
                    forward=self.forward,
                )
        except ProfileError as exc:
            if exc.user_error is not None:  # the user's own exception, as a plain step raises it
                raise exc.user_error.with_traceback(exc.user_error.__traceback__) from None
            raise
        try:
            plan = self._first_plan(graph)
        except InfeasibleBudget as exc:
            raise InfeasibleBudget(
                f'planned: {exc} (budget="smallest" plans each bucket at the smallest budget '
                "its plans reach)",
                min_budget_bytes=exc.min_budget_bytes,
                budget_bytes=exc.budget_bytes,
            ) from None
        bucket = _Bucket(shapes, graph, plan)
        self._buckets[key] = bucket
        self._buckets.move_to_end(key)
        while len(self._buckets) > self.max_plans:
            self._drop(next(iter(self._buckets)))
        self.switches.append(
            Switch(self.steps - 1, key[0], "heuristic", plan.info.predicted_step_time_s)
        )
        if self._refinements is not None:
            self._refinements.submit(key, graph, plan, _same_restrictions(plan))
        return bucket

    def _first_plan(self, graph: ActivationGraph) -> Plan:
        """The heuristic's plan; where it finds none that fits, the exact planner's, now.
        budget="smallest" is searched to its end first (``smallest_budget`` has no clock), so
        that a bucket's budget is the same on a busy machine as on an idle one."""
        budget = self.budget
        if is_smallest(budget):
            budget = smallest_budget(graph, self.hardware).budget_bytes
        try:
            return solve(graph, budget, self.hardware, solver="heuristic")
        except InfeasibleBudget:
            if self.refine_solver is None:
                raise
            return solve(
                graph,
                budget,
                self.hardware,
                solver=self.refine_solver,
                time_limit_s=self.refine_time_limit_s,
            )

    def _drop(self, key: tuple) -> None:
        self._buckets.pop(key, None)
        if self._refinements is not None:
            self._refinements.cancel(key)

    def _adopt_refinements(self) -> None:
        if self._refinements is None:
            return
        for key, result in self._refinements.finished():
            bucket = self._buckets.get(key)
            if bucket is None:
                continue
            if isinstance(result, Exception):
                log.warning(
                    "planned: refining bucket %s failed (%s); keeping the heuristic plan",
                    key[0],
                    result,
                )
                continue
            if result.graph_digest != bucket.graph.digest:
                continue  # made for a graph the bucket no longer has
            now = bucket.plan.info.predicted_step_time_s
            new = result.info.predicted_step_time_s
            if new is not None and now is not None and new < now * (1 - 1e-9):
                bucket.plan = result
                self.switches.append(Switch(self.steps, key[0], result.info.solver, new))

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the refinements (for tests and benchmarks); the next step boundary adopts
        them."""
        if self._refinements is not None:
            self._refinements.join(timeout_s)

    def plan_for(self, inputs) -> Plan | None:
        """The plan the inputs' bucket holds now (None before its first step)."""
        key = (bucket_of(_shapes(inputs)), _arguments(inputs), step_signature(self.model))
        bucket = self._buckets.get(key)
        return None if bucket is None else bucket.plan

    def graph_for(self, inputs) -> ActivationGraph | None:
        """The profiled graph of the inputs' bucket (None before its first step)."""
        key = (bucket_of(_shapes(inputs)), _arguments(inputs), step_signature(self.model))
        bucket = self._buckets.get(key)
        return None if bucket is None else bucket.graph


def _same_restrictions(plan: Plan) -> dict:
    return (
        {"allowed": list(plan.extra["allowed"])}
        if "allowed" in plan.extra and plan.info.extra.get("allowed_from") != "hardware"
        else {}
    )


def check_loop_options(budget, hardware, where: str) -> None:
    """What can be checked before the first step: the budget's form (core/units.py) and the
    hardware's name, so a typo fails where it was typed, not after the first profile."""
    from .core.hardware import hardware as get_hardware
    from .core.units import check_budget

    check_budget(budget, where)
    if isinstance(hardware, str):
        try:
            get_hardware(hardware)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
    elif hardware is not None and not isinstance(hardware, Hardware):
        raise TypeError(
            f"{where}: hardware must be a preset's name or a Hardware, got {type(hardware).__name__}"
        )


def planned(
    model,
    loss_fn: Callable,
    budget,
    hardware: Hardware | str | None = None,
    *,
    refine_solver: str | None = "cpsat",
    refine_time_limit_s: float = 30.0,
    max_plans: int = 8,
) -> PlannedLoop:
    """A training loop that plans itself: ``with ss.planned(model, loss_fn, "12GiB") as loop:``
    then ``loss = loop.step(batch)`` per step (see the module's docstring for the buckets).

    budget: as for :func:`slackswap.solve` (a fraction of each bucket's keep-all peak, bytes, a
    string, or "smallest": each bucket at the smallest budget its plans reach), checked here. hardware: None plans for the device the model is profiled on. refine_solver: the
    exact planner run in a background process (None: the heuristic's plans only).

    Args:
        model: the torch module.
        loss_fn: the loss of its output.
        budget: as for ``solve``.
        hardware: the device (default: measured).
        (every other option as above)

    Returns:
        The PlannedLoop, a context manager: ``loop.step(inputs)`` runs one training step.
    """
    if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
        raise ValueError(f"planned: max_plans must be a positive integer, got {max_plans!r}")
    return PlannedLoop(
        model, loss_fn, budget, hardware, refine_solver, refine_time_limit_s, max_plans
    )
