"""The executor's copy lanes: where a swapped tensor's bytes travel (formulations/step-model.md,
"Copy lanes"). One small interface, chosen once per context, as torchtune's OffloadActivations
chooses its stream or no-stream path at construction:

- ``CpuLanes``: copies on the calling thread, done when issued (the CPU executor, and the
  ``cpu-emulated-link`` preset's stand-in for a host link);
- ``CudaLanes``: a D2H and an H2D stream per device, made once and shared by every context; an
  event per copy. Compute waits on an offload's event only where the plan frees the tensor
  (``d2h_free``), and on a prefetch's event only at the tensor's first use: the step model's two
  lanes and its waits, with no ``record_stream`` and no wait at issue.
"""

from __future__ import annotations

from typing import Any

import torch


class CpuLanes:
    """Host copies on the compute thread: nothing to wait for afterwards."""

    cuda = False

    def offload(self, src: torch.UntypedStorage, buf: torch.UntypedStorage, nbytes: int) -> Any:
        (buf if buf.nbytes() == nbytes else buf[:nbytes]).copy_(src)
        return None

    def release(self, offloaded: Any) -> None:
        """Before the device memory goes back: the copy is done."""

    def prefetch(
        self, buf: torch.UntypedStorage, nbytes: int, offloaded: Any
    ) -> tuple[torch.UntypedStorage, Any]:
        dev = torch.UntypedStorage(nbytes)
        dev.copy_(buf if buf.nbytes() == nbytes else buf[:nbytes])
        return dev, None

    def wait(self, arrived: Any) -> None:
        """Before the first use of a prefetched tensor: it is there."""


# per device index: (D2H stream, H2D stream), made once for the process
_STREAMS: dict[int, tuple[Any, Any]] = {}


class CudaLanes:
    """Two copy streams per device and an event per copy (the pattern of torchtune's
    OffloadActivations and Transformer Engine's cpu_offload)."""

    cuda = True

    def __init__(self, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        if index not in _STREAMS:
            _STREAMS[index] = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        self.d2h, self.h2d = _STREAMS[index]

    def offload(self, src: torch.UntypedStorage, buf: torch.UntypedStorage, nbytes: int) -> Any:
        compute = torch.cuda.current_stream(self.device)
        self.d2h.wait_stream(compute)  # the tensor is made by work queued on compute
        with torch.cuda.stream(self.d2h):
            buf[:nbytes].copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.d2h)
        return done

    def release(self, offloaded: Any) -> None:
        # compute waits for the offload before the memory goes back to the allocator: the
        # caching allocator hands a freed block to the compute stream's next allocation at once
        torch.cuda.current_stream(self.device).wait_event(offloaded)

    def prefetch(
        self, buf: torch.UntypedStorage, nbytes: int, offloaded: Any
    ) -> tuple[torch.UntypedStorage, Any]:
        compute = torch.cuda.current_stream(self.device)
        # the landing buffer is the compute stream's (freed there after its last use, so the
        # allocator reuses it for compute without another cudaMalloc)
        landing = torch.empty(nbytes, dtype=torch.uint8, device=self.device).untyped_storage()
        # the block may have been freed by compute work still queued, and the host buffer is
        # written by the offload: the copy starts after both
        self.h2d.wait_stream(compute)
        if offloaded is not None:
            self.h2d.wait_event(offloaded)
        with torch.cuda.stream(self.h2d):
            landing.copy_(buf[:nbytes], non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record(self.h2d)
        return landing, arrived

    def wait(self, arrived: Any) -> None:
        if arrived is not None:
            torch.cuda.current_stream(self.device).wait_event(arrived)


def lanes_for(device: torch.device) -> CpuLanes | CudaLanes:
    """The lanes of ``device``, chosen once per context."""
    return CudaLanes(device) if device.type == "cuda" else CpuLanes()
