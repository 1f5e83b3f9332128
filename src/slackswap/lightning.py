"""slackswap on PyTorch Lightning: one callback,

    trainer = lightning.Trainer(callbacks=[ss.lightning.SlackSwapCallback(budget="40GiB")])

Each training batch's forward (the LightningModule's ``training_step`` and Lightning's scaling of
its loss for gradient accumulation) and backward run under the plan of the batch's bucket, with
the machinery of :func:`slackswap.planned` (profiled on a bucket's first batch, planned at once by
the heuristic, refined in a background process, switched at a batch boundary). Validation and
prediction run as they do without slackswap. The module's ``training_step`` is wrapped for the
fit and given back at its end.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from .core.hardware import Hardware
from .loop import PlannedLoop, check_loop_options

MIB = 2**20


class _TrainingStep(torch.nn.Module):
    """The module's training step as a module (its forward is the step): what is profiled and
    planned, so that the plan's names are the step's, loss included."""

    def __init__(self, module: torch.nn.Module, step):
        super().__init__()
        self.module = module
        self.step = step
        self.batch_idx = 0
        self.extra: tuple = ()

    def forward(self, batch):
        return self.step(batch, self.batch_idx, *self.extra)


class SlackSwapCallback(Callback):
    """Plan the activation memory of every training batch under ``budget`` (a fraction of each
    bucket's keep-all peak, bytes, or a string such as "40GiB"); the options are
    :func:`slackswap.planned`'s. ``loop`` is the PlannedLoop during a fit."""

    def __init__(
        self,
        budget,
        hardware: Hardware | str | None = None,
        *,
        refine_solver: str | None = "cpsat",
        refine_time_limit_s: float = 30.0,
        max_plans: int = 8,
    ):
        super().__init__()
        check_loop_options(budget, hardware, "SlackSwapCallback")
        self.budget = budget
        self.hardware = hardware
        self.options: dict[str, Any] = {
            "refine_solver": refine_solver,
            "refine_time_limit_s": refine_time_limit_s,
            "max_plans": max_plans,
        }
        self.loop: PlannedLoop | None = None
        self.planned_batches = 0
        self._module = None
        self._wrapper: _TrainingStep | None = None
        self._accumulate = 1
        self._own = None

    # ------------------------------------------------------------ the fit
    def on_fit_start(self, trainer, pl_module) -> None:
        if not trainer.lightning_module.automatic_optimization:
            raise ValueError(
                "SlackSwapCallback: manual optimization runs the backward inside "
                "training_step; use ss.planned or ss.apply around it instead"
            )
        self._accumulate = int(trainer.accumulate_grad_batches)
        original = pl_module.training_step
        self._own = vars(pl_module).get("training_step")  # an instance's own, to put back
        self._module = pl_module
        self._wrapper = _TrainingStep(pl_module, original)
        self.loop = PlannedLoop(
            self._wrapper, self._loss, self.budget, self.hardware, **self.options
        )
        self.loop.__enter__()
        pl_module.training_step = self._training_step

    def on_fit_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._module is not None and self._wrapper is not None:
            if self._own is not None:
                self._module.training_step = self._own
            else:
                vars(self._module).pop("training_step", None)  # the class's method again
        if self.loop is not None:
            self.loop.close()
        self._module = None

    def _loss(self, out):
        """What Lightning backpropagates: the step's loss over the batches it accumulates."""
        loss = out["loss"] if isinstance(out, dict) else out
        return loss / self._accumulate

    def _training_step(self, batch, batch_idx, *extra):
        wrapper = self._wrapper
        wrapper.batch_idx, wrapper.extra = batch_idx, extra
        self.planned_batches += 1
        return self.loop.forward_step((batch,), lambda: wrapper(batch))

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.loop is not None:
            self.loop.end_step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loop = self.loop
        if loop is None:
            return
        loop.end_step()  # a batch whose loss was None ran no backward
        if loop.last_plan is not None and loop.last_stats is not None:
            pl_module.log_dict(
                {
                    "slackswap_budget_mib": loop.last_plan.budget_bytes / MIB,
                    "slackswap_peak_mib": loop.last_stats.peak_activation_bytes / MIB,
                },
                on_step=True,
                on_epoch=False,
            )
