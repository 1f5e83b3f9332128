"""Train an HF GPT-2 (from a config) with PyTorch Lightning, its activation memory planned by
slackswap: one callback.

    python examples/lightning_train.py [--steps 20] [--budget 0.5]

Two sequence lengths (two plans), gradient accumulation 2, a validation pass every 10 batches.
Runs on CPU in well under two minutes.
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl
import torch
import transformers

import slackswap as ss


class LanguageModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_layer=4,
                n_embd=256,
                n_head=4,
                n_positions=256,
                vocab_size=2000,
                bos_token_id=0,
                eos_token_id=0,
            )
        )

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def batches(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    items = [torch.randint(1, 2000, (4, 128 if i % 3 else 256), generator=g) for i in range(n)]
    return torch.utils.data.DataLoader(items, batch_size=None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--budget", type=float, default=0.5, help="fraction of each bucket's keep-all peak"
    )
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    callback = ss.lightning.SlackSwapCallback(budget=args.budget, refine_time_limit_s=10)
    trainer = pl.Trainer(
        max_steps=args.steps,
        accumulate_grad_batches=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        val_check_interval=10,
        limit_val_batches=2,
        callbacks=[callback],
    )
    began = time.perf_counter()
    trainer.fit(
        LanguageModel(), train_dataloaders=batches(4 * args.steps, 1), val_dataloaders=batches(2, 2)
    )
    print(
        f"{args.steps} optimizer steps ({callback.planned_batches} planned batches) in "
        f"{time.perf_counter() - began:.1f} s; plans:"
    )
    for switch in callback.loop.switches:
        print(f"  batch {switch.step:>3}: bucket {switch.bucket[0][0]}: {switch.source}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
