"""The executor's host memory: one pool of buffers per graph and device (pinned on CUDA), sized
from the swapped tensors of the plans run on it, reused by every step, by later contexts and by
every plan for the same graph (the training loop's heuristic plan, then its refined one), so
that steady training allocates no host memory."""

from __future__ import annotations

import torch

from ..core.errors import PlanError
from ..core.plan import Plan


class HostPool:
    """Host buffers reused across steps, per swapped tensor name (pinned when the device is
    CUDA): a step takes a buffer and gives it back when its autograd graph is gone, so steady
    training allocates no host memory, and steps alive together (gradient accumulation,
    retain_graph) never share one."""

    def __init__(self, pinned: bool, limit: int = 0):
        self.pinned = pinned
        # host memory the pool may hold (the hardware's host_memory_bytes; 0: no limit)
        self.limit = limit
        self.free: dict[str, list[torch.UntypedStorage]] = {}
        self.total = 0
        self.sized: dict[str, int] = {}  # per name, the largest buffer made for it
        # whole sets of buffers, one per step of hooks alone that swaps the same tensors (by the
        # key of its tensors and sizes): such a step takes and gives back one object, not a
        # buffer per tensor
        self.kits: dict[tuple[tuple[str, int], ...], list[dict[str, torch.UntypedStorage]]] = {}

    def reserve_missing(self, sizes: dict[str, int]) -> None:
        """One slab for the tensors of ``sizes`` that have no buffer of their size yet: a plan
        run before on this graph left the rest. Where the host memory would not hold both, the
        buffers made for earlier plans are let go first (the pool never holds more than its
        limit)."""
        need = sum(sizes.values())
        if self.limit and need > self.limit:
            raise PlanError(
                f"the plan swaps {need} bytes of tensors; the hardware has {self.limit} bytes "
                "of host memory for them (host_memory_bytes): plan with it"
            )
        missing = {n: b for n, b in sizes.items() if self.sized.get(n, -1) < b}
        if self.limit and self.total + sum(missing.values()) > self.limit:
            self.free, self.sized, self.total, self.kits = {}, {}, 0, {}
            missing = dict(sizes)
        self.reserve(missing)

    def held(self, name: str, nbytes: int) -> torch.UntypedStorage | None:
        """A free buffer of at least ``nbytes`` for ``name``, taken from the pool, or None (a
        buffer idle in a kit counts as free: kits are unpacked for it)."""
        if self.kits and not self.free.get(name):
            self.unpack_kits()
        bufs = self.free.get(name)
        if bufs:
            for i, buf in enumerate(bufs):
                if buf.nbytes() >= nbytes:
                    return bufs.pop(i)
        return None

    def get(self, name: str, nbytes: int) -> torch.UntypedStorage:
        """A buffer for ``name``: a free one, else a new one (within the host memory)."""
        found = self.held(name, nbytes)
        if found is not None:
            return found
        if self.limit and self.total + nbytes > self.limit:
            raise PlanError(
                f"host pool: {name!r} needs {nbytes} more bytes beside the {self.total} it holds; "
                f"the hardware has {self.limit} bytes of host memory (host_memory_bytes)"
            )
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        self.total += nbytes
        self.sized[name] = max(self.sized.get(name, 0), nbytes)
        return t.untyped_storage()

    def take_all(self, sizes: dict[str, int]) -> dict[str, torch.UntypedStorage]:
        """A buffer for each tensor of ``sizes`` at once (a step that knows what it swaps
        borrows them when it starts): those the pool holds no buffer of the size for are left
        out, for ``get`` to make when the step needs them."""
        out: dict[str, torch.UntypedStorage] = {}
        for name, nbytes in sizes.items():
            found = self.held(name, nbytes)
            if found is not None:
                out[name] = found
        return out

    def take_kit(
        self, key: tuple[tuple[str, int], ...], sizes: dict[str, int]
    ) -> dict[str, torch.UntypedStorage]:
        """The buffers of a step that swaps ``sizes`` (``key``: its items), taken at once: a kit
        a step of the same tensors gave back whole, else ``take_all`` (after the kits of other
        steps go back to the free buffers, so that no buffer idles in a kit another plan's
        tensors would need)."""
        kits = self.kits.get(key)
        if kits:
            return kits.pop()
        self.unpack_kits()
        return self.take_all(sizes)

    def unpack_kits(self) -> None:
        """Every kit's buffers back among the free ones (another step needs them one by one)."""
        for left in self.kits.values():
            for kit in left:
                self.give_back(list(kit.items()))
        self.kits = {}

    def give_back_kit(
        self,
        key: tuple[tuple[str, int], ...],
        kit: dict[str, torch.UntypedStorage],
        taken: list[tuple[str, torch.UntypedStorage]],
    ) -> None:
        """A kit back, with the buffers its step took one by one (``taken``): whole when it
        holds a buffer of the size for every tensor of ``key``, else buffer by buffer."""
        for name, buf in taken:
            if name not in kit:
                kit[name] = buf
            else:
                self.free.setdefault(name, []).append(buf)
        taken.clear()
        if len(kit) == len(key) and all(kit[n].nbytes() >= b for n, b in key):
            self.kits.setdefault(key, []).append(kit)
        else:
            self.give_back(list(kit.items()))

    def reserve(self, sizes: dict[str, int]) -> None:
        """One host slab for a whole step's offloads, carved per tensor (sized from the plan)."""
        total = sum(sizes.values())
        if total <= 0:
            return
        slab = torch.empty(total, dtype=torch.uint8, pin_memory=self.pinned).untyped_storage()
        self.total += total
        offset = 0
        for name, nbytes in sizes.items():
            self.free.setdefault(name, []).append(slab[offset : offset + nbytes])
            self.sized[name] = max(self.sized.get(name, 0), nbytes)
            offset += nbytes

    def give_back(self, taken: list[tuple[str, torch.UntypedStorage]]) -> None:
        for name, buf in taken:
            self.free.setdefault(name, []).append(buf)
        taken.clear()

    @property
    def nbytes(self) -> int:
        return self.total


POOLS: dict[tuple, HostPool] = {}
POOLS_KEPT = 2  # host pools kept for later contexts, most recently used graphs first


def host_pool(plan: Plan, device, pinned: bool) -> HostPool:
    """The host pool for ``plan``'s graph on ``device``: the one an earlier context used, for
    this plan or another of the same graph, if any (pinned allocation costs about a second per
    few GB, far more than a training step)."""
    limit = plan.hardware.host_memory_bytes if plan.hardware is not None else 0
    key = (plan.graph_digest, str(device), pinned, limit)
    pool = POOLS.pop(key, None) or HostPool(pinned=pinned, limit=limit)
    POOLS[key] = pool
    while len(POOLS) > POOLS_KEPT:
        POOLS.pop(next(iter(POOLS)))
    return pool
