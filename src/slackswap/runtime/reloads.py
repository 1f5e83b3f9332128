"""How a saved tensor the plan did not keep comes back for its backward use (a part of the
executor's Run): a swapped one prefetched from host memory (its copy issued ahead on the lanes,
then waited for), a recomputed one rebuilt by running again the ops that made it, with the RNG
state they first ran with, recursively through tensors that were not saved."""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

import torch

from .rebuild import Ref, fill
from .trace import collect_tensors

if TYPE_CHECKING:
    from .executor import _Step


class Reloads:
    """The executor's methods that bring a tensor back: prefetch, offload and wait for copies;
    rebuild by rerun."""

    def _prefetch(self, step: _Step, name: str) -> None:
        """Issue copies back ahead of use. With the graph: every offloaded tensor whose planned
        issue position the backward pass has reached (the position of the tensor just asked
        for, one ahead). Without it: the next ``prefetch_ahead`` in reverse order of offload."""
        if not step.swap_order or self._positions is not None:
            return  # with the graph, prefetches are issued at their positions (_at_backward)
        if self._issue_at is not None and name in self._need_at:
            now = self._need_at[name] + 1
            for nxt in step.swap_order:
                if (
                    self._issue_at.get(nxt, 1 << 30) <= now
                    and nxt not in step.device_copy
                    and step.handles_left.get(nxt, 0) > 0
                ):
                    step.device_copy[nxt] = self._bring_back(step, nxt)
            return
        if self.prefetch_ahead <= 0:
            return
        if name in step.swap_order:
            i = step.swap_order.index(name)
            upcoming = step.swap_order[max(0, i - self.prefetch_ahead) : i][::-1]
        else:
            upcoming = step.swap_order[-self.prefetch_ahead :][::-1]
        for nxt in upcoming:
            if nxt not in step.device_copy and step.handles_left.get(nxt, 0) > 0:
                step.device_copy[nxt] = self._bring_back(step, nxt)

    # ------------------------------------------------------------ swap
    def _offload(self, step: _Step, name: str, t: torch.Tensor) -> None:
        src = t.untyped_storage()
        nbytes = src.nbytes()
        buf = self.pool.get(name, nbytes)
        if not step.taken:
            weakref.finalize(step, self.pool.give_back, step.taken)
        step.taken.append((name, buf))
        step.host[name] = (buf, nbytes, self.lanes.offload(src, buf, nbytes))
        step.log.add("offload", name, step.position)
        self.stats.swapped_out_bytes += nbytes

    def _bring_back(self, step: _Step, name: str) -> torch.UntypedStorage:
        """Issue the tensor's prefetch on the H2D lane (its first use waits for it)."""
        buf, nbytes, offloaded = step.host[name]
        start = time.perf_counter()
        dev, arrived = self.lanes.prefetch(buf, nbytes, offloaded)
        step.arrived[name] = arrived
        step.log.add("prefetch", name, step.position)
        self.stats.wait_s += time.perf_counter() - start
        self.stats.swapped_in_bytes += nbytes
        return dev

    # ------------------------------------------------------------ recompute
    def _materialize(self, step: _Step, name: str) -> torch.UntypedStorage:
        """A saved tensor's storage on the device: a fetched copy or a rebuilt one, shared by
        all its readers until the last has run."""
        cached = step.device_copy.get(name)
        if cached is not None:
            self._first_use(step, name)
            return cached
        if self.plan.decisions.get(name) == "swap" and name in step.host:
            storage = self._bring_back(step, name)
            step.device_copy[name] = storage
            self._first_use(step, name)
            return storage
        else:
            step.log.add("rebuild", name, step.position)
            # a rebuild may rebuild others first (nested) or fetch a swapped input: only the
            # outermost rebuild is timed, less the fetches (counted in wait_s), so each second
            # is counted once
            start, waited = time.perf_counter(), self.stats.wait_s
            self._rebuild_depth += 1
            try:
                storage = self._rerun_for(step, name, self._rebuild_scope(name))
            finally:
                self._rebuild_depth -= 1
            if self._rebuild_depth == 0:
                self.stats.recompute_s += (time.perf_counter() - start) - (
                    self.stats.wait_s - waited
                )
            self.stats.recomputed_bytes += storage.nbytes()
        step.device_copy[name] = storage
        return storage

    def _rebuild_scope(self, name: str) -> _Transients:
        """The unsaved tensors one rebuild makes, each let go after its last reader among the
        rebuild's ops (as the step model frees a rerun's transients), not at the rebuild's end:
        a chain of k elementwise ops would otherwise hold k intermediates at once."""
        scope = _Transients()
        graph = self.graph
        if graph is not None and name in graph.tensor_index:
            reads = scope.reads
            saved = graph.is_saved
            for q in graph.rerun_ops[graph.tensor_index[name]]:
                for t in graph.op_inputs[q]:
                    if not saved[t]:
                        n = graph.tensors[t].name
                        reads[n] = reads.get(n, 0) + 1
        return scope

    def _first_use(self, step: _Step, name: str) -> None:
        """A prefetched tensor is read: compute waits for its copy here, and only here."""
        if name in step.arrived:
            self.lanes.wait(step.arrived.pop(name))
            step.log.add("wait", name, step.position)

    def _storage_of(self, step: _Step, name: str, transients: dict) -> torch.UntypedStorage:
        """A tensor's storage while a rebuild runs: saved tensors as the plan says, others (and
        kept tensors already released after their last reader) run again."""
        if name in step.device_copy:
            return step.device_copy[name]
        if name in step.kept:
            return step.kept[name]
        if name in step.lingering:
            return step.lingering[name]
        if name in step.packed and self.plan.decisions.get(name) != "keep":
            return self._materialize(step, name)
        if name not in transients:
            transients[name] = self._rerun_for(step, name, transients)
        return transients[name]

    def _rerun_for(self, step: _Step, name: str, transients: dict) -> torch.UntypedStorage:
        """Tensor ``name`` made again: its producer, then every op that wrote it in place."""
        rec = step.recipes.get(name)
        if rec is None:
            raise RuntimeError(
                f"tensor {name!r} cannot be rebuilt: no recipe recorded for the "
                "op that made it (plan it as keep or swap)"
            )
        tensors = self._run_recipe(step, rec, transients, {})
        for t, out_name in zip(tensors, rec.out_names, strict=False):
            if out_name == name:
                storage = t.untyped_storage()
                break
        else:
            raise RuntimeError(f"rerun of op {rec.op!r} did not produce tensor {name!r}")
        for writer in step.rewrites.get(name, ()):
            self._run_recipe(step, writer, transients, {name: storage})
        return storage

    def _run_recipe(self, step: _Step, rec, transients: dict, fresh: dict) -> list:
        """One recorded op run again (its RNG state as it first ran), under no_grad; ``fresh``:
        storages a rebuild has just made, read in place of the step's own."""

        def resolve(ref: Ref) -> torch.Tensor:
            storage = fresh.get(ref.name)
            if storage is None:
                if step.written.get(ref.name, 0) != ref.writes:
                    raise RuntimeError(
                        f"rebuilding with op {rec.op!r} would read tensor {ref.name!r} as it is "
                        "now, but the op read it before it was written in place: plan what the "
                        "op makes as keep or swap"
                    )
                storage = self._storage_of(step, ref.name, transients)
            return ref.view.on(storage, self.device)

        call_args = fill(rec.args, resolve)
        call_kwargs = {k: fill(v, resolve) for k, v in rec.kwargs.items()}
        rng = rec.rng
        if rng is not None:
            saved_state = torch.get_rng_state()
            cuda_state = torch.cuda.get_rng_state(self.device) if self.cuda else None
            torch.set_rng_state(rng[0])
            if self.cuda and rng[1] is not None:
                torch.cuda.set_rng_state(rng[1], self.device)
        try:
            with torch.no_grad():
                out = rec.func(*call_args, **call_kwargs)
        finally:
            if rng is not None:
                torch.set_rng_state(saved_state)
                if cuda_state is not None:
                    torch.cuda.set_rng_state(cuda_state, self.device)
        reads = getattr(transients, "reads", None)
        if reads:
            for ref_name in _ref_names((rec.args, rec.kwargs), set()):
                left = reads.get(ref_name)
                if left is not None and ref_name not in fresh:
                    reads[ref_name] = left - 1
                    if left <= 1:
                        transients.pop(ref_name, None)  # its last reader in this rebuild ran
        return [out] if isinstance(out, torch.Tensor) else collect_tensors(out, [])


class _Transients(dict):
    """The storages of the unsaved tensors a rebuild has made, by name, and how many reads of
    each the rebuild's ops still have to make (``reads``; empty without the graph: kept to the
    rebuild's end)."""

    def __init__(self):
        super().__init__()
        self.reads: dict[str, int] = {}


def _ref_names(obj, out: set) -> set:
    """The names of the graph tensors (Ref) in a recipe's arguments, each once."""
    if isinstance(obj, Ref):
        out.add(obj.name)
    elif isinstance(obj, dict):
        for v in obj.values():
            _ref_names(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _ref_names(v, out)
    return out
