"""Planning inside the training loop: ``with ss.planned(model, loss_fn, budget) as loop``.

Each step's inputs fall in a shape bucket. The first step of a bucket is profiled (a warm-up
and a timed forward and backward, with the RNG, gradients and buffers restored after them, so
training is unchanged), planned at once by the heuristic, and trained under that plan; the exact
planner refines the plan in a background thread, and the loop switches to its plan at the next
step boundary once it is ready and the simulator proves it faster. On a machine with few cores
the background solver competes with training and with the profiling of a new bucket (its op
times come out slower); plans stay valid, they are only timed less well. Gradients do not
depend on the plan (the executor rebuilds bit-identical tensors), so a switch never changes training.

Bucket rule: every dimension of every input tensor rounded up to the next power of two (so
sequence lengths 65-128 share a bucket). A bucket's plan is made at the largest shape seen in it:
a step whose shape the plan's shape dominates (no dimension larger) runs that plan, its saved
tensors no larger than planned, so no point of the step holds more than the planned peak; a step
with a larger dimension is profiled and planned again and the bucket keeps the new plan. At most
``max_plans`` buckets keep plans; the least recently used one is dropped beyond that.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .core.errors import InfeasibleBudget
from .core.graph import ActivationGraph
from .core.hardware import Hardware
from .core.plan import Plan
from .solve import solve

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


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << math.ceil(math.log2(n))


def bucket_of(shapes: tuple) -> tuple:
    """The bucket of a shape signature: each dimension rounded up to a power of two."""
    return tuple((tuple(_pow2(d) for d in shape), dtype) for shape, dtype in shapes)


def _dominates(big: tuple, small: tuple) -> bool:
    return len(big) == len(small) and all(
        db == ds and len(sb) == len(ss) and all(b >= s for b, s in zip(sb, ss))
        for (sb, db), (ss, ds) in zip(big, small))


@dataclass(frozen=True)
class Switch:
    """A plan change, made between steps ``step - 1`` and ``step``."""

    step: int
    bucket: tuple
    source: str  # "heuristic" (a new bucket or shape) or the refining solver's name
    predicted_step_time_s: float


@dataclass
class _Bucket:
    shapes: tuple
    graph: ActivationGraph
    plan: Plan
    refining: Future | None = None
    steps: int = 0


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
    switches: list[Switch] = field(default_factory=list)
    last_stats: Any = None
    steps: int = 0
    _buckets: OrderedDict = field(default_factory=OrderedDict)
    _pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> PlannedLoop:
        if self.refine_solver is not None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slackswap-refine")
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # ------------------------------------------------------------ the step
    def step(self, inputs):
        """One training step on ``inputs`` (a tensor, a tuple of positional arguments or a dict
        of keyword arguments): forward, ``loss_fn``, backward, under the plan of the inputs'
        bucket. Returns the loss."""
        from .runtime.executor import apply

        shapes = _shapes(inputs)
        if not shapes:
            raise ValueError("planned: step() needs the inputs as a tensor, tuple or dict of "
                             "tensors (their shapes choose the plan)")
        key = bucket_of(shapes)
        bucket = self._boundary(key, shapes, inputs)
        bucket.steps += 1
        self.steps += 1
        with apply(bucket.plan, self.model, graph=bucket.graph, smaller_inputs=True) as run:
            loss = self.loss_fn(self._call(inputs))
            loss.backward()
        self.last_stats = run.stats
        return loss

    def _call(self, inputs):
        import torch

        if isinstance(inputs, dict):
            return self.model(**inputs)
        if isinstance(inputs, (tuple, list)) and not isinstance(inputs, torch.Tensor):
            return self.model(*inputs)
        return self.model(inputs)

    def _boundary(self, key: tuple, shapes: tuple, inputs) -> _Bucket:
        """The bucket's plan for this step: the refined one if it is ready and better, a new one
        if this shape is not covered."""
        bucket = self._buckets.get(key)
        if bucket is not None and not _dominates(bucket.shapes, shapes):
            bucket = None  # a larger shape in this bucket: plan again at it
        if bucket is None:
            bucket = self._new_bucket(key, shapes, inputs)
        else:
            self._buckets.move_to_end(key)
            self._adopt_refinement(key, bucket)
        return bucket

    def _new_bucket(self, key: tuple, shapes: tuple, inputs) -> _Bucket:
        from .runtime.profiler import profile

        with _unchanged_training(self.model):
            graph = profile(self.model, inputs, self.loss_fn, warmup=1, repeat=1,
                            name=f"{type(self.model).__name__}-bucket{len(self._buckets)}")
        try:
            plan = solve(graph, self.budget, self.hardware, solver="heuristic")
        except InfeasibleBudget:
            if self.refine_solver is None:
                raise
            # the heuristic found no plan that fits: the exact planner, now, before this step
            plan = solve(graph, self.budget, self.hardware, solver=self.refine_solver,
                         time_limit_s=self.refine_time_limit_s)
        bucket = _Bucket(shapes, graph, plan)
        self._buckets[key] = bucket
        self._buckets.move_to_end(key)
        while len(self._buckets) > self.max_plans:
            self._buckets.popitem(last=False)
        self.switches.append(Switch(self.steps, key, "heuristic", plan.info.predicted_step_time_s))
        if self._pool is not None:
            bucket.refining = self._pool.submit(
                solve, graph, plan.budget_bytes, plan.hardware, solver=self.refine_solver,
                time_limit_s=self.refine_time_limit_s, **_same_restrictions(plan))
        return bucket

    def _adopt_refinement(self, key: tuple, bucket: _Bucket) -> None:
        future = bucket.refining
        if future is None or not future.done():
            return
        bucket.refining = None
        try:
            better = future.result()
        except Exception as exc:  # noqa: BLE001 - the heuristic plan stays; said in the log
            log.warning("planned: refining bucket %s failed (%s); keeping the heuristic plan",
                        key, exc)
            return
        now = bucket.plan.info.predicted_step_time_s
        new = better.info.predicted_step_time_s
        if new is not None and now is not None and new < now * (1 - 1e-9):
            bucket.plan = better
            self.switches.append(Switch(self.steps, key, better.info.solver, new))

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the background refinements (for tests and benchmarks); the next step
        boundary adopts them."""
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        for bucket in list(self._buckets.values()):
            if bucket.refining is not None:
                left = None if deadline is None else max(0.0, deadline - time.perf_counter())
                with contextlib.suppress(Exception):
                    bucket.refining.result(timeout=left)

    def plan_for(self, inputs) -> Plan | None:
        """The plan the inputs' bucket holds now (None before its first step)."""
        bucket = self._buckets.get(bucket_of(_shapes(inputs)))
        return None if bucket is None else bucket.plan


def _same_restrictions(plan: Plan) -> dict:
    return {"allowed": tuple(plan.extra["allowed"])} if "allowed" in plan.extra and \
        plan.info.extra.get("allowed_from") != "hardware" else {}


@contextlib.contextmanager
def _unchanged_training(model):
    """Profiling runs a real forward and backward: the RNG streams, the gradients and the
    buffers (batch-norm statistics) are put back as they were, so the training that follows is
    the training without it."""
    import torch

    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    grads = {p: p.grad for p in model.parameters()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for p, g in grads.items():
            p.grad = g
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])


def planned(model, loss_fn: Callable, budget, hardware: Hardware | str | None = None, *,
            refine_solver: str | None = "cpsat", refine_time_limit_s: float = 30.0,
            max_plans: int = 8) -> PlannedLoop:
    """A training loop that plans itself: ``with ss.planned(model, loss_fn, "12GiB") as loop:``
    then ``loss = loop.step(batch)`` per step (see the module's docstring for the buckets).

    budget: as for :func:`slackswap.solve` (a fraction of each bucket's keep-all peak, bytes, or a
    string). hardware: None plans for the device the model is profiled on. refine_solver: the
    exact planner run in the background (None: the heuristic's plans only)."""
    if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
        raise ValueError(f"planned: max_plans must be a positive integer, got {max_plans!r}")
    return PlannedLoop(model, loss_fn, budget, hardware, refine_solver, refine_time_limit_s,
                       max_plans)
