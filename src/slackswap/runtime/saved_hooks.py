"""The executor's saved-tensor hooks: every tensor autograd saves during a step's forward goes to
that step (``Step.pack``), and every unpack to the step that packed it (``Step.unpack``).

The hooks are on only while the forward of a step that moves tensors runs (``on`` at its
start, ``off`` when it ends): an unpack hook travels with each saved tensor, so the backward
needs nothing on, and a step run untraced (a keep-all plan's) pays for no hook at all."""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch

from .hooked_step import HookedStep
from .step import Handle, Step, held_as_saved, unchanged_since_saved

if TYPE_CHECKING:
    from .executor import Run

_push = torch._C._autograd._push_saved_tensors_default_hooks
_pop = torch._C._autograd._pop_saved_tensors_default_hooks
_top = torch._C._autograd._top_saved_tensors_default_hooks


class SavedTensorHooks:
    """torch's default saved-tensor hooks, pushed for a step's forward and popped after it."""

    def __init__(self, run: Run):
        self.run = weakref.ref(run)  # (the run owns this object: no cycle)
        self.pushed: tuple[Any, Any] | None = None

    def pack(self, t: torch.Tensor) -> Any:
        run = self.run()
        step = None if run is None else run.current_step
        if step is None or not step.active:
            return held_as_saved(t)  # no step's forward is running (a save in backward)
        return step.pack(t)

    @staticmethod
    def unpack(packed: Any) -> Any:
        if isinstance(packed, Handle):
            return packed.step.unpack(packed)
        return unchanged_since_saved(packed)

    def on(self, step: Step | HookedStep | None = None) -> None:
        """Push the hooks; for a hooked step, its own methods (no frame in between)."""
        if self.pushed is None:
            if isinstance(step, HookedStep):
                self.pushed = (step.pack, step.unpack)
            else:
                self.pushed = (self.pack, self.unpack)
            _push(*self.pushed)

    def off(self) -> None:
        """Pop the hooks if they are torch's top ones; hooks the user pushed inside the step and
        has not popped yet stay above them, and they come off at the next chance."""
        if self.pushed is not None:
            top = _top(True)
            if top is not None and top[0] is self.pushed[0] and top[1] is self.pushed[1]:
                _pop()
                self.pushed = None  # (the bound methods held this object: no cycle is left)

    def close(self) -> None:
        self.off()
        if self.pushed is not None:
            warnings.warn(
                "apply: saved-tensor hooks pushed inside the context are still on when it "
                "closes: the executor's stay under them until they are popped",
                RuntimeWarning,
                stacklevel=3,
            )
