"""The executor's tracers of a planned step (runtime/step.py): each forward op is named as the
profiler named it; the first step records what a rebuild reruns (its recipes' skeletons), later
skimmed steps count positions and record each recipe on their own tensors by the first's names.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..core.errors import PlanError
from .rebuild import External, Recipe, Ref, View, template
from .trace import ModulePaths, Tracer, collect_tensors, op_info

if TYPE_CHECKING:
    from .step import Step


class StepTracer(Tracer):
    """What both of the executor's tracers do: hold the step, and let through untouched the ops
    that are not the forward's (backward ops, a sharding wrapper's own)."""

    def __init__(self, model: torch.nn.Module, step: Step, paths: ModulePaths):
        super().__init__(model, paths)
        self.step: Step | None = step

    def passed_through(self, func: Any, args: Any, kwargs: Any) -> tuple[bool, Any]:
        """(True, its result) for an op run here untraced; (False, None) for a forward op."""
        if torch._C._current_autograd_node() is not None:
            return True, func(*args, **kwargs)
        return self.wrapper_work(func, args, kwargs)


class SkimTracer(StepTracer):
    """A plan that rebuilds nothing, on a step of checked input shapes: the executor acts at
    the plan's positions, which it counts op by op, and nothing else per op (no names, no
    recipes, no storage tracking); saved tensors are named in _pack by the order of saves."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        skipped, out = self.passed_through(func, args, kwargs)
        if skipped:
            return out
        step = self.step
        assert step is not None and step.checked is not None
        op = step.begin_op()
        positions = step.ctx.positions
        assert positions is not None
        skeletons = step.checked.skeletons
        skeleton = skeletons.get(op) if skeletons is not None else None
        if skeleton is None:
            out = func(*args, **kwargs)
        else:
            if skeleton.func is not func:
                raise PlanError(
                    f"apply: op {op} of this step is {func}, where the checked step of the same "
                    f"input shapes ran {skeleton.func}: the model's forward depends on its data; "
                    "run it under ss.planned (which profiles such steps again) or without a plan"
                )
            rng = None
            if skeleton.random:
                ctx = step.ctx
                rng = (
                    torch.get_rng_state(),
                    torch.cuda.get_rng_state(ctx.device) if ctx.cuda else None,
                )
            out = func(*args, **kwargs)
            skeleton.again(args, kwargs, rng, op).file(step)
        if op in positions.hooked_ops:
            tensors = (
                [out]
                if isinstance(out, torch.Tensor)
                else collect_tensors(out if isinstance(out, (list, tuple)) else [], [])
            )
            step.pending_hooks.append((op, [weakref.ref(t) for t in tensors]))
        return out


@dataclass
class Skeleton:
    """An op of a checked step that keeps a recipe or writes in place: its function, its
    recipe (``made``: the tensors it makes) and its in-place rewrite (``writes``: the tensors it
    writes), whose tensor arguments name by their place the tensors a skimmed step's same op
    reads."""

    func: Any
    recipe: Recipe | None
    made: tuple[str, ...]
    rewrite: Recipe | None
    writes: tuple[str, ...]

    @property
    def random(self) -> bool:
        rec = self.recipe or self.rewrite
        return rec is not None and rec.rng is not None

    def file(self, step: Step) -> None:
        """Enter the op's recipes and in-place writes into the step."""
        step.rebuilder.file(self.made, self.recipe, self.writes, self.rewrite)

    def again(self, args: Any, kwargs: Any, rng: Any, op: int) -> Skeleton:
        """The same op in a skimmed step: its recipes on this step's tensors."""

        def redo(rec: Recipe | None) -> Recipe | None:
            if rec is None:
                return None
            return Recipe(
                rec.op,
                rec.func,
                _retemplate(rec.args, args, op),
                {k: _retemplate(v, kwargs.get(k), op) for k, v in rec.kwargs.items()},
                rec.out_names,
                rng if rec.rng is not None else None,
            )

        return Skeleton(self.func, redo(self.recipe), self.made, redo(self.rewrite), self.writes)


def _retemplate(checked: Any, now: Any, op: int) -> Any:
    """``now``'s arguments templated as the checked step's ``checked`` were: a Ref's name (and
    the writes it had seen) from the checked step, its view from this step's tensor."""
    if isinstance(checked, Ref):
        if not isinstance(now, torch.Tensor):
            raise _left_checked_step(op)
        return Ref(checked.name, View.of(now), checked.writes)
    if isinstance(checked, External):
        if not isinstance(now, torch.Tensor):
            raise _left_checked_step(op)
        return External(now, now._version)
    if isinstance(checked, (list, tuple)):
        if not isinstance(now, (list, tuple)) or len(now) != len(checked):
            raise _left_checked_step(op)
        return type(checked)(_retemplate(c, n, op) for c, n in zip(checked, now))
    if isinstance(now, torch.Tensor):
        raise _left_checked_step(op)
    return now


def _left_checked_step(op: int) -> PlanError:
    return PlanError(
        f"apply: the arguments of op {op} of this step differ from those of the "
        "checked step of the same input shapes: the model's forward depends on its "
        "data; run it under ss.planned (which profiles such steps again) or "
        "without a plan"
    )


class RecordingTracer(StepTracer):
    """The profiler's tracer, also tracking device storages and, when the plan recomputes
    anything, keeping for every op a recipe to run it again."""

    def __init__(self, model: torch.nn.Module, step: Step, paths: ModulePaths, recipes: bool):
        super().__init__(model, step, paths)
        self.recipes = recipes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # the profiler's naming (name_outputs) without its timing and records: this runs on
        # every forward op of a traced step
        kwargs = kwargs or {}
        skipped, out = self.passed_through(func, args, kwargs)
        if skipped:
            return out
        step = self.step
        assert step is not None
        ctx = step.ctx
        op = step.begin_op()  # this op's position (the profiler's op index)
        positions = ctx.positions
        aten, _, random, inplace = op_info(func)
        inplace = inplace or "out" in kwargs
        in_tensors, in_keys = self.input_keys(args, kwargs)
        self.note_parameters(in_tensors)
        recorded = self.recipes and (ctx.recipe_ops is None or op in ctx.recipe_ops)
        rng = None
        if random and recorded:
            rng = (
                torch.get_rng_state(),
                torch.cuda.get_rng_state(ctx.device) if ctx.cuda else None,
            )
        out = func(*args, **kwargs)
        module = self.paths.current
        out_tensors, stored, made, writes = self.name_outputs(out, in_keys, inplace, module, None)
        if positions is not None and op in positions.hooked_ops:
            # (requires_grad and grad_fn are set by autograd after this op returns)
            step.pending_hooks.append((op, [weakref.ref(t) for t in out_tensors]))
        live = ctx.live
        for t, (key, storage) in zip(out_tensors, stored):
            if key in live or self.by_storage.get(key) in made:
                step.track(t, key, storage.nbytes())
        if not recorded and not writes:
            return out
        made_recipe = rewrite = None
        if recorded and made and not inplace:
            out_names = []
            for key, _ in stored:
                name = self.by_storage.get(key)
                out_names.append(name if name in made else None)
            written = step.rebuilder.written
            made_recipe = Recipe(
                f"{module}/{aten}",
                func,
                template(args, self, written),
                {k: template(v, self, written) for k, v in kwargs.items()},
                out_names,
                rng,
            )
        if recorded and writes:
            # written in place: rebuilt by its producer, then by this op again (in order)
            written = step.rebuilder.written
            rewrite = Recipe(
                f"{module}/{aten}",
                func,
                template(args, self, written),
                {k: template(v, self, written) for k, v in kwargs.items()},
                [],
                rng,
            )
        skeleton = Skeleton(
            func, made_recipe, tuple(made) if made_recipe else (), rewrite, tuple(writes)
        )
        skeleton.file(step)
        if step.skeletons is not None:
            step.skeletons[op] = skeleton
        return out
