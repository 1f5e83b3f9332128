"""The exact model's host_memory row (formulations/milp.md; step-model.md "Host memory"): the
swapped tensors' bytes together within the hardware's host memory."""

from __future__ import annotations

from .formulation import Formulation


def host_memory_row(f: Formulation, saved: list[int]) -> None:
    """``sum ceil(bytes / unit) * swap <= floor(limit / unit)``: no plan the model admits needs
    more host memory than the hardware has. Only where the saved tensors together exceed it
    (the row binds nothing otherwise)."""
    nbytes, limit, unit = f.graph.tensor_bytes, f.hw.host_memory_bytes, f.scaling.byte_unit
    if limit and int(nbytes[saved].sum()) > limit:
        terms = [(f.swap[t], -(-int(nbytes[t]) // unit)) for t in saved]
        f.model.le("host_memory", terms, int(limit) // unit)
