"""Hardware presets: copy-lane figures for the planner and compute figures for analytic workloads.

Every figure names its source in ``sources``; nothing here is fitted to a result.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Hardware:
    """A device and its host link.

    ``d2h_bytes_per_s``/``h2d_bytes_per_s`` are sustained pinned-copy bandwidths, ``latency_s`` the
    fixed cost of one transfer, ``duplex`` whether both directions run at once. The compute figures
    (``peak_flops``, ``hbm_bytes_per_s`` and the efficiencies) feed the roofline op times of
    :func:`slackswap.transformer_graph` and of fake profiles. ``peak_flops`` is the 16-bit
    (bf16/fp16) tensor-core rate; ``fp32_flops`` and ``tf32_flops`` the rates of float32 products
    without and with TF32 (0: the same as ``peak_flops``, for devices with one rate).
    ``memory_bytes`` is what torch can allocate on the device (its reported total capacity less
    the CUDA context), not the datasheet's figure.
    """

    name: str
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    latency_s: float
    duplex: bool
    peak_flops: float
    hbm_bytes_per_s: float
    gemm_efficiency: float = 0.70
    attention_efficiency: float = 0.55
    memory_efficiency: float = 0.80
    memory_bytes: int = 0
    # whether the graph's collectives (FSDP all-gathers, reduce-scatters) cross the same host
    # link as the activation copies: true on PCIe nodes without NVLink, false with NVLink
    collectives_on_link: bool = False
    # whether the device's memory is the host's (a CPU device): a swap would copy a tensor within
    # the same memory on the compute thread, freeing nothing, so plans there keep or recompute
    host_is_device: bool = False
    # tensors smaller than this are never swapped: a copy's fixed cost (launch, host work, an
    # event) buys next to no memory (formulations/step-model.md, "Minimal plans")
    min_swap_bytes: int = 0
    fp32_flops: float = 0.0
    tf32_flops: float = 0.0
    # host memory a rank may hold swapped tensors in (pinned; 0: no limit). The executor's
    # pool holds one buffer per swapped tensor for the step, so a plan needs the sum of its
    # swapped tensors' bytes (formulations/step-model.md, "Host memory")
    host_memory_bytes: int = 0
    sources: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"hardware: name must be a non-empty string, got {self.name!r}")
        for name in (
            "d2h_bytes_per_s",
            "h2d_bytes_per_s",
            "latency_s",
            "peak_flops",
            "hbm_bytes_per_s",
            "gemm_efficiency",
            "attention_efficiency",
            "memory_efficiency",
            "fp32_flops",
            "tf32_flops",
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not math.isfinite(value)
            ):
                raise ValueError(
                    f"hardware {self.name!r}: {name} must be a finite number, got {value!r}"
                )
            object.__setattr__(self, name, float(value))
        for name in ("d2h_bytes_per_s", "h2d_bytes_per_s", "peak_flops", "hbm_bytes_per_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"hardware {self.name!r}: {name} must be > 0, got {value!r}")
        for name in ("fp32_flops", "tf32_flops"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"hardware {self.name!r}: {name} must be >= 0 (0: peak_flops), got "
                    f"{getattr(self, name)!r}"
                )
        if self.latency_s < 0:
            raise ValueError(
                f"hardware {self.name!r}: latency_s must be >= 0, got {self.latency_s!r}"
            )
        for name in ("gemm_efficiency", "attention_efficiency", "memory_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"hardware {self.name!r}: {name} must be in (0, 1], got {value!r}")
        for name in ("duplex", "collectives_on_link", "host_is_device"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"hardware {self.name!r}: {name} must be true or false, got "
                    f"{getattr(self, name)!r}"
                )
        for name in ("memory_bytes", "min_swap_bytes", "host_memory_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(
                    f"hardware {self.name!r}: {name} must be a non-negative integer, got {value!r}"
                )
            object.__setattr__(self, name, int(value))

    def d2h_time(self, nbytes: float) -> float:
        """Seconds one device-to-host transfer of ``nbytes`` occupies its lane."""
        return self.latency_s + nbytes / self.d2h_bytes_per_s

    def h2d_time(self, nbytes: float) -> float:
        """Seconds one host-to-device transfer of ``nbytes`` occupies its lane."""
        return self.latency_s + nbytes / self.h2d_bytes_per_s

    def flops_for(self, dtype: str, tf32: bool = False) -> float:
        """The peak rate of a matrix product in ``dtype`` ("torch.float32", "float32", ...):
        float32 at the fp32 rate, or the TF32 rate where torch enables TF32 (``tf32``); 16-bit
        and anything else at ``peak_flops``."""
        if dtype.removeprefix("torch.") in ("float32", "float"):
            rate = self.tf32_flops if tf32 else self.fp32_flops
            return rate or self.peak_flops
        return self.peak_flops

    def with_link(self, **changes: Any) -> Hardware:
        """A copy with some figures changed (for sensitivity studies)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Hardware:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        missing = [
            k
            for k in (
                "name",
                "d2h_bytes_per_s",
                "h2d_bytes_per_s",
                "latency_s",
                "duplex",
                "peak_flops",
                "hbm_bytes_per_s",
            )
            if k not in known
        ]
        if missing:
            raise ValueError(f"hardware: missing field(s) {', '.join(missing)}")
        if not isinstance(known.get("sources", {}), dict):
            raise ValueError("hardware: sources must be an object")
        return cls(**known)


_MIN_SWAP_SOURCE = (
    "1024 bytes: torchtune's OffloadActivations offloads only tensors of at least "
    "min_offload_size = 1024 bytes (its default)"
)
GIB = 2**30
MIB = 2**20
# the CUDA context torch creates on first use (driver, kernels loaded lazily since CUDA 11.7):
# about 400 MB (pytorch/pytorch#109888, #107667), not available to the caching allocator
CUDA_CONTEXT_BYTES = 400 * MIB
_CONTEXT_SOURCE = "CUDA context: about 400 MB with lazy module loading (pytorch/pytorch#109888)"
# host memory per GPU: a node's RAM shared by its 8 GPUs' ranks
_HOST_A100 = "NVIDIA DGX A100 datasheet: 1 TB system memory for 8 GPUs, 128 GB a rank"
_HOST_H100 = "NVIDIA DGX H100/H200 datasheets: 2 TB system memory for 8 GPUs, 256 GB a rank"


def _allocatable(total_capacity_gib: float) -> int:
    """What torch can allocate: its reported total capacity less the CUDA context."""
    return round(total_capacity_gib * GIB) - CUDA_CONTEXT_BYTES


_A100_SOURCES = {
    "peak_flops": "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense",
    "fp32_flops": "NVIDIA A100 datasheet: 19.5 TFLOP/s FP32",
    "tf32_flops": "NVIDIA A100 datasheet: 156 TFLOP/s TF32 dense",
    "gemm_efficiency": "about 0.70 of peak for large GEMMs (MosaicML llm-foundry A100 MFU table)",
    "attention_efficiency": "FlashAttention-2 paper: forward about 0.55 of peak",
    "memory_efficiency": "about 0.8 of HBM bandwidth, common roofline practice",
    "d2h_bytes_per_s": "nvbandwidth issues #11, #53: 24-26 GB/s pinned, one direction; lower end taken",
    "latency_s": "about 10 us per transfer (assumption, not a measurement)",
    "duplex": "D2H and H2D run at once (separate copy engines); a step rarely overlaps them",
    "min_swap_bytes": _MIN_SWAP_SOURCE,
}

_PRESETS: dict[str, Hardware] = {
    "a100-80gb-pcie4": Hardware(
        name="a100-80gb-pcie4",
        d2h_bytes_per_s=24e9,
        h2d_bytes_per_s=24e9,
        latency_s=10e-6,
        duplex=True,
        peak_flops=312e12,
        hbm_bytes_per_s=2.039e12,
        memory_bytes=_allocatable(79.14),
        min_swap_bytes=1024,
        fp32_flops=19.5e12,
        tf32_flops=156e12,
        host_memory_bytes=128 * 10**9,
        sources={
            **_A100_SOURCES,
            "host_memory_bytes": _HOST_A100,
            "hbm_bytes_per_s": "A100 80GB datasheet: 2.039 TB/s",
            "memory_bytes": "torch reports 79.14-79.25 GiB total capacity on A100 80GB (its OOM "
            "messages, e.g. 79.15 GiB); the lowest taken, less the " + _CONTEXT_SOURCE,
        },
    ),
    "a100-40gb-pcie4": Hardware(
        name="a100-40gb-pcie4",
        d2h_bytes_per_s=24e9,
        h2d_bytes_per_s=24e9,
        latency_s=10e-6,
        duplex=True,
        peak_flops=312e12,
        hbm_bytes_per_s=1.555e12,
        memory_bytes=_allocatable(39.39),
        min_swap_bytes=1024,
        fp32_flops=19.5e12,
        tf32_flops=156e12,
        host_memory_bytes=128 * 10**9,
        sources={
            **_A100_SOURCES,
            "host_memory_bytes": _HOST_A100,
            "hbm_bytes_per_s": "A100 40GB datasheet: 1.555 TB/s",
            "memory_bytes": "torch reports 39.39 GiB total capacity on A100 40GB (its OOM "
            "messages), less the " + _CONTEXT_SOURCE,
        },
    ),
    "h100-sxm-pcie5": Hardware(
        name="h100-sxm-pcie5",
        d2h_bytes_per_s=50e9,
        h2d_bytes_per_s=50e9,
        latency_s=10e-6,
        duplex=True,
        peak_flops=989e12,
        hbm_bytes_per_s=3.35e12,
        memory_bytes=_allocatable(79.14),
        min_swap_bytes=1024,
        fp32_flops=67e12,
        tf32_flops=494.7e12,
        host_memory_bytes=256 * 10**9,
        sources={
            "host_memory_bytes": _HOST_H100,
            "peak_flops": "NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16 dense",
            "fp32_flops": "NVIDIA H100 SXM datasheet: 67 TFLOP/s FP32",
            "tf32_flops": "NVIDIA H100 SXM datasheet: 989 TFLOP/s TF32 with sparsity, 494.7 dense",
            "memory_bytes": "torch reports 79.14-79.19 GiB total capacity on 80 GB H100s (its "
            "OOM messages); the lowest taken, less the " + _CONTEXT_SOURCE,
            "hbm_bytes_per_s": "NVIDIA H100 SXM datasheet: 3.35 TB/s",
            "d2h_bytes_per_s": "PCIe 5.0 x16: 63 GB/s per direction theoretical; 0.8 of it taken, "
            "the ratio measured on PCIe 4.0 (25.1 of 31.5 GB/s)",
            "latency_s": "about 10 us per transfer (assumption)",
            "min_swap_bytes": _MIN_SWAP_SOURCE,
        },
    ),
    "h200-sxm-pcie5": Hardware(
        name="h200-sxm-pcie5",
        d2h_bytes_per_s=50e9,
        h2d_bytes_per_s=50e9,
        latency_s=10e-6,
        duplex=True,
        peak_flops=989e12,
        hbm_bytes_per_s=4.8e12,
        memory_bytes=_allocatable(139.72),
        min_swap_bytes=1024,
        fp32_flops=67e12,
        tf32_flops=494.7e12,
        host_memory_bytes=256 * 10**9,
        sources={
            "host_memory_bytes": _HOST_H100,
            "peak_flops": "NVIDIA H200 datasheet: 989 TFLOP/s bf16 dense (same die as H100)",
            "fp32_flops": "NVIDIA H200 datasheet: 67 TFLOP/s FP32",
            "tf32_flops": "NVIDIA H200 datasheet: 989 TFLOP/s TF32 with sparsity, 494.7 dense",
            "memory_bytes": "torch reports 139.72-139.81 GiB total capacity on H200 (its OOM "
            "messages, e.g. 139.80 GiB); the lowest taken, less the " + _CONTEXT_SOURCE,
            "hbm_bytes_per_s": "NVIDIA H200 datasheet: 4.8 TB/s HBM3e",
            "d2h_bytes_per_s": "PCIe 5.0 x16: 63 GB/s theoretical; 0.8 of it taken as for H100",
            "latency_s": "about 10 us per transfer (assumption)",
            "min_swap_bytes": _MIN_SWAP_SOURCE,
        },
    ),
    "cpu": Hardware(
        name="cpu",
        d2h_bytes_per_s=10e9,
        h2d_bytes_per_s=10e9,
        latency_s=2e-6,
        duplex=True,
        peak_flops=1e11,
        hbm_bytes_per_s=20e9,
        host_is_device=True,
        sources={
            "note": "a CPU device: its memory is the host's, so plans keep or recompute "
            "(a swap frees nothing); the link figures are a memcpy-class figure"
        },
    ),
}
# a CPU standing in for a device with a host link: the cpu preset's figures, swaps allowed
_PRESETS["cpu-emulated-link"] = replace(
    _PRESETS["cpu"],
    name="cpu-emulated-link",
    host_is_device=False,
    sources={
        "note": "a CPU standing in for a device with a host link: swaps are host memcpys "
        "that free no real memory; for exercising the swap path of the executor on "
        "machines without a GPU, not for saving memory"
    },
)


def hardware(name: str | Hardware) -> Hardware:
    """The preset called ``name`` (see :func:`hardware_names`), or ``name`` itself if a Hardware.

    Args:
        name: a preset's name (hardware_names()) or a Hardware, returned as it is.

    Returns:
        The Hardware.

    Raises:
        ValueError: an unknown preset name, with the known ones.
    """
    if isinstance(name, Hardware):
        return name
    try:
        return _PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown hardware {name!r}; presets: {', '.join(sorted(_PRESETS))}"
        ) from None


def hardware_names() -> list[str]:
    """The hardware presets, by name.

    Returns:
        The names of the hardware presets.
    """
    return sorted(_PRESETS)
