"""Where a step begins and where its forward ends, and where the backward reaches a position:
the module hooks and autograd wrappers the executor installs for the life of a context."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .executor import Run, _Step


class AtPosition:
    """A backward node's pre-hook: the step is at this node's position. It holds the run and
    the step weakly: a node outlives its backward (the hook with it), and a strong reference
    would make a cycle (the step holds the node it unpacks for) that keeps the model alive
    until the cyclic collector runs."""

    __slots__ = ("run", "step", "position")

    def __init__(self, run: Run, step: _Step, position: int):
        self.run, self.step, self.position = weakref.ref(run), weakref.ref(step), position

    def __call__(self, grad_outputs):
        run, step = self.run(), self.step()
        if run is not None and step is not None:
            run._at_backward(step, self.position)


class ForwardHook:
    """Each call of the model's forward starts a step; tracing goes on through the loss and
    stops for ops run by the backward pass (as the profiler traces them)."""

    def __init__(self, run: Run):
        self.run = run
        self.handle = None

    def __enter__(self):
        def pre(module, args, kwargs):
            run = self.run
            run.stats.steps += 1
            if run._moves_nothing or run._can_skim:
                signature = input_signature(args, kwargs)
                if run._checked and signature == run._signature:
                    if run._moves_nothing:
                        run._end_forward()
                        if run._step is not None:
                            run._last_log = run._step.log
                        run._step = None  # no tracer, no recorded tensors: plain training
                        run.stats.untraced_steps += 1
                        return
                    if run._pack_order is not None:
                        run._begin_forward(skim=True)
                        return
                run._signature = signature
                run._pack_order = None  # new shapes: traced and checked again
            run._begin_forward()

        def post(module, args, output):
            step = self.run._step
            if step is not None:
                step.finished = True

        self.handles = [
            self.run.model.register_forward_pre_hook(pre, with_kwargs=True),
            self.run.model.register_forward_hook(post),
        ]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def input_signature(args, kwargs) -> tuple:
    """The shapes, dtypes and devices of a call's tensor arguments (one level deep), and its
    other arguments' types: what decides the saved tensors' sizes for a given model."""

    def one(a):
        if isinstance(a, torch.Tensor):
            return (tuple(a.shape), a.dtype, a.device, a.requires_grad)
        if isinstance(a, (list, tuple)):
            return tuple(one(x) for x in a)
        return a if isinstance(a, (int, float, bool, str, type(None))) else type(a)

    return (
        tuple(one(a) for a in args),
        tuple(sorted((k, one(v)) for k, v in (kwargs or {}).items())),
    )


class EndForwardOnBackward:
    """Stops tracing when backward is called: autograd runs its ops under the dispatch modes
    active at that call, so a mode left on would see (and slow down) every backward op. Wraps
    ``torch.autograd.backward`` and ``torch.autograd.grad`` (``Tensor.backward`` calls the
    former) for the life of the context; code holding its own reference to them still trains
    correctly, as the tracer ignores backward ops, only more slowly. A backward run inside the
    model's forward (a gradient penalty) leaves tracing on, as the forward goes on after it."""

    def __init__(self, run: Run):
        self.run = run
        self.saved: tuple = ()

    def __enter__(self):
        backward, grad = torch.autograd.backward, torch.autograd.grad
        run = self.run

        def traced_backward(*args, **kwargs):
            if not run._paths.stack:
                run._end_forward()
                run.stats.backward_started = True
            return backward(*args, **kwargs)

        def traced_grad(*args, **kwargs):
            if not run._paths.stack:
                run._end_forward()
                run.stats.backward_started = True
            return grad(*args, **kwargs)

        self.saved = (backward, grad)
        torch.autograd.backward, torch.autograd.grad = traced_backward, traced_grad
        return self

    def __exit__(self, *exc):
        torch.autograd.backward, torch.autograd.grad = self.saved
