"""The host side of a step's swaps: which saved tensors have a host copy, the copy lanes' events
for each, the prefetches in flight, and the pinned buffers the step borrowed from the pool.

A step owns one ``HostCopies``; it calls these methods with its position and its log, so the
order of offloads, prefetches and waits it records is the order they were issued in.
"""

from __future__ import annotations

import weakref
from time import perf_counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .positions import RunLog
    from .step import StepContext


class HostCopies:
    """Host copies of one step's swapped tensors (module docstring)."""

    def __init__(self, ctx: StepContext):
        self.ctx = ctx
        self.pool, self.lanes, self.stats = ctx.pool, ctx.lanes, ctx.stats
        self.copies: dict[str, tuple[torch.UntypedStorage, int, Any]] = {}
        self.in_flight: dict[str, Any] = {}  # prefetches issued and not yet waited for
        self.order: list[str] = []  # offload order (prefetch_ahead without positions)
        self.borrowed: list[tuple[str, torch.UntypedStorage]] = []
        self.ready: dict[str, torch.UntypedStorage] = {}  # borrowed ahead (borrow_ahead)
        self.returning = False  # a finalizer gives the borrowed buffers back

    def __contains__(self, name: str) -> bool:
        return name in self.copies

    def borrow_ahead(self, key: tuple[tuple[str, int], ...], sizes: dict[str, int]) -> None:
        """Borrow the buffers of the tensors this step will offload now, at its start (a step
        of hooks alone knows them, ``key`` being their items): each offload then takes its own
        without asking the pool. They go back as one kit, with any taken one by one, when the
        step is gone (``HostPool.take_kit``)."""
        if self.borrowed:
            raise RuntimeError("HostCopies.borrow_ahead: the step has borrowed buffers already")
        kit = self.pool.take_kit(key, sizes)
        self.ready = dict(kit)
        self.returning = True
        weakref.finalize(self, self.pool.give_back_kit, key, kit, self.borrowed)

    def offload(self, name: str, t: torch.Tensor, position: int, log: RunLog) -> None:
        """Copy ``t``'s storage to a pinned host buffer on the D2H lane."""
        src = t.untyped_storage()
        nbytes = src.nbytes()
        pool, stats = self.pool, self.stats
        buf = self.ready.pop(name, None)
        if buf is None or buf.nbytes() < nbytes:
            buf = pool.get(name, nbytes)
            if not self.returning:
                self.returning = True
                weakref.finalize(self, pool.give_back, self.borrowed)
            self.borrowed.append((name, buf))
        self.order.append(name)
        start = perf_counter()
        self.copies[name] = (buf, nbytes, self.lanes.offload(src, buf, nbytes))
        stats.copy_s += perf_counter() - start
        log.events.append(("offload", name, position))
        stats.swapped_out_bytes += nbytes

    def release_source(self, name: str) -> None:
        """The device storage offloaded for ``name`` may go back once its copy is done."""
        self.lanes.release(self.copies[name][2])

    def prefetch(self, name: str, position: int, log: RunLog) -> torch.UntypedStorage:
        """Issue ``name``'s prefetch on the H2D lane (its first use waits for it)."""
        buf, nbytes, offloaded = self.copies[name]
        start = perf_counter()
        dev, arrived = self.lanes.prefetch(buf, nbytes, offloaded)
        spent = perf_counter() - start
        self.in_flight[name] = arrived
        log.events.append(("prefetch", name, position))
        stats = self.stats
        stats.wait_s += spent
        stats.copy_s += spent
        stats.swapped_in_bytes += nbytes
        return dev

    def wait(self, name: str, position: int, log: RunLog) -> None:
        """A prefetched tensor is read: compute waits for its copy here, and only here."""
        if name in self.in_flight:  # (a CPU lane's copy has no event: None)
            self.lanes.wait(self.in_flight.pop(name))
            log.events.append(("wait", name, position))

    def pending(self, name: str) -> bool:
        return name in self.in_flight

    def ahead_of(self, name: str, ahead: int) -> list[str]:
        """Without positions: the ``ahead`` tensors offloaded before ``name`` (or the last
        ``ahead`` when ``name`` was not swapped), nearest first."""
        order = self.order
        if not order or ahead <= 0:
            return []
        if name in order:
            i = order.index(name)
            return order[max(0, i - ahead) : i][::-1]
        return order[-ahead:][::-1]
