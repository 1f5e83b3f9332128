"""The host link's bandwidths and latency, measured on this machine (calibrate_link): timed pinned
copies in each direction, and both at once for a duplex link.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

from ..core.hardware import Hardware, hardware


@dataclass(frozen=True)
class LinkTimings:
    """What calibrate_link times, in seconds: one large copy each way alone, both at once (on
    two streams), and a batch of small and of medium copies each way (per copy)."""

    nbytes: int
    d2h_s: float
    h2d_s: float
    both_s: float  # the large D2H and H2D issued together: until both are done
    small_bytes: int
    medium_bytes: int
    d2h_small_s: float
    d2h_medium_s: float
    h2d_small_s: float
    h2d_medium_s: float


def link_figures(t: LinkTimings) -> dict[str, Any]:
    """The hardware's link figures from measured timings (formulations/step-model.md, "The
    measured link"). Duplex when the two large copies issued together end well before the sum of
    their solo times (the lanes ran at once); then each direction's bandwidth is what it kept
    while the other ran, at least ``nbytes / both_s`` (taken, the conservative figure). A
    half-duplex host (together as long as one after the other) gets its solo bandwidths on one
    link. The fixed cost of a copy (``latency_s``) is the intercept of time = latency + bytes /
    bandwidth through the small and medium batches, the larger of the two directions'."""
    for name in (
        "d2h_s",
        "h2d_s",
        "both_s",
        "d2h_small_s",
        "d2h_medium_s",
        "h2d_small_s",
        "h2d_medium_s",
    ):
        value = getattr(t, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ValueError(
                f"calibrate_link: timing {name} must be a positive number, got {value!r}"
            )
    if not 0 < t.small_bytes < t.medium_bytes:
        raise ValueError("calibrate_link: small_bytes must be positive and below medium_bytes")
    duplex = t.both_s < DUPLEX_OVERLAP * (t.d2h_s + t.h2d_s)
    if duplex:
        d2h_bw = h2d_bw = t.nbytes / t.both_s
    else:
        d2h_bw, h2d_bw = t.nbytes / t.d2h_s, t.nbytes / t.h2d_s

    def fixed_cost(small_s: float, medium_s: float, fallback_bw: float) -> float:
        slope = (medium_s - small_s) / (t.medium_bytes - t.small_bytes)
        if slope <= 0:  # noise: the medium copies no slower than the small ones
            slope = 1.0 / fallback_bw
        return max(0.0, small_s - t.small_bytes * slope)

    latency = max(
        fixed_cost(t.d2h_small_s, t.d2h_medium_s, t.nbytes / t.d2h_s),
        fixed_cost(t.h2d_small_s, t.h2d_medium_s, t.nbytes / t.h2d_s),
    )
    return {
        "d2h_bytes_per_s": d2h_bw,
        "h2d_bytes_per_s": h2d_bw,
        "latency_s": latency,
        "duplex": bool(duplex),
    }


# the two directions together in under this share of their sum: they overlapped (full duplex)
DUPLEX_OVERLAP = 0.8


def calibrate_link(device=None, nbytes: int = 256 * 2**20, repeat: int = 5) -> Hardware:
    """Host<->device bandwidth, the fixed cost of one copy and whether both directions run at
    once, measured with pinned copies on a GPU (``link_figures`` says how).

    On a machine without CUDA it returns the documented "cpu" preset (the host-copy transport of
    the CPU executor) unchanged.

    Args:
        device: the CUDA device (default the current one; "cpu" returns the cpu preset).
        nbytes: bytes per timed copy.
        repeat: copies timed per direction.

    Returns:
        The Hardware with the measured bandwidths and latency.
    """
    import torch

    if not torch.cuda.is_available() or (
        device is not None and torch.device(device).type != "cuda"
    ):
        return hardware("cpu")
    dev = torch.device(device or "cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    gpu2 = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    d2h_stream, h2d_stream = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    small, medium, batch = 64 * 2**10, 4 * 2**20, 64

    def timed(fn, copies: int = 1):
        times = []
        for _ in range(repeat):
            torch.cuda.synchronize(dev)
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize(dev)
            times.append((time.perf_counter() - start) / copies)
        return statistics.median(times)

    def d2h(size=nbytes, copies=1):
        with torch.cuda.stream(d2h_stream):
            for i in range(copies):
                host[i * size % (nbytes - size + 1) :][:size].copy_(gpu[:size], non_blocking=True)

    def h2d(size=nbytes, copies=1):
        with torch.cuda.stream(h2d_stream):
            for i in range(copies):
                gpu2[:size].copy_(host2[i * size % (nbytes - size + 1) :][:size], non_blocking=True)

    def both():
        d2h()
        h2d()

    timings = LinkTimings(
        nbytes=nbytes,
        d2h_s=timed(d2h),
        h2d_s=timed(h2d),
        both_s=timed(both),
        small_bytes=small,
        medium_bytes=medium,
        d2h_small_s=timed(lambda: d2h(small, batch), batch),
        d2h_medium_s=timed(lambda: d2h(medium, batch), batch),
        h2d_small_s=timed(lambda: h2d(small, batch), batch),
        h2d_medium_s=timed(lambda: h2d(medium, batch), batch),
    )
    name = torch.cuda.get_device_name(dev)
    props = torch.cuda.get_device_properties(dev)
    base = (
        hardware("h200-sxm-pcie5")
        if "H200" in name
        else hardware("h100-sxm-pcie5")
        if "H100" in name
        else hardware("a100-80gb-pcie4")
    )
    return base.with_link(
        name=f"measured:{name}",
        memory_bytes=int(props.total_memory),
        **link_figures(timings),
        sources={
            **base.sources,
            "link": "measured by slackswap.calibrate_link: "
            "a large copy each way alone and both at once, and batches "
            "of 64 KiB and 4 MiB copies for the fixed cost per copy",
        },
    )
