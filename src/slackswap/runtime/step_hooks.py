"""Where a step begins and where its forward ends, and where the backward reaches a position:
the model's forward hooks, the wrappers of the backward call, and the pre-hooks of backward nodes
the executor installs (runtime/executor.py, runtime/step.py)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .executor import Run
    from .step import Step


class AtPosition:
    """A backward node's pre-hook: the step is at this node's position. It holds the step weakly:
    a node outlives its backward (the hook with it), and a strong reference would make a cycle
    (the step holds the node it unpacks for) that keeps the model alive until the cyclic
    collector runs."""

    __slots__ = ("step", "position")

    def __init__(self, step: Step, position: int):
        self.step, self.position = weakref.ref(step), position

    def __call__(self, grad_outputs: Any) -> None:
        step = self.step()
        if step is not None:
            step.at_backward(self.position)


class ForwardHook:
    """Each call of the model's forward starts a step (``Run.begin_forward``) and its return
    ends it (``Run.forward_returned``); ``depth`` says whether the model's forward is running
    (a backward called inside it, a gradient penalty, is not the step's)."""

    def __init__(self, run: Run):
        self.run = run
        self.depth = 0
        self.handles: list[Any] = []

    def __enter__(self) -> ForwardHook:
        def pre(module: Any, args: Any, kwargs: Any) -> None:
            if self.depth == 0:
                self.run.begin_forward(args, kwargs)
            self.depth += 1

        def returned(module: Any, args: Any, output: Any) -> None:
            if self.depth == 1:  # (not called when the forward raises)
                self.run.forward_returned()

        def left(module: Any, args: Any, output: Any) -> None:
            self.depth = max(0, self.depth - 1)
            if self.depth == 0:
                self.run.forward_left()

        model = self.run.model
        self.handles = [
            model.register_forward_pre_hook(pre, with_kwargs=True),
            model.register_forward_hook(returned),
            model.register_forward_hook(left, always_call=True),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.depth = 0


def input_signature(args: Any, kwargs: Any) -> tuple[Any, ...]:
    """The shapes, dtypes and devices of a call's tensor arguments (one level deep), and its
    other arguments' types: what decides the saved tensors' sizes for a given model."""

    def one(a: Any) -> Any:
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
    """Ends the step's forward when backward is called (``Run.backward_called``): a dispatch mode
    left on would see (and slow down) every backward op, and the plan's events at the backward's
    start happen there. Wraps ``torch.autograd.backward`` and ``torch.autograd.grad``
    (``Tensor.backward`` calls the former) for the life of the context; code holding its own
    reference to them still trains correctly, as the tracer ignores backward ops, only more
    slowly. A backward run inside the model's forward (a gradient penalty) leaves the forward
    going."""

    def __init__(self, run: Run, forward: ForwardHook):
        self.run = run
        self.forward = forward
        self.saved: tuple[Any, ...] = ()

    def __enter__(self) -> EndForwardOnBackward:
        backward, grad = torch.autograd.backward, torch.autograd.grad
        run, forward = self.run, self.forward

        def traced_backward(*args: Any, **kwargs: Any) -> Any:
            if forward.depth == 0:
                run.backward_called()
            return backward(*args, **kwargs)

        def traced_grad(*args: Any, **kwargs: Any) -> Any:
            if forward.depth == 0:
                run.backward_called()
            return grad(*args, **kwargs)

        self.saved = (backward, grad)
        torch.autograd.backward, torch.autograd.grad = traced_backward, traced_grad  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.autograd.backward, torch.autograd.grad = self.saved  # type: ignore[assignment]
