"""Op times without running the op: a roofline per aten call (formulations/cost-model.md).

A fake profile (``profile(fake=True)``) has no kernel to time, so each aten op it traces, forward
or backward, is charged

    time = max(FLOPs / (peak_flops x efficiency), bytes / (hbm_bytes_per_s x memory_efficiency))
           + launch_s

FLOPs come from torch's own ``FlopCounterMode`` formulas (``torch.utils.flop_counter``), plus the
fused attention kernels it has no entry for; the efficiency is the hardware's GEMM efficiency for
matrix products and convolutions, its attention efficiency for fused attention. The peak is the
rate of the op's dtype (``Hardware.flops_for``): 16-bit at ``peak_flops``, float32 at the fp32
rate, or the TF32 rate where torch enables TF32 for that kind of op (convolutions by default,
matrix products with ``torch.set_float32_matmul_precision("high")``). Bytes are the
tensors the op reads and writes (views and metadata ops move nothing and launch nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.hardware import Hardware
from .trace import collect_tensors

# a CUDA kernel launch from eager PyTorch: a few microseconds of host and driver work per kernel
# (NVIDIA's CUDA C++ Best Practices Guide puts launch overhead in the microseconds); an
# assumption of the model, stated in formulations/cost-model.md, not a measurement
LAUNCH_S = 5e-6

# fused attention kernels: forward 4*b*h*s_q*s_k*d FLOPs (two matrix products); backward 2.5x the
# forward (FlashAttention-2; shared/reference.md), the ratio torch's own formulas use
ATTENTION_FORWARD = {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
}
ATTENTION_BACKWARD = {
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_fused_attention_overrideable_backward",
}
ATTENTION_IN_REGISTRY = {
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_backward",
    "_efficient_attention_backward",
}
BACKWARD_OVER_FORWARD = 2.5

# ops that make no kernel: views, aliases and metadata
NO_KERNEL = {
    "view",
    "_unsafe_view",
    "reshape",
    "t",
    "transpose",
    "permute",
    "expand",
    "unsqueeze",
    "squeeze",
    "detach",
    "alias",
    "as_strided",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "unbind",
    "chunk",
    "narrow",
    "view_as",
    "expand_as",
    "unflatten",
    "flatten",
    "_reshape_alias",
    "lift_fresh",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "dim",
    "is_same_size",
    "_to_copy_noop",
    "_has_compatible_shallow_copy_type",
    "numel",
    "_local_scalar_dense",
    "diagonal",
    "real",
    "view_as_real",
    "view_as_complex",
}


@dataclass(frozen=True)
class OpCost:
    flops: float
    bytes: int
    time_s: float
    kind: str  # "gemm", "attention", "memory" or "none"


def attention_flops(query: torch.Tensor, key: torch.Tensor) -> float:
    """4*b*h*s_q*s_k*d: Q K^T and P V, each 2*b*h*s_q*s_k*d (causal masking not discounted, as
    torch's own formulas count it)."""
    *batch, s_q, d = query.shape
    s_k = key.shape[-2]
    heads = 1
    for n in batch:
        heads *= int(n)
    return 4.0 * heads * int(s_q) * int(s_k) * int(d)


def operand_dtype(tensors) -> str:
    """The dtype an op computes in: its first floating-point input's."""
    for t in tensors:
        if t.is_floating_point():
            return str(t.dtype)
    return "none"


def tf32_enabled(convolution: bool) -> bool:
    """Whether torch runs float32 products of this kind as TF32 now (cuDNN convolutions: on by
    default; matrix products: off unless the float32 matmul precision is lowered)."""
    backend = (
        getattr(torch.backends.cudnn, "conv", None) if convolution else torch.backends.cuda.matmul
    )
    precision = getattr(backend, "fp32_precision", "none")
    if precision != "none":
        return precision == "tf32"
    if convolution:
        return bool(torch.backends.cudnn.allow_tf32)
    return torch.get_float32_matmul_precision() != "highest"


def tensor_bytes(tensors) -> int:
    return sum(int(t.numel()) * t.element_size() for t in tensors)


@dataclass(frozen=True)
class CostModel:
    """Roofline times for ``hardware`` (its peak, bandwidth and efficiencies) plus ``launch_s``
    per kernel."""

    hardware: Hardware
    launch_s: float = LAUNCH_S

    def describe(self) -> dict:
        hw = self.hardware
        return {
            "model": "roofline",
            "hardware": hw.name,
            "peak_flops": hw.peak_flops,
            "fp32_flops": hw.flops_for("float32"),
            "tf32_flops": hw.flops_for("float32", tf32=True),
            "hbm_bytes_per_s": hw.hbm_bytes_per_s,
            "gemm_efficiency": hw.gemm_efficiency,
            "attention_efficiency": hw.attention_efficiency,
            "memory_efficiency": hw.memory_efficiency,
            "launch_s": self.launch_s,
            "flops": "torch.utils.flop_counter formulas; fused attention 4bhs_qs_kd forward, "
            f"{BACKWARD_OVER_FORWARD}x backward",
        }

    def cost(self, func, args, kwargs, out) -> OpCost:
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        if name in NO_KERNEL or getattr(func, "namespace", "aten") != "aten":
            return OpCost(0.0, 0, 0.0, "none")
        ins = collect_tensors(list(args) + list((kwargs or {}).values()), [])
        outs = collect_tensors(out if isinstance(out, (list, tuple)) else [out], [])
        moved = tensor_bytes(ins) + tensor_bytes(outs)
        flops, kind = self.flops(func, name, args, kwargs, out)
        hw = self.hardware
        if kind == "gemm":
            efficiency = hw.gemm_efficiency
        elif kind == "attention":
            efficiency = hw.attention_efficiency
        else:
            efficiency = 1.0
        peak = hw.flops_for(operand_dtype(ins), tf32_enabled("convolution" in name))
        compute = flops / (peak * efficiency) if flops else 0.0
        memory = moved / (hw.hbm_bytes_per_s * hw.memory_efficiency)
        return OpCost(
            flops, moved, max(compute, memory) + self.launch_s, kind if flops else "memory"
        )

    @staticmethod
    def flops(func, name: str, args, kwargs, out) -> tuple[float, str]:
        from torch.utils.flop_counter import flop_registry

        if name in ATTENTION_FORWARD:
            return attention_flops(args[0], args[1]), "attention"
        if name in ATTENTION_BACKWARD:  # (grad_out, query, key, ...)
            return BACKWARD_OVER_FORWARD * attention_flops(args[1], args[2]), "attention"
        formula = flop_registry.get(func.overloadpacket)
        if formula is None:
            return 0.0, "memory"
        flops = float(formula(*args, **(kwargs or {}), out_val=out))
        return flops, "attention" if name in ATTENTION_IN_REGISTRY else "gemm"

    def __call__(self, func, args, kwargs, out) -> float:
        return self.cost(func, args, kwargs, out).time_s
