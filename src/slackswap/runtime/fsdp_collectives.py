"""FSDP2's collectives in a profiled step (fsdp_collectives): each sharded unit's all-gathers and
reduce-scatters, named by the op whose forward or backward issues them, with the bytes each
moves.
"""

from __future__ import annotations

from typing import Any, cast

from ..core.graph import ActivationGraph


def fsdp_collectives(model, graph: ActivationGraph) -> tuple:
    """The FSDP2 traffic of one rank's step, from the model's units and the traced ops
    (formulations/step-model.md, "Collectives on the copy lanes"; shared/reference.md): for each
    unit with P bytes of its own parameters over N ranks, an all-gather receiving (N-1)/N * P as
    its first op is reached, again as its backward starts when it reshards after forward, and a
    reduce-scatter sending (N-1)/N * P once its backward is done."""
    from ..core.graph import Collective
    from .trace import sharding_units

    units = sharding_units(model)
    if not units:
        return ()
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    # by module object: a submodule may be called "model" too (Hugging Face's LlamaModel)
    found = [(name or "model", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    out = []
    for unit, module in found:
        inner = {
            id(p)
            for _, m in found
            if m is not module
            for p in cast(torch.nn.Module, m).parameters()
            if _nested(m, module)
        }
        nbytes = sum(
            p.numel() * p.element_size()
            for p in cast(torch.nn.Module, module).parameters()
            if id(p) not in inner
        )
        try:
            state = module._get_fsdp_state()
            group: Any = state._fsdp_param_group
            world = group.mesh_info.shard_mesh_size
            reshard = group.post_forward_mesh_info is not None
        except (AttributeError, TypeError):  # another torch: FSDP2's defaults
            world = dist.get_world_size() if dist.is_initialized() else 1
            reshard = True
        moved = int(nbytes * (world - 1) / world)
        if moved <= 0:
            continue
        inside = [i for i, op in enumerate(graph.ops) if _within(op.extra.get("module", ""), unit)]
        if not inside:
            continue
        first, last = graph.ops[inside[0]].name, graph.ops[inside[-1]].name
        out.append(Collective(f"{unit}.all_gather", first, "forward", 0, moved))
        if reshard:
            out.append(Collective(f"{unit}.all_gather.backward", last, "backward", 0, moved))
        out.append(Collective(f"{unit}.reduce_scatter", first, "backward", moved, 0))
    return tuple(out)


def _nested(inner, outer) -> bool:
    """Whether module ``inner`` sits inside module ``outer``."""
    return any(m is inner for m in outer.modules())


def _within(path: str, unit: str) -> bool:
    return path != "step" and (unit == "model" or path == unit or path.startswith(unit + "."))
