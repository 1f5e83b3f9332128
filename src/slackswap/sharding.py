"""Model state per rank under FSDP2 (``fully_shard``), for ``fit(..., ranks=N)``.

``fully_shard`` splits every parameter on its first dimension into N equal shards (padded to a
multiple of N rows), and so its gradient and the optimizer's state, which the optimizer makes
``zeros_like`` the sharded parameter. A rank holds

- its shards: ``sum ceil(rows / N) * row_bytes`` over the parameters, the same for their
  gradients (reduce-scattered into shards) and ``copies`` times for the optimizer state;
- beside them, while a block runs, FSDP2's unsharded buffers: the all-gathered parameters of the
  block running and of the one prefetched after it, and the block's unsharded gradients before
  their reduce-scatter: three times the largest group (each numbered block of a stack is a
  group, ``core/regions.py``; the rest of the model one more), in the dtype FSDP2 gathers them
  in (the model state's ``gathered_dtype``: bf16 under ``MixedPrecisionPolicy(param_dtype=
  torch.bfloat16)``, the "fsdp-mixed" regime, which holds these buffers on one rank too; else
  the parameters' own: autocast casts float32 masters op by op, after the gather).

A graph profiled on one device has no collectives; ``fsdp_collectives_of`` gives it the ones
``fully_shard`` issues with one unit per block (the same rule as a real FSDP2 profile's,
runtime/fsdp_collectives.py), so they take the copy lanes where ``Hardware.collectives_on_link``
says they cross the host link. The figures are the model's arithmetic, stated in
formulations/cost-model.md.
"""

from __future__ import annotations

import math
from typing import Any

from .core.graph import ActivationGraph, Collective
from .core.regions import op_regions, region_of

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4}
OPTIMIZER_COPIES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0, "none": 0}


def graph_parameters(graph: ActivationGraph) -> list[tuple[str, list[int], int]]:
    found = graph.extra.get("parameters")
    if not found:
        raise ValueError(
            f"fit(ranks=...): graph {graph.name!r} records no parameters (graph.extra"
            "['parameters']); profile the model with slackswap.profile"
        )
    out = []
    for name, shape, dtype in found:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"fit(ranks=...): parameter {name!r} has an unknown dtype {dtype!r}")
        out.append((str(name), [int(n) for n in shape], DTYPE_BYTES[dtype]))
    return out


def _block_key(module_path: str) -> str:
    """The FSDP2 unit a module's parameters belong to with one ``fully_shard`` per block: the
    numbered block (``model.layers.7``), else the root ("")."""
    region = region_of(module_path)
    return region if region and region.split(".")[-1].isdigit() else ""


def _unit_bytes(graph: ActivationGraph, params: list[tuple[str, list[int], int]]) -> dict[str, int]:
    """Per unit, its parameters' bytes as gathered: in the model state's ``gathered_dtype``
    (module docstring), else their own."""
    state = graph.extra.get("model_state") or {}
    compute = DTYPE_BYTES.get(str(state.get("gathered_dtype", "")), 0)
    groups: dict[str, int] = {}
    for name, shape, element in params:
        key = _block_key(name.rsplit(".", 1)[0])
        size = math.prod(shape) if shape else 1
        groups[key] = groups.get(key, 0) + size * (compute or element)
    return groups


def fsdp_collectives_of(graph: ActivationGraph, ranks: int) -> tuple[Collective, ...]:
    """The all-gathers and reduce-scatters one rank of ``ranks`` issues in ``graph``'s step with
    ``fully_shard`` on every numbered block and on the model (formulations/step-model.md,
    "Collectives on the copy lanes"): each unit's forward all-gather receives (N-1)/N of its
    gathered bytes as its first op is reached; a block's backward all-gathers them again as its
    backward starts (reshard after forward, FSDP2's default; the root keeps its parameters);
    the gradients' reduce-scatter sends (N-1)/N of their bytes (the trainable share, in the
    gathered dtype: ``MixedPrecisionPolicy``'s default reduce dtype) once its backward is done.
    A unit none of whose ops the graph records issues nothing."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise ValueError(f"fsdp collectives need ranks >= 2, got {ranks!r}")
    params = graph_parameters(graph)
    state = graph.extra.get("model_state") or {}
    total = sum(math.prod(s) * e if s else e for _, s, e in params)
    trainable = int(state.get("gradient_bytes", total)) / total if total else 0.0
    units = _unit_bytes(graph, params)
    regions = op_regions(graph)
    ops_of: dict[str, list[int]] = {}
    for i, region in enumerate(regions):
        key = region if region and region.split(".")[-1].isdigit() else ""
        ops_of.setdefault(key, []).append(i)
    share = (ranks - 1) / ranks
    out: list[Collective] = []
    # the root's forward all-gather comes first: the model's forward starts it
    for key in sorted(units, key=lambda k: (k != "", min(ops_of.get(k, [graph.n_ops])))):
        inside = ops_of.get(key) if key else list(range(graph.n_ops))
        if not inside:
            continue
        gathered = int(share * units[key])
        reduced = int(share * units[key] * trainable)
        unit = key or "model"
        first, last = graph.ops[min(inside)].name, graph.ops[max(inside)].name
        if gathered:
            out.append(Collective(f"{unit}.all_gather", first, "forward", 0, gathered))
            if key:
                out.append(Collective(f"{unit}.all_gather.backward", last, "backward", 0, gathered))
        if reduced:
            out.append(Collective(f"{unit}.reduce_scatter", first, "backward", reduced, 0))
    return tuple(out)


def casts_as_gathered(state: dict[str, Any], params: list[tuple[str, list[int], int]]) -> bool:
    """Whether FSDP2 gathers the parameters in another dtype than they are held in (its
    ``MixedPrecisionPolicy``), so that even one rank holds gathered copies of them."""
    gathered = DTYPE_BYTES.get(str(state.get("gathered_dtype", "")))
    return gathered is not None and any(element != gathered for _, _, element in params)


def shard_bytes(shape: list[int], element: int, ranks: int) -> int:
    """One rank's shard of a parameter: ceil(rows / N) rows (fully_shard pads dim 0 to N)."""
    if not shape:
        return element  # a scalar: one element on every rank
    rows = math.ceil(shape[0] / ranks)
    return rows * math.prod(shape[1:]) * element


def sharded_model_state(graph: ActivationGraph, ranks: int) -> dict[str, Any]:
    """``graph.extra["model_state"]`` as one rank of ``ranks`` holds it under FSDP2 (module
    docstring), with ``unsharded_bytes``: the all-gathered and unsharded-gradient buffers beside
    the activations."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"fit: ranks must be a positive integer, got {ranks!r}")
    state = dict(graph.extra.get("model_state") or {})
    if not state:
        raise ValueError(f"fit(ranks=...): graph {graph.name!r} records no model state")
    params = graph_parameters(graph)
    total = sum(math.prod(s) * e if s else e for _, s, e in params)
    if total != int(state["parameter_bytes"]):
        raise ValueError(
            f"fit(ranks=...): graph {graph.name!r}'s parameters ({total} bytes) are not its model "
            f"state's ({state['parameter_bytes']}): profiled from another model?"
        )
    trainable = int(state["gradient_bytes"]) / total if total else 0.0
    shards = sum(shard_bytes(s, e, ranks) for _, s, e in params)
    copies = OPTIMIZER_COPIES.get(str(state.get("optimizer", "adamw")), 2)
    grads = round(shards * trainable)
    optimizer_state = copies * grads
    step = 0
    if state.get("optimizer_step_bytes"):
        step = (
            grads
            if state.get("foreach")
            else 2 * max(shard_bytes(s, e, ranks) for _, s, e in params)
        )
    groups = _unit_bytes(graph, params)
    unsharded = 3 * max(groups.values()) if ranks > 1 or casts_as_gathered(state, params) else 0
    return {
        **state,
        "ranks": ranks,
        "parameter_bytes": shards,
        "gradient_bytes": grads,
        "optimizer_state_bytes": optimizer_state,
        "optimizer_step_bytes": step,
        "unsharded_bytes": unsharded,
        "total_bytes": shards + grads + optimizer_state,
        "unsharded_groups": len(groups),
    }
