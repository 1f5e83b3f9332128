"""Measure a training step's memory the way the device's allocator sees it.

On CUDA: the caching allocator's statistics (``torch.cuda.memory_allocated`` and its peak). On
CPU: the C heap in use (glibc's ``mallinfo2``: bytes in used chunks plus mmapped blocks, where
large tensors live), sampled after every op by a dispatch mode (``sample="ops"``); or after every
node of a graph compiled with ``metered_aot_eager`` (``sample="calls"``: torch.compile skips its
graphs, and runs the model eagerly, while a dispatch mode is active, so "ops" would measure the
eager model); or by a thread every 50 us (``sample="thread"``), which can miss a peak shorter
than that but also sees memory a kernel holds inside one op (oneDNN's convolution backward: 0.67
MiB on a 64-channel ResNet block at batch 8, 16 x 16, which no op boundary shows and no graph
counts; docs/known-limits.md). Figures are bytes above what was
allocated when the meter started (parameters, gradients and optimizer state from before the step
are not counted; gradients made in the step are). Every object from before the meter is frozen
for the collector and the collector held off until it stops, so no unrelated garbage is freed
inside the window.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
import time
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_LIBC = None


def _heap_in_use() -> int:
    """Bytes the C heap holds for the process (in-use chunks and mmapped blocks)."""
    global _LIBC
    if _LIBC is None:
        path = ctypes.util.find_library("c")
        lib = ctypes.CDLL(path) if path else None
        if lib is None or not hasattr(lib, "mallinfo2"):
            raise RuntimeError(
                "measuring CPU memory needs glibc's mallinfo2 (Linux, glibc >= "
                "2.33); measure on CUDA instead"
            )
        lib.mallinfo2.restype = _MallInfo2
        _LIBC = lib
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class _Sampler(TorchDispatchMode):
    def __init__(self, meter: StepMeter):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.meter.take_sample()
        return out


SAMPLES = ("ops", "calls", "thread")
_OPEN: list[StepMeter] = []  # meters sampled by metered_aot_eager's graphs


def metered_aot_eager(gm, example_inputs):
    """A ``torch.compile`` backend: ``aot_eager`` (the same forward and backward graphs, the
    same partition), whose graphs run node by node through ``torch.fx.Interpreter`` (each value
    freed after its last use, as the generated code frees it), sampling every open
    ``StepMeter(sample="calls")`` after each node. Ops outside the compiled graphs (an eager
    loss) are sampled at ``mark`` and at the meter's end only."""
    from torch._dynamo.backends.debugging import aot_eager
    from torch.fx import Interpreter

    class Metered(Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            for meter in _OPEN:
                meter.take_sample()
            return out

    def compiler(graph_module, _inputs):
        def run(args):
            return Metered(graph_module).boxed_run(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return aot_eager(gm, example_inputs, fw_compiler=compiler, bw_compiler=compiler)


@dataclass
class StepMeter:
    """``with StepMeter(device) as m:`` forward; ``m.mark("backward")``; backward. Then
    ``m.peak_bytes`` and ``m.marks["backward"]`` (bytes above the start)."""

    device: torch.device | str = "cpu"
    sample: str = "ops"  # on CPU: after every op ("ops"), compiled node ("calls"), or a thread
    peak_bytes: int = 0
    marks: dict = field(default_factory=dict)
    _base: int = 0
    _collecting: bool = False
    _froze: bool = False

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.cuda = self.device.type == "cuda"
        if self.sample not in SAMPLES:
            raise ValueError(f"StepMeter: sample must be one of {SAMPLES}, got {self.sample!r}")

    def _now(self) -> int:
        if self.cuda:
            return int(torch.cuda.memory_allocated(self.device))
        return _heap_in_use()

    def take_sample(self) -> None:
        """Memory now, against the peak so far (the samplers call it after every op)."""
        self.peak_bytes = max(self.peak_bytes, self._now() - self._base)

    def mark(self, label: str) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.marks[label] = self._now() - self._base
        self.take_sample()

    def __enter__(self) -> StepMeter:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._base = self._now()
        self.peak_bytes = 0
        self._mode = self._thread = None
        if not self.cuda and self.sample == "ops":
            self._mode = _Sampler(self)
            self._mode.__enter__()
        elif not self.cuda and self.sample == "calls":
            _OPEN.append(self)
        elif not self.cuda:
            self._stop = threading.Event()

            def sample() -> None:
                while not self._stop.is_set():
                    self.take_sample()
                    time.sleep(50e-6)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        # earlier work's reference cycles, freed by the cyclic collector inside the window,
        # would lower the figure by their size at a point no step decides (1.7 MB of a 13 MB
        # TinyGPT step after other tests): every object from before is frozen (the collector
        # does not look at it, even when something inside the window calls gc.collect()) and
        # the collector held off, as the profiler holds it off (what a cycle keeps lives to the
        # end of the step). A full collection instead costs a quarter of a second in a process
        # that holds many objects, on every meter.
        self._froze = gc.get_freeze_count() == 0  # (someone else's freeze is left alone)
        if self._froze:
            gc.freeze()
        self._collecting = gc.isenabled()  # held off last: a failed start leaves it as it was
        gc.disable()
        return self

    def __exit__(self, *exc) -> None:
        if self._froze:
            gc.unfreeze()
        if self._collecting:
            gc.enable()
        if self._mode is not None:
            self._mode.__exit__(*exc)
        if self in _OPEN:
            _OPEN.remove(self)
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(
                self.peak_bytes, int(torch.cuda.max_memory_allocated(self.device)) - self._base
            )
        else:
            self.take_sample()
