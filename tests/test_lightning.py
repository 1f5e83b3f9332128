"""ss.lightning.SlackSwapCallback: a Lightning fit with gradient accumulation ends with the
weights of the same fit without it; every batch ran under a plan within its budget. Lightning is
imported by the tests alone (its import costs seconds; the fast lane leaves it out)."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import slackswap as ss  # noqa: E402

pytestmark = pytest.mark.slow


@functools.cache
def _lightning():
    return pytest.importorskip("lightning.pytorch")


@functools.cache
def _language_model():
    pl = _lightning()

    class LanguageModel(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = transformers.GPT2LMHeadModel(
                transformers.GPT2Config(
                    n_layer=2,
                    n_embd=128,
                    n_head=2,
                    n_positions=128,
                    vocab_size=1000,
                    bos_token_id=0,
                    eos_token_id=0,
                )
            )  # dropout 0.1 throughout

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return LanguageModel


def _data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # two lengths: two buckets
    batches = [torch.randint(1, 1000, (4, 64 if i % 3 else 128), generator=g) for i in range(n)]
    return torch.utils.data.DataLoader(batches, batch_size=None)


def _fit(callbacks):
    pl = _lightning()
    module = _language_model()()
    trainer = pl.Trainer(
        max_steps=8,
        accumulate_grad_batches=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=4,
        limit_val_batches=2,
        callbacks=callbacks,
    )
    pl.seed_everything(0, verbose=False)
    trainer.fit(module, train_dataloaders=_data(16, 1), val_dataloaders=_data(2, 2))
    return module


def _meter(callback, peaks):
    """A callback measuring each batch's forward and backward with ``ss.StepMeter`` (after every
    op, on the heap), the parameter gradients the batch made left out (they are not
    activations), paired with the budget of the plan it ran under; batches that profiled a new
    bucket are not plan steps."""
    pl = _lightning()

    class Meter(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.switches = len(callback.loop.switches)
            self.before = {id(p) for p in pl_module.parameters() if p.grad is not None}
            self.meter = ss.StepMeter(sample="ops").__enter__()

        def on_after_backward(self, trainer, pl_module):
            self.meter.__exit__(None, None, None)
            loop = callback.loop
            made = sum(
                p.grad.numel() * p.grad.element_size()
                for p in pl_module.parameters()
                if p.grad is not None and id(p) not in self.before
            )
            profiled = (
                len(loop.switches) > self.switches and loop.switches[-1].source == "heuristic"
            )
            if loop.last_plan is not None and not profiled:
                peaks.append((self.meter.peak_bytes - made, loop.last_plan.budget_bytes))

    return Meter()


def test_a_planned_fit_ends_with_the_weights_of_a_plain_one():
    plain = _fit([])
    callback = ss.lightning.SlackSwapCallback(budget=0.5, refine_solver=None)
    peaks: list[tuple[int, int]] = []
    # after slackswap's callback: its batch start (which may profile) is not measured
    planned = _fit([callback, _meter(callback, peaks)])
    assert callback.planned_batches == 16  # 8 optimizer steps x 2 accumulated batches
    for (name, a), b in zip(plain.named_parameters(), planned.parameters()):
        assert torch.equal(a, b), name  # bit-identical, dropout on, the same seed
    assert len(callback.loop._buckets) == 2
    assert type(planned).training_step is _language_model().training_step  # given back
    assert "training_step" not in vars(planned)
    # every batch that ran under a plan, measured with the heap from the batch's start to its
    # backward's end: within the plan's budget but for what Lightning itself holds in that
    # window beside the model's step, which no profile of the step sees (measured 0.07-0.26%
    # above; docs/known-limits.md)
    assert len(peaks) >= 12, peaks
    assert all(peak <= 1.005 * budget for peak, budget in peaks), peaks


def test_manual_optimization_is_refused():
    pl = _lightning()

    class Manual(_language_model()):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    trainer = pl.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ss.lightning.SlackSwapCallback(budget=0.5, refine_solver=None)],
    )
    with pytest.raises(ValueError, match="manual optimization"):
        trainer.fit(Manual(), train_dataloaders=_data(2, 1))
