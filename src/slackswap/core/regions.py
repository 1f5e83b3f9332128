"""A model's blocks as regions of its graph: what torch's checkpoint wraps when a user
checkpoints each block (HF ``gradient_checkpointing``, torchtitan's per-layer AC), named once for
the planners' baselines and the runtime's checkpoint policy.
"""

from __future__ import annotations

from .graph import ActivationGraph, Op


def region_of(module_path: str) -> str:
    """The checkpoint region an op's module belongs to: its path up to and including the first
    numbered component (``blocks.3``, ``model.layers.7``, ``layer2.1``: one block of a stack),
    else the module itself (``transformer.wte``, ``head``). "" (the model's own ops) is no region.
    A region that contains another (``transformer`` around ``transformer.h.0``) is dropped by
    ``op_regions``: its own ops run unwrapped."""
    parts = module_path.split(".") if module_path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return module_path


def module_of(op: Op) -> str:
    """The module path an op ran in (recorded by the profiler; a workload's op names it before
    a "/")."""
    return str(op.extra.get("module", op.name.split("/")[0] if "/" in op.name else ""))


def op_regions(graph: ActivationGraph, regions: list[str] | None = None) -> list[str]:
    """Per op, the region a checkpoint wraps it in ("" none): ``region_of``, or the longest of
    ``regions`` containing its module; a region around another is not wrapped (its own ops run
    plainly)."""

    def region(path: str) -> str:
        if regions is None:
            return region_of(path)
        inside = [r for r in regions if path == r or path.startswith(r + ".")]
        return max(inside, key=len) if inside else ""

    of_op = [region(module_of(op)) for op in graph.ops]
    names = set(of_op) - {""}
    nested = {r for r in names if any(o != r and o.startswith(r + ".") for o in names)}
    return ["" if r in nested else r for r in of_op]


def numbered_blocks(of_op: list[str]) -> set[str]:
    """The regions that are blocks of a stack (a numbered path component): what per-block
    checkpointing wraps, leaving embeddings and heads to run plainly."""
    return {r for r in of_op if r and r.split(".")[-1].isdigit()}
