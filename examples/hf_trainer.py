"""Fine-tune an HF GPT-2 (from a config, no download) with the Hugging Face Trainer, its
activation memory planned by slackswap: one line on the Trainer.

    python examples/hf_trainer.py [--steps 30] [--budget 0.5]

Variable-length synthetic data, padded per batch by the collator; gradient accumulation 2; an
evaluation every 10 steps (no plan there). Prints the Trainer's logs, which carry the plan's
budget, the measured activation peak and the plan that ran. Runs on CPU in well under two
minutes.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import transformers

import slackswap as ss


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.items = [
            torch.randint(
                1, 2000, (int(torch.randint(16, 200, (1,), generator=g)),), generator=g
            ).tolist()
            for _ in range(n)
        ]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i]}


def collate(batch):
    width = max(len(b["input_ids"]) for b in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, b in enumerate(batch):
        ids[i, : len(b["input_ids"])] = torch.tensor(b["input_ids"])
        mask[i, : len(b["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--budget", type=float, default=0.5, help="fraction of each bucket's keep-all peak"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
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
    training = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        max_steps=args.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        eval_strategy="steps",
        eval_steps=10,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        learning_rate=3e-4,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model,
        args=training,
        train_dataset=Tokens(400, 1),
        eval_dataset=Tokens(16, 2),
        data_collator=collate,
    )
    planned = ss.hf.plan_trainer(
        trainer, budget=args.budget, refine_time_limit_s=10
    )  # the one line
    began = time.perf_counter()
    trainer.train()
    planned.remove()
    print(
        f"{args.steps} optimizer steps ({planned.planned_steps} planned micro-batches) in "
        f"{time.perf_counter() - began:.1f} s; plans:"
    )
    for switch in planned.loop.switches:
        print(f"  micro-batch {switch.step:>3}: bucket {switch.bucket[0][0]}: {switch.source}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
