"""The executor on CPU: hook overhead, recompute against torch.utils.checkpoint, tracked memory.

    python benchmarks/executor_cpu.py [--steps 10] [--json benchmarks/results/executor_cpu.json]

A GPT-style model (4 blocks, width 256, sequence 128, batch 8, dropout 0.1) on CPU:
- plain training step time;
- under apply() with keep-all (the cost of tracing and hooks; goal under 3%), measured as the
  median ratio of back-to-back rounds (one context around a few steps, and one per step);
- with a recompute plan (the planner's, at 50% of the keep-all peak, offloading disabled by a
  slow-link preset) against torch.utils.checkpoint with the same recompute decisions
  (ss.checkpoint_policy);
- the executor's tracked peak activation bytes against the budget.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

import slackswap as ss

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from models import TinyGPT  # noqa: E402


def timed(fn, steps: int) -> float:
    fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_overhead(plain, other, rounds: int) -> tuple[float, float, float]:
    """Median of per-round time ratios other/plain, the two run back to back in each round: on a
    shared 2-core machine the step time drifts by several percent between seconds, which a
    comparison of separate medians would read as overhead."""
    plain(), other()
    ratios, plain_times, other_times = [], [], []
    for _ in range(rounds):
        start = time.perf_counter()
        plain()
        a = time.perf_counter() - start
        start = time.perf_counter()
        other()
        b = time.perf_counter() - start
        ratios.append(b / a)
        plain_times.append(a)
        other_times.append(b)
    return (
        statistics.median(ratios) - 1.0,
        statistics.median(plain_times),
        statistics.median(other_times),
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=15, help="paired rounds for the overhead")
    parser.add_argument("--block", type=int, default=4, help="training steps per round")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/executor_cpu.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyGPT(vocab=512, d=args.width, layers=args.layers, p=0.1)
    idx = torch.randint(0, 512, (args.batch, args.seq))

    def loss_fn(out):
        return out.logsumexp(-1).mean()

    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(model(idx)).backward()

    graph = ss.profile(model, idx, loss_fn, warmup=1, repeat=3, name="tiny-gpt")
    # a CPU device has no host to swap to: the planner keeps and recomputes only
    slow = ss.hardware("cpu")
    keep = ss.solve(graph, 1.0, slow, solver="keep-all")
    plan = ss.solve(graph, 0.5, slow, solver="heuristic")

    def under(p):
        def run():
            with ss.apply(p, model, graph=graph) as r:
                step()
            return r

        return run

    def block_plain():
        for _ in range(args.block):
            step()

    def block_applied():  # the usual use: one context around the training loop
        with ss.apply(keep, model, graph=graph):
            for _ in range(args.block):
                step()

    def block_per_step():  # a context entered for every step
        for _ in range(args.block):
            under(keep)()

    # a plan that swaps (on the emulated link; nothing rebuilt): its later steps are skimmed
    emulated = ss.hardware("cpu-emulated-link")
    swaps = ss.complete(
        ss.Plan(
            graph.name,
            graph.digest,
            10**12,
            {
                graph.tensors[t].name: ("swap" if i % 2 else "keep")
                for i, t in enumerate(graph.saved)
            },
        ),
        graph,
        emulated,
    )

    def block_swapping():
        with ss.apply(swaps, model, graph=graph):
            for _ in range(args.block):
                step()

    swap_overhead, _, swap_block = paired_overhead(block_plain, block_swapping, args.rounds)
    overhead, plain_block, keep_block = paired_overhead(block_plain, block_applied, args.rounds)
    overhead_per_step, _, _ = paired_overhead(block_plain, block_per_step, args.rounds)
    plain, keep_s = plain_block / args.block, keep_block / args.block
    rec_s = timed(under(plan), args.steps)
    run = under(plan)()
    policy = ss.checkpoint_policy(plan, graph)
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    def ckpt_step():
        model.zero_grad(set_to_none=True)
        out = checkpoint(
            model,
            idx,
            use_reentrant=False,
            context_fn=partial(create_selective_checkpoint_contexts, policy),
        )
        loss_fn(out).backward()

    try:
        ckpt_s = timed(ckpt_step, args.steps)
    except RuntimeError as exc:  # torch refuses some policies on models that mutate in place
        print(f"torch.utils.checkpoint with the plan's policy failed: {exc}")
        ckpt_s = float("nan")
    sim = ss.simulate(graph, plan, slow)
    row = {
        "model": {"width": args.width, "layers": args.layers, "seq": args.seq, "batch": args.batch},
        "forward_ops": int(graph.n_ops),
        "overhead_us_per_op": overhead * plain / graph.n_ops * 1e6,
        "saved_tensors": int(len(graph.saved)),
        "recomputed": plan.count("recompute"),
        "plain_step_s": plain,
        "keep_all_step_s": keep_s,
        "hook_overhead": overhead,
        "hook_overhead_context_per_step": overhead_per_step,
        "recompute_plan_step_s": rec_s,
        "torch_checkpoint_same_tensors_step_s": ckpt_s,
        "swap_plan_step_s": swap_block / args.block,
        "swap_plan_overhead": swap_overhead,
        "swap_plan_us_per_op": swap_overhead * plain / graph.n_ops * 1e6,
        "swapped": swaps.count("swap"),
        "budget_bytes": plan.budget_bytes,
        "tracked_peak_bytes": run.stats.peak_activation_bytes,
        "simulated_peak_bytes": sim.peak_bytes,
        "keep_all_peak_bytes": ss.keep_all_peak(graph, slow),
    }
    print(f"plain step                 {1e3 * plain:8.2f} ms")
    print(
        f"apply(), keep-all          {1e3 * keep_s:8.2f} ms  (overhead {100 * overhead:+.1f}%, "
        f"{100 * overhead_per_step:+.1f}% with a context per step; median of {args.rounds} "
        f"paired rounds of {args.block} steps)"
    )
    print(f"  = {row['overhead_us_per_op']:.0f} us per forward op ({graph.n_ops} ops)")
    print(
        f"apply(), swap plan         {1e3 * row['swap_plan_step_s']:8.2f} ms  ({row['swapped']} "
        f"swapped on the emulated link: {row['swap_plan_us_per_op']:.0f} us per forward op, "
        "copies included)"
    )
    print(
        f"apply(), recompute plan    {1e3 * rec_s:8.2f} ms  ({row['recomputed']} of {row['saved_tensors']} tensors recomputed)"
    )
    print(f"torch checkpoint, same ops {1e3 * ckpt_s:8.2f} ms")
    print(
        f"tracked activation peak    {run.stats.peak_activation_bytes / 2**20:8.2f} MiB of budget "
        f"{plan.budget_bytes / 2**20:.2f} MiB (simulated {sim.peak_bytes / 2**20:.2f} MiB, keep-all "
        f"{row['keep_all_peak_bytes'] / 2**20:.2f} MiB)"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(row, indent=1))
    from results_md import command_line, markdown_table, write_section

    write_section(
        f"executor_cpu_w{args.width}",
        f"Executor on CPU (width {args.width}, seq {args.seq})",
        command_line(),
        markdown_table(
            ["what", "figure"],
            [
                ["plain step", f"{1e3 * plain:.2f} ms"],
                [
                    "apply(), keep-all",
                    f"{1e3 * keep_s:.2f} ms ({100 * overhead:+.1f}%, "
                    f"median of {args.rounds} paired rounds)",
                ],
                [
                    "overhead per forward op",
                    f"{row['overhead_us_per_op']:.0f} us ({graph.n_ops} ops)",
                ],
                [
                    "apply(), swap plan (half the saved tensors, emulated link)",
                    f"{1e3 * row['swap_plan_step_s']:.2f} ms ({row['swap_plan_us_per_op']:.0f} us "
                    "per forward op over plain, copies included)",
                ],
                ["apply(), recompute plan", f"{1e3 * rec_s:.2f} ms"],
                ["torch selective checkpointing, same decisions", f"{1e3 * ckpt_s:.2f} ms"],
                [
                    "tracked / simulated activation peak",
                    f"{run.stats.peak_activation_bytes / 2**20:.2f} / {sim.tensor_peak_bytes / 2**20:.2f} MiB "
                    f"(budget {plan.budget_bytes / 2**20:.2f} MiB)",
                ],
            ],
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
