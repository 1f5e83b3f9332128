"""The executor's saved-tensor hooks: every tensor autograd saves while a context is open goes to
the step running now (``Step.pack``), and every unpack to the step that packed it
(``Step.unpack``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .step import Handle

if TYPE_CHECKING:
    from .executor import Run


class SavedTensorHooks:
    """``torch.autograd.graph.saved_tensors_hooks`` for the life of a context."""

    def __init__(self, run: Run):
        self.run = run
        self.hooks: Any = None

    def pack(self, t: torch.Tensor) -> Any:
        step = self.run.current_step
        if step is None or not step.active:
            return t  # no step's forward is running (a save in backward): autograd's own
        return step.pack(t)

    @staticmethod
    def unpack(packed: Any) -> Any:
        if isinstance(packed, Handle):
            return packed.step.unpack(packed)
        return packed

    def __enter__(self) -> SavedTensorHooks:
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        # (the hooks object holds this one's methods: dropped, no cycle keeps the run)
        hooks, self.hooks = self.hooks, None
        hooks.__exit__(*exc)
