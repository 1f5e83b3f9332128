"""What the executor records to rebuild a tensor: each forward op as a recipe (its function, its
arguments with the step's tensors replaced by references, its RNG state), and how a saved tensor
sits in its storage. A rebuild runs the producer's recipe and then the recipes of the ops that
wrote the tensor in place (formulations/step-model.md, "Decisions")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from .trace import Tracer


@dataclass
class View:
    """How a saved tensor sits in its storage, so the exact layout can be rebuilt."""

    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> View:
        offset = cast(int, t.storage_offset())  # an int for the real tensors the executor sees
        return cls(offset, tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad)

    def on(self, storage: torch.UntypedStorage, device) -> torch.Tensor:
        out = torch.empty(0, dtype=self.dtype, device=device)
        out.set_(storage, self.offset, self.size, self.stride)
        return out


@dataclass
class Recipe:
    op: str
    func: Any
    args: Any  # the op's arguments, graph tensors replaced by Ref
    kwargs: Any
    out_names: list
    rng: Any


@dataclass(frozen=True)
class External:
    """A tensor a rerun reads that is not a graph tensor (the batch, a parameter): rebuilding
    from it after it was modified in place would give wrong gradients, so that raises (as torch's
    own checkpointing does)."""

    tensor: torch.Tensor
    version: int

    def check(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                f"a tensor of shape {tuple(self.tensor.shape)} that a recomputed op reads (an input "
                "of the model, or a parameter) was modified in place between forward and "
                "backward; rebuilding from it would give wrong gradients"
            )
        return self.tensor


@dataclass(frozen=True)
class Ref:
    """A graph tensor in a recipe's arguments: its name, how it sat in its storage, and how
    many in-place writes it had had when the op read it (a rebuild reading a later version
    would compute something else: refused)."""

    name: str
    view: View
    writes: int = 0


def template(obj, tracer: Tracer, written: dict[str, int]):
    """The op's arguments with every traced tensor replaced by a Ref (nothing else is held);
    other tensors (the batch, parameters) are kept with their version, checked at rerun.
    ``written``: in-place writes so far, per tensor of the step."""
    if isinstance(obj, torch.Tensor):
        name = tracer.tensor_name(obj)
        if name is None:
            return External(obj, obj._version)
        return Ref(name, View.of(obj), written.get(name, 0))
    if isinstance(obj, (list, tuple)):
        return type(obj)(template(a, tracer, written) for a in obj)
    return obj


def fill(obj, resolve):
    if isinstance(obj, Ref):
        return resolve(obj)
    if isinstance(obj, External):
        return obj.check()
    if isinstance(obj, (list, tuple)):
        return type(obj)(fill(a, resolve) for a in obj)
    return obj
