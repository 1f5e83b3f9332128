"""What a model holds beside its activations (model_state): parameters, their gradients, the
optimizer's state, and what the optimizer's own step allocates on top of them, recorded in
graph.extra for slackswap.fit.

Counted as torch's optimizers (torch 2.x, ``torch/optim/adam.py``, ``adamw.py``, ``sgd.py``)
allocate them:

- state: Adam and AdamW keep two moments (``exp_avg``, ``exp_avg_sq``) made with
  ``zeros_like(param)``, so in the parameter's dtype (bf16 parameters: bf16 moments); SGD with
  momentum one buffer (``clone`` of the first gradient); plain SGD none.
- the step's temporaries, beside everything above: Adam's multi-tensor path (``foreach=True``,
  torch's default when every parameter is on CUDA) makes ``_foreach_sqrt`` of every
  ``exp_avg_sq`` of a (device, dtype) group at once, and divides and adds in place: one copy of
  the group's moments. The single-tensor path (``foreach=False``, the default elsewhere) makes
  ``(exp_avg_sq.sqrt() / bias_correction2_sqrt)``: two temporaries of one parameter at a time,
  the largest parameter's. SGD (with or without momentum, no nesterov, no weight decay) updates
  in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.errors import ProfileError
from ..core.graph import ActivationGraph


@dataclass(frozen=True)
class Precision:
    """A regime a step trains in: what its parameters, gradients and optimizer state are held
    in, the dtype its forward computes in, and how it gets there."""

    # the dtype the forward computes in (None: the parameters' own)
    compute_dtype: str | None
    # float32 master parameters (and so float32 gradients and moments)
    masters: bool
    # the forward runs under ``torch.autocast`` (else, with masters, on parameters cast to
    # ``compute_dtype`` as FSDP2's ``MixedPrecisionPolicy`` all-gathers them)
    autocast: bool
    # the dtype FSDP2 all-gathers the parameters in and reduce-scatters their gradients in
    # (None: the parameters' own)
    gathered_dtype: str | None
    # what the report says of it
    description: str


PRECISIONS: dict[str, Precision] = {
    # everything in the model's dtype (torch's default: a bf16 model has bf16 gradients and
    # bf16 moments, zeros_like the parameters)
    "pure": Precision(
        None, False, False, None, "parameters, gradients and optimizer state in {compute}"
    ),
    # float32 master parameters, float32 gradients and moments, the forward under autocast in
    # bf16 (what most bf16 training runs: HF Trainer's bf16=True, Lightning's "bf16-mixed");
    # under fully_shard without a policy the float32 parameters are gathered as they are and
    # autocast casts them op by op
    "mixed": Precision(
        "bfloat16",
        True,
        True,
        None,
        "float32 master parameters, gradients and optimizer state; the forward in {compute} "
        "under autocast",
    ),
    # the same with fp16 compute (a GradScaler's scale is a scalar: no bytes counted)
    "mixed-fp16": Precision(
        "float16",
        True,
        True,
        None,
        "float32 master parameters, gradients and optimizer state; the forward in {compute} "
        "under autocast",
    ),
    # FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``: float32 sharded parameters,
    # gradients and moments; each unit's parameters all-gathered in bf16 and the forward run on
    # them in bf16 (no autocast: norms and softmax in bf16 too), the floating inputs cast to
    # bf16 (``cast_forward_inputs``); the bf16 gradients reduce-scattered in bf16 (the policy's
    # default ``reduce_dtype``) into float32 shards
    "fsdp-mixed": Precision(
        "bfloat16",
        True,
        False,
        "bfloat16",
        "float32 master parameters, gradients and optimizer state, sharded by fully_shard; the "
        "forward in {compute} on parameters gathered in {compute} (MixedPrecisionPolicy)",
    ),
}

# state per trainable parameter, in parameter-sized copies
OPTIMIZER_STATE_COPIES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0, "none": 0}
OPTIMIZERS = tuple(OPTIMIZER_STATE_COPIES)


def default_foreach(model) -> bool:
    """torch's default: the multi-tensor path when every parameter is a CUDA tensor (a model
    on the meta device is taken to train on CUDA, as a fake profile for a GPU preset does)."""
    params = list(model.parameters())
    return bool(params) and all(p.device.type in ("cuda", "meta") for p in params)


def optimizer_step_bytes(trainable: list[tuple[int, str]], optimizer: str, foreach: bool) -> int:
    """Bytes ``optimizer.step()`` allocates beside parameters, gradients and state, from the
    trainable parameters' (bytes, dtype) (module docstring)."""
    if optimizer not in ("adam", "adamw") or not trainable:
        return 0
    if foreach:
        groups: dict[str, int] = {}
        for nbytes, dtype in trainable:
            groups[dtype] = groups.get(dtype, 0) + nbytes
        return max(groups.values())
    return 2 * max(nbytes for nbytes, _ in trainable)


def check_precision(model, precision: str) -> None:
    """A mixed regime keeps float32 master parameters: refuse a model whose trainable
    parameters are another dtype, naming the first, rather than count it as it is not."""
    if precision not in PRECISIONS:
        raise ProfileError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if not PRECISIONS[precision].masters:
        return
    for name, p in model.named_parameters():
        if p.requires_grad and str(p.dtype) != "torch.float32":
            raise ProfileError(
                f"precision={precision!r} keeps float32 master parameters; parameter {name!r} is "
                f"{str(p.dtype).removeprefix('torch.')} (a model trained in its own dtype is "
                "precision='pure')"
            )


def model_state(
    model, optimizer: str, foreach: bool | None = None, precision: str = "pure"
) -> dict[str, Any]:
    """What plain training holds besides activations: the parameters (tied ones once), their
    gradients, the named optimizer's state, and its step's temporaries (``foreach``: None for
    torch's default on the parameters' device). Each is counted in the dtype torch holds it in:
    the parameters' own, which a mixed regime (``precision``) has checked is float32."""
    regime = PRECISIONS[precision]
    seen: set[int] = set()
    params = grads = 0
    trainable: list[tuple[int, str]] = []
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        nbytes = int(p.numel()) * p.element_size()
        params += nbytes
        if p.requires_grad:
            grads += nbytes
            trainable.append((nbytes, str(p.dtype)))
    state = OPTIMIZER_STATE_COPIES[optimizer] * grads
    compute = regime.compute_dtype or _dtype_of(trainable)
    foreach = default_foreach(model) if foreach is None else bool(foreach)
    step = optimizer_step_bytes(trainable, optimizer, foreach)
    return {
        "precision": precision,
        "compute_dtype": compute,
        # what the regime holds in which dtype, as the report says it
        "holds": regime.description.format(compute=compute),
        "gathered_dtype": regime.gathered_dtype or _dtype_of(trainable),
        "parameter_bytes": params,
        "gradient_bytes": grads,
        "optimizer": optimizer,
        "foreach": foreach,
        "optimizer_state_bytes": state,
        "optimizer_step_bytes": step,
        "total_bytes": params + grads + state,
    }


def _dtype_of(trainable: list[tuple[int, str]]) -> str:
    """The dtype most trainable bytes are in (a pure regime computes in its parameters' dtype)."""
    totals: dict[str, int] = {}
    for nbytes, dtype in trainable:
        totals[dtype] = totals.get(dtype, 0) + nbytes
    return max(totals, key=totals.__getitem__).removeprefix("torch.") if totals else "none"


def with_model_state(
    graph: ActivationGraph,
    model,
    optimizer: str,
    foreach: bool | None = None,
    precision: str = "pure",
) -> ActivationGraph:
    from dataclasses import replace

    state = model_state(model, optimizer, foreach, precision)
    return replace(graph, extra={**graph.extra, "model_state": state})
