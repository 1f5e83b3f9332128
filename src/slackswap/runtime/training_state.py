"""What training owns besides tensors' values, as it was: every random stream a forward can draw
from and every attribute a forward can rebind. The profiler runs extra steps and the training
loop may undo a step it could not plan; both put this back, so the training that follows is the
training without them (bit for bit, RNG included).

- RNG: torch's default generators (CPU, every CUDA device), numpy's global one, Python's
  ``random``, and every ``torch.Generator`` or ``numpy.random.Generator`` a module holds as an
  attribute (HF's SpecAugment and LayerDrop draw from ``np.random``; a module may own its
  generator).
- Attributes: each module's buffers and plain attributes. A forward that rebinds one
  (``self.ema = 0.9 * self.ema + 0.1 * h.mean(0)``, ``self.steps += 1``) gets the original object
  back; a list, dict or set changed in place gets its contents back. (Values written in place
  into tensors are the profiler's ``Untouched``.)
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

# what nn.Module keeps in its __dict__ for itself: never an attribute of the model's state
_MODULE_INTERNALS = frozenset(
    {
        "_parameters",
        "_modules",
        "_buffers",
        "_non_persistent_buffers_set",
        "training",
    }
)
_CONTAINERS = (list, dict, set)


def _is_hook_table(name: str) -> bool:
    return "hook" in name or name.startswith("_state_dict") or name.startswith("_load_state")


class TrainingState:
    """A snapshot of the RNG streams and the model's attributes (module docstring)."""

    def __init__(self, model: torch.nn.Module | None):
        self.torch_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.numpy_rng = np.random.get_state()
        self.python_rng = random.getstate()
        self.generators: list[tuple[Any, Any]] = []
        self.buffers: list[tuple[torch.nn.Module, dict[str, Any]]] = []
        self.attributes: list[tuple[torch.nn.Module, dict[str, Any]]] = []
        self.contents: list[tuple[Any, Any]] = []
        if model is None:
            return
        for module in model.modules():
            self.buffers.append((module, dict(module._buffers)))
            plain = {
                k: v
                for k, v in vars(module).items()
                if k not in _MODULE_INTERNALS and not _is_hook_table(k)
            }
            self.attributes.append((module, plain))
            for value in plain.values():
                self._note(value)

    def _note(self, value: Any) -> None:
        if isinstance(value, torch.Generator):
            self.generators.append((value, value.get_state()))
        elif isinstance(value, np.random.Generator):
            self.generators.append((value, value.bit_generator.state))
        elif isinstance(value, np.random.RandomState):
            self.generators.append((value, value.get_state()))
        elif type(value) in _CONTAINERS:
            self.contents.append((value, value.copy()))

    def restore(self) -> None:
        """Put everything back as it was at the snapshot."""
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        np.random.set_state(self.numpy_rng)
        random.setstate(self.python_rng)
        for gen, state in self.generators:
            if isinstance(gen, torch.Generator):
                gen.set_state(state)
            elif isinstance(gen, np.random.Generator):
                gen.bit_generator.state = state
            else:
                gen.set_state(state)
        for module, buffers in self.buffers:
            now_buffers = module._buffers
            if now_buffers.keys() != buffers.keys() or any(
                now_buffers[k] is not v for k, v in buffers.items()
            ):
                now_buffers.clear()
                now_buffers.update(buffers)
        for module, plain in self.attributes:
            now = vars(module)
            for k, v in plain.items():
                if now.get(k, _MISSING) is not v:
                    object.__setattr__(module, k, v)
            for k in [k for k in now if k not in plain and k not in _MODULE_INTERNALS]:
                if not _is_hook_table(k):
                    object.__delattr__(module, k)
        for container, copy in self.contents:
            if not _same_contents(container, copy):
                if isinstance(container, list):
                    container[:] = copy
                else:
                    container.clear()
                    container.update(copy)


_MISSING = object()


def _same_contents(container: Any, copy: Any) -> bool:
    """Whether a container holds what it held (by identity: its items may be tensors)."""
    if len(container) != len(copy):
        return False
    if isinstance(container, dict):
        return all(k in container and container[k] is v for k, v in copy.items())
    if isinstance(container, set):
        return container == copy
    return all(a is b for a, b in zip(container, copy))
