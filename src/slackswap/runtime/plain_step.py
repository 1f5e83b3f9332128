"""What a plain training step (no tracer, no hooks) measures, and the traced graph matched to
it: its phases' times (the traced op times are scaled to them), its metered peak, and the
parameter gradients it holds (formulations/step-model.md, "Profiled times", "Parameter
gradients"). torch is imported lazily.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

from ..core.errors import ProfileError
from ..core.graph import ActivationGraph


def call_model(model, inputs):
    """The model on its inputs: a tensor, a tuple (positional) or a dict (keyword arguments)."""
    import torch

    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    raise ProfileError(
        f"inputs must be a tensor, a tuple (positional arguments) or a dict "
        f"(keyword arguments), got {type(inputs).__name__}"
    )


def under_autocast(forward, dtype: str):
    """``forward`` (or the plain model call) inside ``torch.autocast`` on the parameters' device
    in ``dtype``: the forward of a mixed-precision step (float32 master weights, 16-bit compute),
    each call a region of its own as each training step is."""
    import torch

    def autocast_forward(model, inputs):
        where = next((p.device.type for p in model.parameters()), "cpu")
        with torch.autocast("cpu" if where == "meta" else where, dtype=getattr(torch, dtype)):
            return (forward or call_model)(model, inputs)

    return autocast_forward


def with_inputs_cast(forward, dtype: str):
    """``forward`` (or the plain model call) on its inputs' floating tensors cast to ``dtype``,
    as FSDP2's root casts them under ``MixedPrecisionPolicy(cast_forward_inputs=True)``."""
    import torch

    target = getattr(torch, dtype)

    def cast(x):
        if isinstance(x, torch.Tensor):
            return x.to(target) if x.is_floating_point() else x
        if isinstance(x, tuple):
            return tuple(cast(v) for v in x)
        if isinstance(x, list):
            return [cast(v) for v in x]
        if isinstance(x, dict):
            return {k: cast(v) for k, v in x.items()}
        return x

    def cast_forward(model, inputs):
        return (forward or call_model)(model, cast(inputs))

    return cast_forward


@contextlib.contextmanager
def parameters_cast(model, dtype: str):
    """The model with every parameter replaced by a leaf copy in ``dtype`` (tied ones stay
    tied, ``requires_grad`` kept) for the block, its own put back after: the parameters one
    step of FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` computes on (the all-gathered,
    cast ones), without touching the user's. Buffers keep their dtype, as FSDP2 leaves them."""
    import torch

    target = getattr(torch, dtype)
    swapped: list[tuple[Any, str, Any]] = []
    copies: dict[int, torch.nn.Parameter] = {}
    try:
        for module in model.modules():
            for key, value in list(module.named_parameters(recurse=False)):
                copy = copies.get(id(value))
                if copy is None:
                    with torch.no_grad():
                        data = value.detach().to(target)
                    copy = torch.nn.Parameter(data, requires_grad=value.requires_grad)
                    copies[id(value)] = copy
                swapped.append((module, key, value))
                module.register_parameter(key, copy)
        yield model
    finally:
        for module, key, value in reversed(swapped):
            module.register_parameter(key, value)


def fresh_autocast() -> None:
    """Start a forward the profile runs as a training step starts in its own autocast region:
    with no cached weight casts. Inside one region torch casts each weight once and reuses the
    cast (the autocast cache), so a profile's second forward would skip the casts that every
    real step, each in a region of its own (HF Trainer, Lightning), makes and saves."""
    import torch

    torch.clear_autocast_cache()


def with_parameter_gradients(graph: ActivationGraph, gradients: str) -> ActivationGraph:
    """``graph`` with the parameter gradients a step makes counted where plain training holds
    them (formulations/step-model.md, "Parameter gradients"): made in the step, each op's
    backward also holds those made by the backward ops before it (eager autograd stores each in
    ``.grad`` at once); held before the step, those that wait in their AccumulateGrad's buffer
    for the parameter's other readers (a tied embedding's: ``param_grad_waiting_bytes``) and
    are added in place when the last has run."""
    from dataclasses import replace

    ops = list(graph.ops)
    if gradients == "made":
        held = 0  # made by the backward so far (it runs the ops in reverse)
        for i in range(len(ops) - 1, -1, -1):
            before = held  # made before this op's backward: alive for a rebuild there too
            held += int(ops[i].extra.get("param_grad_bytes", 0))
            if held:
                ops[i] = replace(
                    ops[i],
                    backward_workspace_bytes=ops[i].backward_workspace_bytes + held,
                    rerun_workspace_bytes=ops[i].rerun_workspace_bytes + before,
                )
    else:
        for i, op in enumerate(ops):
            waiting = int(op.extra.get("param_grad_waiting_bytes", 0))
            if waiting:
                ops[i] = replace(
                    op,
                    backward_workspace_bytes=op.backward_workspace_bytes + waiting,
                    rerun_workspace_bytes=op.rerun_workspace_bytes + waiting,
                )
    return replace(graph, ops=tuple(ops), extra={**graph.extra, "parameter_gradients": gradients})


def plain_phase_times(model, inputs, loss_fn, sync, repeat: int, call=None) -> tuple[float, float]:
    """The medians of ``repeat`` plain steps' forward (loss included) and backward times, as
    training runs them: no tracer, no hooks. The gradients they add and the state they write are
    put back by the caller (Untouched), as the traced steps' are."""

    forward, backward = [], []
    for _ in range(repeat):
        if sync is not None:
            sync()
        fresh_autocast()
        start = time.perf_counter()
        loss = loss_fn((call or call_model)(model, inputs))
        if sync is not None:
            sync()
        middle = time.perf_counter()
        loss.backward()
        if sync is not None:
            sync()
        forward.append(middle - start)
        backward.append(time.perf_counter() - middle)
        del loss
    return statistics.median(forward), statistics.median(backward)


def metered_plain_step(
    model, inputs, loss_fn, device, gradients: str, call=None, sample: str = "ops"
) -> int:
    """One plain step's peak bytes (``StepMeter(sample=sample)``), parameter gradients as the
    graph counts them: made in the step ("made") or there before it ("held")."""
    import torch

    from .meter import StepMeter

    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None if gradients == "made" else torch.zeros_like(p)
        fresh_autocast()
        with StepMeter(device, sample=sample) as meter:
            loss = loss_fn((call or call_model)(model, inputs))
            loss.backward()
        del loss
    finally:
        for p, grad in zip(params, before):
            p.grad = grad
    return meter.peak_bytes


def scaled_to_plain(graph: ActivationGraph, forward_s: float, backward_s: float) -> ActivationGraph:
    """Each phase's op times scaled so that they sum to its plain time (formulations/
    step-model.md, "Profiled times"): the relative times are the tracer's, the totals the
    step's."""
    from dataclasses import replace

    traced_f = sum(o.forward_s for o in graph.ops)
    traced_b = sum(o.backward_s for o in graph.ops)
    kf = forward_s / traced_f if traced_f > 0 else 1.0
    kb = backward_s / traced_b if traced_b > 0 else 1.0
    ops = tuple(
        replace(o, forward_s=o.forward_s * kf, backward_s=o.backward_s * kb) for o in graph.ops
    )
    timing = {
        "scaled_to_plain": True,
        "forward_traced_s": traced_f,
        "forward_plain_s": forward_s,
        "backward_traced_s": traced_b,
        "backward_plain_s": backward_s,
    }
    return replace(graph, ops=ops, extra={**graph.extra, "timing": timing})
