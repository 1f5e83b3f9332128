"""Train a small GPT split into pipeline stages with torch.distributed.pipelining, each stage
under the plan slackswap makes for its whole schedule.

    torchrun --nproc_per_node 2 examples/pipeline_train.py [--schedule 1f1b] [--steps 5]
        [--micro-batches 4] [--budget 0.5]
    torchrun --nproc_per_node 2 examples/pipeline_train.py --schedule interleaved-1f1b \
        --stages-per-rank 2

Runs on CPU with the gloo backend and unchanged on GPUs with nccl (one GPU per rank). Every rank
builds the same model (a seed), keeps its stages (one, or several under interleaved 1F1B: the
embedding on the first, an equal share of the blocks, the final norm and the head on the last),
profiles each on one micro-batch, and plans them together for the schedule with
``ss.plan_rank`` (``--budget``: where the rank's budget lies from the least any plan reaches,
0, to its keep-all peak under the schedule, 1). The schedule's first step runs plainly (torch infers the stages'
shapes there, with a forward and a backward of its own); the later ones run under the plan.
Each rank prints its plan, its stage's predicted peak and its step times.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import slackswap as ss

VOCAB, WIDTH, SEQ, BATCH = 512, 64, 32, 8


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Stage(nn.Module):
    """Stage ``stage`` of ``stages`` of a GPT with ``layers`` blocks."""

    def __init__(self, stage: int, stages: int, layers: int):
        super().__init__()
        torch.manual_seed(0)  # every rank builds the same whole model, then keeps its part
        emb = nn.Embedding(VOCAB, WIDTH)
        blocks = [Block(WIDTH) for _ in range(layers)]
        ln, head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)
        per = layers // stages
        self.emb = emb if stage == 0 else None
        self.blocks = nn.ModuleList(blocks[stage * per : (stage + 1) * per])
        self.ln = ln if stage == stages - 1 else None
        self.head = head if stage == stages - 1 else None

    def forward(self, x):
        if self.emb is not None:
            x = self.emb(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)) if self.head is not None else x


def loss_fn(out, target):
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "interleaved-1f1b"))
    parser.add_argument(
        "--stages-per-rank", type=int, default=1, help="with interleaved-1f1b: stages a rank"
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--budget",
        type=float,
        default=0.5,
        help="where the rank's budget lies from the least any plan reaches (0) to keep-all (1)",
    )
    args = parser.parse_args()
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    device = device or torch.device("cpu")
    pipeline = ss.PipelineSchedule(
        args.schedule, world * args.stages_per_rank, args.micro_batches, args.stages_per_rank
    )
    mine = pipeline.stages_of(rank)  # rank, rank + world, ... (torch's order)
    last = pipeline.stages - 1
    modules = [Stage(s, pipeline.stages, args.layers).to(device) for s in mine]
    stages = [PipelineStage(m, s, pipeline.stages, device) for m, s in zip(modules, mine)]
    if args.schedule == "interleaved-1f1b":
        schedule = ScheduleInterleaved1F1B(stages, args.micro_batches, loss_fn=loss_fn)
    else:
        runs = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[args.schedule]
        schedule = runs(stages[0], args.micro_batches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)

    # this rank's stages, each profiled on one micro-batch, planned together for the schedule
    per_batch = BATCH // args.micro_batches
    hw = None if cuda else "cpu-emulated-link"
    graphs, held, returned = [], [], []
    for s, module in zip(mine, modules):
        if s == 0:
            example = x[:per_batch]
        else:
            example = torch.randn(per_batch, SEQ, WIDTH, device=device, requires_grad=True)
        if s == last:

            def profile_loss(out):
                return loss_fn(out, y[:per_batch])

        else:

            def profile_loss(out):
                return out.sum()  # its backward saves nothing: the stage's own saves stand

        graphs.append(ss.profile(module, example, profile_loss))
        # torch's schedule keeps each micro-batch's output until its backward, and the last
        # stage's to return them merged
        with torch.no_grad():
            output = module(example).untyped_storage().nbytes()
        held.append(output)
        returned.append(output if s == last else 0)
    kw = {"held_bytes": held, "returned_bytes": returned}
    low = ss.smallest_rank_peak(graphs, pipeline, rank, hw, **kw)
    high = ss.keep_all_rank_peak(graphs, pipeline, rank, hw, **kw)
    budget = int(low + args.budget * (high - low))
    stage_plans = ss.plan_rank(graphs, budget, pipeline, rank, hw, **kw)
    predicted = ss.simulate_rank(graphs, stage_plans)
    for stage_plan in stage_plans:
        plan = stage_plan.plans[0]  # (micro-batch 0's: the later ones may keep more)
        print(
            f"rank {rank}, stage {stage_plan.stage}: {plan.count('keep')} keep, "
            f"{plan.count('swap')} swap, {plan.count('recompute')} recompute in micro-batch 0",
            flush=True,
        )
    print(
        f"rank {rank}: peak {predicted.peak_bytes / 2**20:.2f} MiB of "
        f"{budget / 2**20:.2f} MiB ({pipeline.in_flight_on_rank(rank)} in flight)",
        flush=True,
    )

    # one context per stage module: each micro-batch runs its own plan
    contexts = [ss.apply(p, m, graph=gr) for p, m, gr in zip(stage_plans, modules, graphs)]
    for step in range(args.steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with contextlib.ExitStack() as stack:
            if step > 0:  # the first step: torch's shape inference, run plainly
                for context in contexts:
                    stack.enter_context(context)
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                losses: list = []
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
        optimizer.step()
        note = "" if step > 0 else " (plain: the schedule's first step)"
        print(f"rank {rank} step {step}: {1e3 * (time.perf_counter() - start):.1f} ms{note}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
