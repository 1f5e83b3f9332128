"""Does a recompute-only plan reach what torch's per-block checkpointing reaches (CPU)?

For HF GPT-2 (4 layers, width 256, batch 4 x 128, dropout on) and a BatchNorm ResNet with
in-place ReLUs: the measured peak of plain training and of per-block checkpointing (StepMeter),
the keep-all peak the profile simulates, the smallest budget a keep/recompute plan reaches
(``ss.smallest_budget`` on the ``cpu`` preset), and a slackswap plan at per-block
checkpointing's measured peak run with ``ss.apply``: its measured peak and its step time against
per-block checkpointing's (median of paired rounds).

    python benchmarks/reach.py [--rounds 5] [--json benchmarks/results/reach.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers
from torch import nn
from torch.utils.checkpoint import checkpoint

import slackswap as ss


class Block(nn.Module):
    """conv, batch norm, in-place ReLU, conv, batch norm, the skip, in-place ReLU."""

    def __init__(self, c: int):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(x + self.b2(self.c2(self.relu(self.b1(self.c1(x))))))


class ResNet(nn.Module):
    def __init__(self, c: int = 32, blocks: int = 4, checkpointed: bool = False):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True)
        )
        self.blocks = nn.ModuleList(Block(c) for _ in range(blocks))
        self.head = nn.Linear(c, 10)
        self.checkpointed = checkpointed

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x.mean((2, 3)))


def cases():
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=4,
            n_embd=256,
            n_head=4,
            n_positions=128,
            vocab_size=1000,
            bos_token_id=0,
            eos_token_id=0,
        )
    ).train()
    ids = {"input_ids": torch.randint(0, 1000, (4, 128))}

    def gpt2_loss(o):
        return o.logits.float().logsumexp(-1).mean()

    def gpt2_blocks(on: bool):
        if on:
            gpt2.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            gpt2.gradient_checkpointing_disable()

    resnet = ResNet().train()
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))

    def resnet_loss(o):
        return nn.functional.cross_entropy(o, y)

    def resnet_blocks(on: bool):
        resnet.checkpointed = on

    return [
        ("hf-gpt2", gpt2, ids, gpt2_loss, gpt2_blocks),
        ("bn-resnet", resnet, x, resnet_loss, resnet_blocks),
    ]


def call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def measured_peak(step) -> int:
    for _ in range(2):  # the first step also pays the heap's first-use buffers
        with ss.StepMeter(sample="ops") as meter:
            step()
    return meter.peak_bytes


def paired(a, b, rounds: int) -> float:
    """Median ratio of b's step time to a's, the two run back to back in each round."""
    a(), b()
    ratios = []
    for _ in range(rounds):
        start = time.perf_counter()
        a()
        mid = time.perf_counter()
        b()
        ratios.append((time.perf_counter() - mid) / (mid - start))
    return statistics.median(ratios)


def measure(name, model, inputs, loss_fn, blocks, hw, rounds: int) -> dict:
    """One model's row: measured peaks, the smallest budget, a plan at per-block's peak."""
    # measured with the gradients made before the step (accumulated in place): so profiled
    graph = ss.profile(model, inputs, loss_fn, warmup=1, repeat=1, name=name, gradients="held")
    keep_all = ss.keep_all_peak(graph, hw)

    def plain():
        model.zero_grad(set_to_none=False)
        loss_fn(call(model, inputs)).backward()

    def per_block():
        blocks(True)
        try:
            plain()
        finally:
            blocks(False)

    plain()  # gradients exist before the measured steps: accumulated in place
    plain_peak, block_peak = measured_peak(plain), measured_peak(per_block)
    smallest = ss.smallest_budget(graph, hw)
    row = {
        "model": name,
        "keep_all_simulated": keep_all,
        "plain_measured": plain_peak,
        "per_block_measured": block_peak,
        "smallest_budget": smallest.budget_bytes,
        "smallest_proven": smallest.proven,
    }
    # at per-block checkpointing's measured peak with the default solver first (the smallest
    # budget above is the heuristic's bisection where not proven: the exact planner may go lower)
    try:
        plan = ss.solve(graph, block_peak, hw)
        row["reached_per_block"] = True
    except ss.InfeasibleBudget:
        row["reached_per_block"] = False
        try:
            plan = ss.solve(graph, max(block_peak, smallest.budget_bytes), hw)
        except ss.InfeasibleBudget as exc:
            row["plan_error"] = str(exc)
            return row

    run = ss.apply(plan, model, graph=graph)  # one context, entered per step (as ss.planned)

    def planned():
        with run:
            plain()

    row.update(
        plan_budget=plan.budget_bytes,
        plan_recomputes=plan.count("recompute"),
        plan_measured=measured_peak(planned),
        plan_simulated=ss.simulate(graph, plan).tensor_peak_bytes,
        plan_step_vs_per_block=paired(per_block, planned, rounds),
    )
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/reach.json"))
    args = parser.parse_args()
    hw = ss.hardware("cpu")
    rows = []
    for case in cases():
        rows.append(measure(*case, hw, args.rounds))
        print(json.dumps(rows[-1]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    from results_md import command_line, markdown_table, write_section

    def share(r, key):
        return f"{r[key] / r['keep_all_simulated']:.2f}" if key in r else "-"

    write_section(
        "reach",
        "Reach: recompute-only plans against per-block checkpointing (CPU)",
        command_line(),
        markdown_table(
            [
                "model",
                "keep-all simulated MiB",
                "plain measured",
                "per-block checkpointing",
                "smallest slackswap budget found",
                "slackswap plan: budget",
                "measured",
                "its step / per-block's",
            ],
            [
                [
                    r["model"],
                    f"{r['keep_all_simulated'] / 2**20:.1f}",
                    share(r, "plain_measured"),
                    share(r, "per_block_measured"),
                    share(r, "smallest_budget"),
                    share(r, "plan_budget")
                    + (" (per-block's peak)" if r.get("reached_per_block") else ""),
                    share(r, "plan_measured"),
                    f"{r['plan_step_vs_per_block']:.2f}"
                    if "plan_step_vs_per_block" in r
                    else r.get("plan_error", "-")[:60],
                ]
                for r in rows
            ],
        )
        + "\n\nPeaks as shares of the simulated keep-all peak; measured with StepMeter "
        "(gradients allocated before the step). The smallest budget is the exact planner's "
        "where proven, else the heuristic's bisection; the plan is the default solver's at "
        "per-block checkpointing's measured peak where it finds one, else at that smallest "
        "budget.",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
