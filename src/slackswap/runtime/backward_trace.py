"""The backward pass, traced: each autograd node timed, the activation gradients alive during it
(GradientLedger) and the temporaries its formula holds above them (BackwardTransients).
"""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .trace import GpuClock, LiveStorages, StepTrace, collect_tensors, local_tensor, storage_key


class GradientLedger:
    """The activation gradients alive in backward, from the nodes' hooks: a node's outgoing
    gradients wait in the buffers of the nodes they are sent to until those run (the ledger
    holds them until then, as the buffers do, so no storage address is reused while it counts
    it); a node's incoming gradients replace what waited for it. Gradients sent to parameters
    (AccumulateGrad) are left out: parameter gradients are not activation memory. Storages are
    counted once (a node that passes its incoming gradient on, as an add does, holds one).
    A parameter gradient that waits for its AccumulateGrad (the parameter has readers whose
    backward has not run yet) is counted apart, ``param_grad_waiting_bytes``: it is memory
    beside ``.grad`` where gradients are held, and ``.grad`` itself where they are made."""

    def __init__(self, trace: StepTrace):
        self.trace = trace
        self.alive: dict[tuple[int, int], list] = {}  # storage -> [tensor, nodes it waits for]
        self.waiting: dict[int, list[tuple[int, int]]] = {}  # node id -> storages sent to it
        # parameter gradients in AccumulateGrad buffers: storage -> (bytes, AccumulateGrad id);
        # no reference held (one would stop AccumulateGrad from taking the tensor as ``.grad``)
        self.param_waiting: dict[tuple[int, int], tuple[int, int]] = {}

    @staticmethod
    def _storages(grads) -> dict[tuple[int, int], int]:
        return {
            storage_key(g): int(g.untyped_storage().nbytes())
            for g in grads
            if isinstance(g, torch.Tensor) and g.numel()
        }

    def began(self, seq: int) -> None:
        """A node's backward is about to run: the gradients waiting now (its own incoming ones
        among them) are what a rebuild it triggers holds beside its tensors."""
        alive = sum(int(entry[0].untyped_storage().nbytes()) for entry in self.alive.values())
        if alive:
            self.trace.backward_entry_grad_bytes[seq] = max(
                self.trace.backward_entry_grad_bytes.get(seq, 0), alive
            )

    def ran(self, node, seq: int, grad_inputs, grad_outputs) -> None:
        mine = self.waiting.pop(id(node), [])
        now = {
            key: entry[0].untyped_storage().nbytes()
            for key, entry in self.alive.items()
            if key not in mine
        }
        now.update(self._storages(grad_outputs))
        now.update(self._storages(grad_inputs))
        self.trace.backward_grad_bytes[seq] = max(
            self.trace.backward_grad_bytes.get(seq, 0), int(sum(now.values()))
        )
        self.trace.backward_order.append(seq)
        if type(node).__name__ == "AccumulateGrad":
            # (one of the parameter gradients the node before made, counted there)
            for key in [k for k, (_, target) in self.param_waiting.items() if target == id(node)]:
                del self.param_waiting[key]
            waiting = 0
        else:
            waiting = sum(nbytes for k, (nbytes, _) in self.param_waiting.items() if k not in now)
        if waiting:
            self.trace.param_grad_waiting_bytes[seq] = max(
                self.trace.param_grad_waiting_bytes.get(seq, 0), waiting
            )
        for key in mine:
            entry = self.alive.get(key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self.alive[key]
        for g, (target, _) in zip(grad_inputs, node.next_functions):
            if target is None or not isinstance(g, torch.Tensor) or not g.numel():
                continue  # dropped
            if type(target).__name__ == "AccumulateGrad":  # a parameter's gradient
                nbytes = int(g.untyped_storage().nbytes())
                self.trace.param_grad_bytes[seq] = self.trace.param_grad_bytes.get(seq, 0) + nbytes
                self.param_waiting[storage_key(g)] = (nbytes, id(target))
                continue
            key = storage_key(g)
            self.alive.setdefault(key, [g, 0])[1] += 1
            self.waiting.setdefault(id(target), []).append(key)


class BackwardTransients(TorchDispatchMode):
    """The memory each autograd node's backward formula holds only while it runs: logsumexp's
    backward, ``grad * (self - result).exp()``, holds two temporaries of the input's size beside
    its result, which the gradients the ledger sees at the node's end never show (on HF GPT-2
    the step's peak is there). Counted from the storages the backward's aten ops allocate, alive
    by weak reference, so the figure is the same on every device: the highest level while a node
    runs less the level when it returns."""

    def __init__(self, trace: StepTrace, cost=None):
        super().__init__()
        self.trace = trace
        self.cost = cost  # a fake step: each node's time is its ops' modelled times
        self.live = LiveStorages()
        self.seq: int | None = None
        self.high = 0

    def began(self, seq: int) -> None:
        self.seq, self.high = seq, self.live.total

    def ended(self, seq: int) -> None:
        if self.seq != seq:
            return
        above = max(0, self.high - self.live.total)
        if above:
            self.trace.backward_transient_bytes[seq] = max(
                self.trace.backward_transient_bytes.get(seq, 0), above
            )
        self.seq = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.seq is None or getattr(func, "namespace", "") == "prim":
            return out
        if self.cost is not None:
            self.trace.backward_s[self.seq] = self.trace.backward_s.get(self.seq, 0.0) + self.cost(
                func, args, kwargs, out
            )
        ins = {
            storage_key(t)
            for t in collect_tensors(list(args) + list(kwargs.values()), [])
            if t.layout == torch.strided
        }
        for t in collect_tensors(out if isinstance(out, (list, tuple)) else [out], []):
            if t.layout != torch.strided:
                continue
            try:
                key = storage_key(t)
                nbytes = int(local_tensor(t).untyped_storage().nbytes())
            except RuntimeError:  # a wrapper subclass without storage
                continue
            if key not in ins:
                self.live.add(t, key, nbytes)
        self.high = max(self.high, self.live.total)
        return out


_NO_SEQUENCE_NR = 2**64 - 1  # an autograd node without a sequence number (AccumulateGrad)


def time_backward(
    loss: torch.Tensor, trace: StepTrace, sync=None, clock: GpuClock | None = None, cost=None
) -> None:
    """Backward time of every autograd node, by its sequence number (pre- and post-hooks); with a
    ``clock``, on the GPU's timeline (resolved by ``clock.resolve``). Also the activation
    gradients alive while each node runs (GradientLedger)."""
    seen = set()
    stack = [loss.grad_fn]
    handles = []
    starts: dict[int, float] = {}
    ledger = GradientLedger(trace)
    transients = BackwardTransients(trace, cost)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        seq = node._sequence_nr()
        if seq == _NO_SEQUENCE_NR:
            # every AccumulateGrad has this one: keyed apart (negative, no op's), so one
            # parameter's figures are not charged before every other's
            seq = -len(seen)

        def pre(grad_outputs, seq=seq):
            transients.began(seq)
            ledger.began(seq)
            if cost is not None:
                trace.backward_s.setdefault(seq, 0.0)
                return
            if clock is not None:
                starts[seq] = clock.mark()
                return
            if sync:
                sync()
            starts[seq] = time.perf_counter()

        def post(grad_inputs, grad_outputs, seq=seq, node=node):
            transients.ended(seq)
            ledger.ran(node, seq, grad_inputs, grad_outputs)
            if cost is not None:
                return
            if clock is not None:
                if seq in starts:
                    clock.spans.append((starts[seq], clock.mark(), None, seq))
                return
            if sync:
                sync()
            if seq in starts:
                trace.backward_s[seq] = (
                    trace.backward_s.get(seq, 0.0) + time.perf_counter() - starts[seq]
                )

        handles.append(node.register_prehook(pre))
        handles.append(node.register_hook(post))
        stack.extend(n for n, _ in node.next_functions)
    try:
        with transients:
            loss.backward()
    finally:
        for h in handles:
            h.remove()
