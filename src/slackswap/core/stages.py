"""A whole model's step split into pipeline stages (formulations/pipeline.md, "Stages of a
profiled model"): the numbered blocks of its stack (``model.layers.7``) shared out evenly in
order, the ops before the first block on the first stage, those after the last (the final
norm, the head, the loss) on the last. Each stage's graph is one micro-batch's step on it: the
tensors it reads from an earlier stage arrive through a ``recv`` op at its start (their buffer
is the stage's input: it cannot be rerun there), and a tensor is saved for the stage's own
backward readers alone.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .graph import ActivationGraph, Collective, Op, Tensor
from .regions import module_of, numbered_blocks, op_regions, region_of

RECV = "recv"
# the point-to-point messages of torch's pipelining, by the name they carry in a stage's graph
RECV_ACTIVATIONS = "pipeline.recv_activations"
SEND_INPUT_GRADIENTS = "pipeline.send_input_gradients"
SEND_ACTIVATIONS = "pipeline.send_activations"
RECV_OUTPUT_GRADIENTS = "pipeline.recv_output_gradients"


def pipeline_messages(
    first_op: str, last_op: str, received_bytes: int, sent_bytes: int
) -> tuple[Collective, ...]:
    """A stage's sends and receives as the step's collectives (formulations/pipeline.md,
    "Messages between stages"): what it receives (``received_bytes``, 0 on the first stage)
    as its first op is reached and their gradients, the same size, sent as that op's backward
    is; what it sends on (``sent_bytes``, 0 on the last stage) as its last op is reached and
    their gradients received as its backward starts. Where the hardware's
    ``collectives_on_link`` says so they take the copy lanes, as FSDP2's collectives do."""
    out: list[Collective] = []
    if received_bytes:
        out.append(Collective(RECV_ACTIVATIONS, first_op, "forward", 0, int(received_bytes)))
        out.append(Collective(SEND_INPUT_GRADIENTS, first_op, "backward", int(received_bytes), 0))
    if sent_bytes:
        out.append(Collective(SEND_ACTIVATIONS, last_op, "forward", int(sent_bytes), 0))
        out.append(Collective(RECV_OUTPUT_GRADIENTS, last_op, "backward", 0, int(sent_bytes)))
    return tuple(out)


def stage_of_ops(graph: ActivationGraph, stages: int) -> list[int]:
    """Per op, its stage: the blocks in the order they first run, split evenly (the first
    stages one more where they do not divide); an op outside every block goes with the block
    before it (the first stage before any)."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"split_stages: stages must be a positive integer, got {stages!r}")
    of_op = op_regions(graph)
    blocks = numbered_blocks(of_op)
    order: list[str] = []
    for r in of_op:
        if r in blocks and r not in order:
            order.append(r)
    if len(order) < stages:
        raise ValueError(
            f"split_stages: graph {graph.name!r} has {len(order)} numbered blocks "
            f"({', '.join(order[:4]) or 'none'}); {stages} stages need as many"
        )
    per, more = divmod(len(order), stages)
    stage_of_block: dict[str, int] = {}
    i = 0
    for s in range(stages):
        for _ in range(per + (1 if s < more else 0)):
            stage_of_block[order[i]] = s
            i += 1
    out: list[int] = []
    current = 0
    last_block = max(j for j, r in enumerate(of_op) if r in blocks)
    for j, r in enumerate(of_op):
        if r in stage_of_block:
            current = stage_of_block[r]
        elif j > last_block:
            current = stages - 1
        out.append(current)
    if out != sorted(out):
        raise ValueError(f"split_stages: graph {graph.name!r} runs its blocks out of order")
    return out


def split_stages(graph: ActivationGraph, stages: int) -> tuple[ActivationGraph, ...]:
    """``graph`` as ``stages`` pipeline stages (module docstring), each with
    ``extra["pipeline_stage"]`` and, where the graph records its model state, the stage's share
    of it (its parameters by the blocks they belong to).

    Args:
        graph: the whole model's step.
        stages: how many stages.

    Returns:
        The stages' graphs, in order.
    """
    of_op = stage_of_ops(graph, stages)
    producer_stage: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for t in op.outputs:
            producer_stage[t] = of_op[i]
    tensors = {t.name: t for t in graph.tensors}
    where = _parameter_stages(graph, of_op, stages)
    # what each stage receives from the one before (torch's stages pass on what a later one
    # reads): its sent bytes are the next stage's received
    received_bytes = [0] * (stages + 1)
    for s in range(stages):
        seen: set[str] = set()
        for i, op in enumerate(graph.ops):
            if of_op[i] == s:
                for t in op.inputs:
                    if t in tensors and producer_stage.get(t, s) < s and t not in seen:
                        seen.add(t)
                        received_bytes[s] += int(tensors[t].bytes)
    out = []
    for s in range(stages):
        mine = [op for i, op in enumerate(graph.ops) if of_op[i] == s]
        names = {op.name for op in mine}
        received: list[str] = []
        for op in mine:
            for t in op.inputs:
                if t in tensors and producer_stage.get(t, s) < s and t not in received:
                    received.append(t)
        rename = {t: f"{RECV}:{t}" for t in received}
        ops: list[Op] = []
        if received:
            ops.append(
                Op(
                    RECV,
                    0.0,
                    0.0,
                    inputs=("stage_input",),
                    outputs=tuple(rename[t] for t in received),
                    recomputable=False,
                    extra={"module": ""},
                )
            )
        for op in mine:
            ops.append(
                replace(
                    op,
                    inputs=tuple(rename.get(t, t) for t in op.inputs),
                    writes=tuple(rename.get(w, w) for w in op.writes),
                    rerun_with=tuple(r for r in op.rerun_with if r in names),
                )
            )
        made = [t for op in ops for t in op.outputs]
        last = ops[-1].name
        kept: list[Tensor] = []
        for name in made:
            source = (
                tensors[name.removeprefix(f"{RECV}:")] if name in rename.values() else tensors[name]
            )
            kept.append(
                replace(
                    source,
                    name=name,
                    saved_for=tuple(o for o in source.saved_for if o in names),
                    alive_until=source.alive_until
                    if source.alive_until is None or source.alive_until in names
                    else last,
                    rebuilt_before=source.rebuilt_before
                    if source.rebuilt_before in names
                    else None,
                    group=None if name in rename.values() else source.group,
                )
            )
        extra: dict[str, Any] = {
            **graph.extra,
            "pipeline_stage": s,
            "pipeline_stages": stages,
            "split_from": graph.name,
        }
        if where is not None:
            params = [p for p in graph.extra["parameters"] if where[str(p[0])] == s]
            extra["parameters"] = params
            if "model_state" in graph.extra:
                whole = _parameter_bytes(graph.extra["parameters"])
                share = _parameter_bytes(params) / whole if whole else 0.0
                extra["model_state"] = _state_share(dict(graph.extra["model_state"]), share)
        out.append(
            replace(
                graph,
                name=f"{graph.name}-stage{s}of{stages}",
                ops=tuple(ops),
                tensors=tuple(kept),
                collectives=tuple(c for c in graph.collectives if c.op in names)
                + pipeline_messages(ops[0].name, last, received_bytes[s], received_bytes[s + 1]),
                optimizer_s=graph.optimizer_s if s == stages - 1 else 0.0,
                extra=extra,
            )
        )
    return tuple(out)


def _parameter_stages(
    graph: ActivationGraph, of_op: list[int], stages: int
) -> dict[str, int] | None:
    """Which stage holds each recorded parameter: a block's parameters its block's stage, any
    other the stage of the first op run in its module (embeddings on the first, the final norm
    and the head on the last)."""
    params = graph.extra.get("parameters")
    if not params:
        return None
    by_region: dict[str, int] = {}
    by_module: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        module = module_of(op)
        by_region.setdefault(region_of(module), of_op[i])
        by_module.setdefault(module, of_op[i])
    where: dict[str, int] = {}
    for name, _, _ in params:
        module = str(name).rsplit(".", 1)[0]
        region = region_of(module)
        if region.split(".")[-1].isdigit() and region in by_region:
            where[str(name)] = by_region[region]
        else:
            where[str(name)] = by_module.get(module, 0 if "emb" in module else stages - 1)
    return where


_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def _parameter_bytes(params: list[Any]) -> int:
    total = 0
    for _, shape, dtype in params:
        n = 1
        for d in shape:
            n *= int(d)
        total += n * _ELEMENT.get(str(dtype), 4)
    return total


def _state_share(state: dict[str, Any], share: float) -> dict[str, Any]:
    """The model state of a stage holding ``share`` of the parameters' bytes: parameters,
    gradients and optimizer state in proportion; the optimizer step's temporaries too when
    they are a copy of the moments (foreach), else the whole model's figure (the largest
    parameter's: at most that)."""
    out = dict(state)
    for key in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
        out[key] = round(int(state.get(key, 0)) * share)
    if state.get("foreach"):
        out["optimizer_step_bytes"] = round(int(state.get("optimizer_step_bytes", 0)) * share)
    out["total_bytes"] = (
        out["parameter_bytes"] + out["gradient_bytes"] + out["optimizer_state_bytes"]
    )
    out["stage_share"] = share
    return out
