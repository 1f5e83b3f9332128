"""Train an HF GPT-2 (from a config, no download) on variable-length synthetic data with a plan
that slackswap makes inside the training loop.

    python examples/hf_train.py [--steps 50] [--budget 0.6] [--layers 4]

Each new shape bucket (sequence lengths rounded up to a power of two) is profiled on its first
step and planned at once by the heuristic; CP-SAT refines the plan in the background and the
loop switches to it at a step boundary when it is proven faster. A progress bar shows the loss
and each step's tracked activation peak. Runs on CPU in about a minute.
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm
from transformers import GPT2Config, GPT2LMHeadModel

import slackswap as ss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--budget", default="0.6", help="fraction of each bucket's keep-all peak")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=args.layers,
        n_embd=256,
        n_head=4,
        n_positions=256,
        vocab_size=2000,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    )
    model = GPT2LMHeadModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    lengths = torch.Generator().manual_seed(1)
    data = torch.Generator().manual_seed(2)

    def batch() -> dict:
        n = int(torch.randint(40, 200, (1,), generator=lengths))  # buckets 64, 128, 256
        ids = torch.randint(0, 2000, (args.batch, n), generator=data)
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    budget = float(args.budget) if args.budget.replace(".", "", 1).isdigit() else args.budget
    began = time.perf_counter()
    with ss.planned(model, lambda out: out.loss, budget, refine_time_limit_s=20) as loop:
        bar = tqdm(range(args.steps), desc="training")
        for _ in bar:
            optimizer.zero_grad(set_to_none=True)
            inputs = batch()
            loss = loop.step(inputs)
            optimizer.step()
            bar.set_postfix(
                loss=f"{loss.item():.3f}",
                seq=inputs["input_ids"].shape[1],
                peak=f"{loop.last_stats.peak_activation_bytes / 2**20:.1f}MiB",
            )
    print(f"{args.steps} steps in {time.perf_counter() - began:.1f} s; plans per bucket:")
    for switch in loop.switches:
        shape = switch.bucket[0][0]  # the first input's (input_ids) bucketed shape
        print(
            f"  step {switch.step:>3}: bucket {shape}: {switch.source} plan, simulated step "
            f"{1e3 * switch.predicted_step_time_s:.1f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
