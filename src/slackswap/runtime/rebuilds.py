"""How a recomputed saved tensor comes back for its backward use: the ops that made it run again,
with the RNG state they first ran with, recursively through tensors that were not saved, then
the ops that wrote it in place, in order (formulations/step-model.md, "Decisions"). A step's
``Rebuilder`` owns its recipes; it asks the step for what is resident (``Step.resident``) and
for the saved tensors the plan brings back (``Step.materialize``)."""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from .rebuild import Recipe, Ref, fill
from .trace import collect_tensors

if TYPE_CHECKING:
    from .step import Step


class Transients(dict[str, torch.UntypedStorage]):
    """The storages of the unsaved tensors a rebuild has made, by name, and how many reads of
    each the rebuild's ops still have to make (``reads``; empty without the graph: kept to the
    rebuild's end)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: dict[str, int] = {}


class Rebuilder:
    """A step's recipes (each op's, by the names of what it made), its in-place writes, and the
    rebuilds that run them."""

    def __init__(self, step: Step):
        # (weakly: the step owns its rebuilder, and a cycle would hold the step, its host
        # buffers among its state, until the cyclic collector runs)
        self.step: Step = weakref.proxy(step)
        self.recipes: dict[str, Recipe | None] = {}
        self.rewrites: dict[str, list[Recipe]] = {}  # in-place writes, in forward order
        self.written: dict[str, int] = {}  # in-place writes so far, per tensor
        self.depth = 0

    def file(
        self,
        made: tuple[str, ...],
        recipe: Recipe | None,
        writes: tuple[str, ...],
        rewrite: Recipe | None,
    ) -> None:
        """An op ran: the recipe of what it made, and its in-place writes (a write into a saved
        tensor after its save makes that tensor dirty: reading it raises)."""
        for n in made:
            self.recipes[n] = recipe
        if rewrite is not None:
            for w in writes:
                if w in self.recipes:
                    self.rewrites.setdefault(w, []).append(rewrite)
        step = self.step
        for w in writes:
            if w in step.packed:
                step.dirty.add(w)
            self.written[w] = self.written.get(w, 0) + 1

    def rebuild(self, name: str) -> torch.UntypedStorage:
        """Tensor ``name`` made again. Only the outermost rebuild is timed, less the fetches it
        waits for (counted in wait_s), so each second is counted once."""
        stats = self.step.ctx.stats
        start, waited = time.perf_counter(), stats.wait_s
        self.depth += 1
        try:
            storage = self.rerun_for(name, self.scope(name))
        finally:
            self.depth -= 1
        if self.depth == 0:
            stats.recompute_s += (time.perf_counter() - start) - (stats.wait_s - waited)
        stats.recomputed_bytes += storage.nbytes()
        return storage

    def scope(self, name: str) -> Transients:
        """The unsaved tensors one rebuild makes, each let go after its last reader among the
        rebuild's ops (as the step model frees a rerun's transients), not at the rebuild's end:
        a chain of k elementwise ops would otherwise hold k intermediates at once."""
        scope = Transients()
        graph = self.step.ctx.graph
        if graph is not None and name in graph.tensor_index:
            reads = scope.reads
            saved = graph.is_saved
            for q in graph.rerun_ops[graph.tensor_index[name]]:
                for t in graph.op_inputs[q]:
                    if not saved[t]:
                        n = graph.tensors[t].name
                        reads[n] = reads.get(n, 0) + 1
        return scope

    def storage_of(self, name: str, transients: Transients) -> torch.UntypedStorage:
        """A tensor's storage while a rebuild runs: saved tensors as the plan says, others (and
        kept tensors already released after their last reader) run again."""
        step = self.step
        found = step.resident(name)
        if found is not None:
            return found
        if step.brought_back(name):
            return step.materialize(name)
        if name not in transients:
            transients[name] = self.rerun_for(name, transients)
        return transients[name]

    def rerun_for(self, name: str, transients: Transients) -> torch.UntypedStorage:
        """Tensor ``name`` made again: its producer, then every op that wrote it in place."""
        rec = self.recipes.get(name)
        if rec is None:
            raise RuntimeError(
                f"tensor {name!r} cannot be rebuilt: no recipe recorded for the "
                "op that made it (plan it as keep or swap)"
            )
        tensors = self.run_recipe(rec, transients, {})
        for t, out_name in zip(tensors, rec.out_names, strict=False):
            if out_name == name:
                storage = t.untyped_storage()
                break
        else:
            raise RuntimeError(f"rerun of op {rec.op!r} did not produce tensor {name!r}")
        for writer in self.rewrites.get(name, ()):
            self.run_recipe(writer, transients, {name: storage})
        return storage

    def run_recipe(
        self, rec: Recipe, transients: Transients, fresh: dict[str, torch.UntypedStorage]
    ) -> list[torch.Tensor]:
        """One recorded op run again (its RNG state as it first ran), under no_grad; ``fresh``:
        storages a rebuild has just made, read in place of the step's own."""
        ctx = self.step.ctx

        def resolve(ref: Ref) -> torch.Tensor:
            storage = fresh.get(ref.name)
            if storage is None:
                if self.written.get(ref.name, 0) != ref.writes:
                    raise RuntimeError(
                        f"rebuilding with op {rec.op!r} would read tensor {ref.name!r} as it is "
                        "now, but the op read it before it was written in place: plan what the "
                        "op makes as keep or swap"
                    )
                storage = self.storage_of(ref.name, transients)
            return ref.view.on(storage, ctx.device)

        call_args = fill(rec.args, resolve)
        call_kwargs = {k: fill(v, resolve) for k, v in rec.kwargs.items()}
        rng = rec.rng
        saved_state = cuda_state = None
        if rng is not None:
            saved_state = torch.get_rng_state()
            cuda_state = torch.cuda.get_rng_state(ctx.device) if ctx.cuda else None
            torch.set_rng_state(rng[0])
            if ctx.cuda and rng[1] is not None:
                torch.cuda.set_rng_state(rng[1], ctx.device)
        try:
            with torch.no_grad():
                out = rec.func(*call_args, **call_kwargs)
        finally:
            if saved_state is not None:
                torch.set_rng_state(saved_state)
                if cuda_state is not None:
                    torch.cuda.set_rng_state(cuda_state, ctx.device)
        reads = transients.reads
        if reads:
            for ref_name in _ref_names((rec.args, rec.kwargs), set()):
                left = reads.get(ref_name)
                if left is not None and ref_name not in fresh:
                    reads[ref_name] = left - 1
                    if left <= 1:
                        transients.pop(ref_name, None)  # its last reader in this rebuild ran
        return [out] if isinstance(out, torch.Tensor) else collect_tensors(out, [])


def _ref_names(obj: Any, out: set[str]) -> set[str]:
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
