"""Train a small Llama-style model with FSDP2 under one slackswap plan shared by every rank.

    torchrun --nproc_per_node 2 examples/fsdp_train.py [--steps 10] [--budget 0.5] [--layers 4]

Runs on CPU with the gloo backend and unchanged on GPUs with nccl (one GPU per rank). The model
is built from a transformers config (no download), every decoder layer and the root are wrapped
with ``fully_shard``; ``ss.plan_for_ranks`` profiles the step on every rank, agrees on one graph
(median op times), solves it on rank 0 and broadcasts the plan; ``ss.apply`` runs it. Each rank
prints its step time and tracked activation peak; rank 0 prints the plan.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import slackswap as ss


def build(layers: int, device: torch.device):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=344,
        vocab_size=1000,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.LlamaForCausalLM(cfg).to(device)
    model.train()
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--budget", type=float, default=0.5, help="fraction of the keep-all peak")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--solver", default="heuristic")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    from torch.distributed.fsdp import fully_shard

    model = build(args.layers, device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch(step: int) -> dict:
        g = torch.Generator().manual_seed(1000 * rank + step)
        ids = torch.randint(0, 1000, (args.batch, args.seq), generator=g).to(device)
        return {"input_ids": ids, "labels": ids}

    def loss_fn(out):
        return out.loss

    hw = ss.calibrate_link() if cuda else "cpu"
    began = time.perf_counter()
    graph, plan = ss.plan_for_ranks(
        model, batch(0), loss_fn, args.budget, hw, solver=args.solver, time_limit_s=20
    )
    planning_s = time.perf_counter() - began
    if rank == 0:
        kinds = {
            k: sum(d == k for d in plan.decisions.values()) for k in ("keep", "swap", "recompute")
        }
        sim = ss.simulate(graph, plan, plan.hardware)
        print(
            f"plan for {world} ranks: {len(graph.ops)} ops, {len(plan.decisions)} saved "
            f"tensors: {kinds}; budget {plan.budget_bytes / 2**20:.1f} MiB of "
            f"{ss.keep_all_peak(graph, plan.hardware) / 2**20:.1f} MiB keep-all; simulated "
            f"peak {sim.peak_bytes / 2**20:.1f} MiB, retention {100 * sim.retention:.1f}%; "
            f"planned in {planning_s:.1f} s ({plan.info.solver}, {plan.info.status})",
            flush=True,
        )
    dist.barrier()
    with ss.apply(plan, model, graph=graph) as run:
        for step in range(args.steps):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(**batch(step)))
            loss.backward()
            optimizer.step()
            if cuda:
                torch.cuda.synchronize()
            print(
                f"rank {rank} step {step}: loss {loss.item():.4f}, "
                f"{1e3 * (time.perf_counter() - start):.0f} ms, tracked activation peak "
                f"{run.stats.peak_activation_bytes / 2**20:.2f} MiB",
                flush=True,
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
