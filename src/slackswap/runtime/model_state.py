"""What a model holds beside its activations (model_state): parameters, their gradients and the
optimizer's state (OPTIMIZER_STATE_BYTES per parameter byte), recorded in graph.extra for
slackswap.fit.
"""

from __future__ import annotations

from typing import Any

from ..core.graph import ActivationGraph

# bytes of optimizer state per trainable parameter element: AdamW and Adam keep two fp32
# moments (exp_avg, exp_avg_sq), SGD with momentum one buffer, plain SGD none
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd-momentum": 4, "sgd": 0, "none": 0}


def model_state(model, optimizer: str) -> dict[str, Any]:
    """What plain training holds besides activations: the parameters (tied ones once), their
    gradients, and the named optimizer's state."""
    seen: set[int] = set()
    params = grads = elements = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        nbytes = int(p.numel()) * p.element_size()
        params += nbytes
        if p.requires_grad:
            grads += nbytes
            elements += int(p.numel())
    state = elements * OPTIMIZER_STATE_BYTES[optimizer]
    return {
        "parameter_bytes": params,
        "gradient_bytes": grads,
        "optimizer": optimizer,
        "optimizer_state_bytes": state,
        "total_bytes": params + grads + state,
    }


def with_model_state(graph: ActivationGraph, model, optimizer: str) -> ActivationGraph:
    from dataclasses import replace

    return replace(graph, extra={**graph.extra, "model_state": model_state(model, optimizer)})
