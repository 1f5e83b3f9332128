"""slackswap on a Hugging Face ``Trainer`` (and TRL's trainers, which are Trainers): one line,

    ss.hf.plan_trainer(trainer, budget="40GiB")

Every training step (each micro-batch of a gradient accumulation) runs under the plan of its
bucket, with the machinery of :func:`slackswap.planned`: the first step of a bucket (its input
shapes rounded up to powers of two, the model's modes and dtypes) is profiled through the
Trainer's own ``compute_loss`` and planned at once by the heuristic, the exact planner refines
it in a background process, and the plan switches at a step boundary. Evaluation and prediction
steps run as they do without slackswap (no plan). Gradients do not depend on the plan, so the
weights a run ends with are the weights it ends with without slackswap.

Plans are not part of the model's state: a checkpoint saves none, and a resumed run plans its
buckets again on their first steps. ``gradient_checkpointing=True`` is refused: torch's
checkpointing and slackswap would both own the saved tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .core.hardware import Hardware
from .loop import PlannedLoop, check_loop_options

MIB = 2**20


@dataclass
class PlannedTrainer:
    """What ``plan_trainer`` returns: the loop it plans with (``loop``; None before the first
    training step) and ``remove()``, which gives the Trainer back its own training step."""

    trainer: Any
    budget: Any
    hardware: Hardware | str | None
    options: dict = field(default_factory=dict)
    loop: PlannedLoop | None = None
    planned_steps: int = 0
    _num_items: Any = None
    _originals: dict = field(default_factory=dict)

    # ------------------------------------------------------------ the Trainer's step
    def training_step(self, model, inputs, num_items_in_batch=None):
        original = self._originals["training_step"]
        if self.loop is None:
            self.loop = PlannedLoop(
                model, self._loss, self.budget, self.hardware, forward=self._forward, **self.options
            )
            self.loop.__enter__()
        # the Trainer sets training mode inside its step; the bucket (and its profile) must see
        # the step's mode, not the evaluation's it may come from
        model.train()
        self._num_items = num_items_in_batch
        loss = self.loop.around(inputs, lambda: original(model, inputs, num_items_in_batch))
        self.planned_steps += 1
        return loss

    def _forward(self, model, inputs):
        """The Trainer's own loss computation: what its training step runs before backward."""
        trainer = self.trainer
        prepared = trainer._prepare_inputs(dict(inputs))
        with trainer.compute_loss_context_manager():
            return trainer.compute_loss(model, prepared, num_items_in_batch=self._num_items)

    def _loss(self, loss):
        """The Trainer's scaling of the loss for gradient accumulation (training_step)."""
        trainer = self.trainer
        scaled = trainer.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (
                trainer.model_accepts_loss_kwargs and self._num_items is not None
            ) or trainer.compute_loss_func is not None
        return loss if scaled else loss / trainer.current_gradient_accumulation_steps

    # ------------------------------------------------------------ logging
    def log(self, logs: dict, *args, **kwargs):
        """The Trainer's log, with the plan's budget, the last step's measured activation peak
        and the plan that ran, on the training logs."""
        loop = self.loop
        if loop is not None and "loss" in logs and loop.last_plan is not None:
            plan = loop.last_plan
            logs = {
                **logs,
                "slackswap_budget_mib": plan.budget_bytes / MIB,
                "slackswap_peak_mib": loop.last_stats.peak_activation_bytes / MIB,
                "slackswap_plan": f"{plan.info.solver}/{plan.info.status}",
            }
        return self._originals["log"](logs, *args, **kwargs)

    def remove(self) -> None:
        """Give the Trainer back its own step and log, and cancel the refinements."""
        for name, method in self._originals.items():
            setattr(self.trainer, name, method)
        self._originals = {}
        if self.loop is not None:
            self.loop.close()


def plan_trainer(
    trainer,
    budget,
    hardware: Hardware | str | None = None,
    *,
    refine_solver: str | None = "cpsat",
    refine_time_limit_s: float = 30.0,
    max_plans: int = 8,
) -> PlannedTrainer:
    """Plan the activation memory of ``trainer``'s training steps under ``budget`` (a fraction
    of each bucket's keep-all peak, bytes, or a string such as "40GiB"). Call before
    ``trainer.train()``; the options are :func:`slackswap.planned`'s."""
    check_loop_options(budget, hardware, "plan_trainer")
    args = getattr(trainer, "args", None)
    if (
        args is None
        or not hasattr(trainer, "training_step")
        or not hasattr(trainer, "compute_loss")
    ):
        raise TypeError(
            f"plan_trainer: expected a transformers Trainer, got {type(trainer).__name__}"
        )
    model = getattr(trainer, "model", None)
    if getattr(args, "gradient_checkpointing", False) or getattr(
        model, "is_gradient_checkpointing", False
    ):
        raise ValueError(
            "plan_trainer: the Trainer has gradient_checkpointing=True: torch's "
            "checkpointing and slackswap would both own the saved tensors (a plan "
            "recomputes what it needs itself); set gradient_checkpointing=False"
        )
    if isinstance(getattr(trainer, "training_step", None), _Bound):
        raise ValueError(
            "plan_trainer: this Trainer is already planned; call remove() on the "
            "first PlannedTrainer to plan it again"
        )
    planned = PlannedTrainer(
        trainer,
        budget,
        hardware,
        {
            "refine_solver": refine_solver,
            "refine_time_limit_s": refine_time_limit_s,
            "max_plans": max_plans,
        },
    )
    planned._originals = {"training_step": trainer.training_step, "log": trainer.log}
    trainer.training_step = _Bound(planned.training_step)
    trainer.log = _Bound(planned.log)
    return planned


class _Bound:
    """A planned Trainer's method (marks it, so a second plan_trainer is refused)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)
