"""The executor on CPU: host time over plain training, and rebuilds against torch's selective
checkpointing.

    python benchmarks/executor_cpu.py [--width 256] [--rounds 7] [--block 40]
        [--json benchmarks/results/executor_cpu_w256.json]
    python benchmarks/executor_cpu.py --width 32 --seq 16 --batch 2

A GPT-style model (4 blocks, dropout 0.1) on CPU, every figure the median of paired rounds: in
each round, ``--block`` plain steps and ``--block`` steps under one context (``ss.apply``)
back to back, so that the drift of a shared machine between seconds cancels out.
- keep-all: the host time per forward op over plain (the first step of a context is checked,
  the others run untraced);
- a swap plan (every other saved tensor offloaded, on the ``cpu-emulated-link`` preset): its
  later steps run with hooks alone; the host time per forward op over plain, with the copies'
  own time excluded (the time inside the lanes' copy calls, ``RunStats.copy_s``, which on a CPU
  are the copies themselves, is subtracted and given beside it);
- torch's saved-tensor hooks alone (identity pack and unpack) over plain: torch's own cost of
  calling Python at every save and unpack, the part of the swap plan's host time no hook can
  save;
- a recompute plan (the heuristic's on the ``cpu`` preset, at a budget half way between the
  smallest a plan fits and the keep-all peak) against torch.utils.checkpoint's selective
  checkpointing with the same keep/recompute decisions (``ss.checkpoint_policy``), paired the
  same way;
- the executor's tracked peak against the budget.
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


def paired(first, second, rounds: int) -> list[tuple[float, float, dict]]:
    """(first's seconds, second's seconds, what second returned) per round, back to back."""
    first(), second()  # warm both
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        first()
        a = time.perf_counter() - start
        start = time.perf_counter()
        extra = second() or {}
        b = time.perf_counter() - start
        out.append((a, b, extra))
    return out


def median(values) -> float:
    return float(statistics.median(values))


def quartiles(values: list[float]) -> list[float]:
    """The first and third quartiles."""
    q = statistics.quantiles(values, n=4)
    return [float(q[0]), float(q[2])]


def time_in_hooks(model, graph, plan, step, steps: int) -> tuple[float, float]:
    """The median over ``steps`` later steps of one context of the time spent inside
    slackswap's own hooks (a step of hooks alone's pack and unpack, the context's forward and
    backward hooks), and of the copies' time within it, in seconds per step. A clock around each
    hook call, whose own cost (about 0.2 us a call) is counted in: not the paired rounds' noise
    of a shared machine, and not torch's own cost of calling Python hooks."""
    from slackswap.runtime.executor import Run
    from slackswap.runtime.hooked_step import HookedStep

    spent = [0.0]
    wrapped = [(HookedStep, n) for n in ("pack", "unpack")] + [
        (Run, n) for n in ("begin_forward", "backward_called", "forward_returned", "forward_left")
    ]
    originals = {(cls, name): getattr(cls, name) for cls, name in wrapped}

    def clocked(method):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        return call

    for (cls, name), method in originals.items():
        setattr(cls, name, clocked(method))
    per_step, copies = [], []
    try:
        with ss.apply(plan, model, graph=graph) as run:
            step()
            step()
            for _ in range(steps):
                spent[0], before = 0.0, run.stats.copy_s
                step()
                per_step.append(spent[0])
                copies.append(run.stats.copy_s - before)
    finally:
        for (cls, name), method in originals.items():
            setattr(cls, name, method)
    return median(per_step), median(copies)


def identity_hooks_block(step, steps: int):
    """``steps`` steps under saved-tensor hooks that do nothing (pack returns the tensor, unpack
    returns it): torch's own cost of calling Python at every save and every unpack, which any
    plan acting at saves pays before its hooks do anything (the floor of a swap plan's host
    time)."""

    def pack(t):
        return t

    def unpack(t):
        return t

    def block():
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            for _ in range(steps):
                step()

    return block


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7, help="paired rounds")
    parser.add_argument("--block", type=int, default=40, help="training steps per round")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.json is None:
        args.json = Path(f"benchmarks/results/executor_cpu_w{args.width}.json")
    torch.manual_seed(0)
    model = TinyGPT(vocab=512, d=args.width, layers=args.layers, p=0.1)
    idx = torch.randint(0, 512, (args.batch, args.seq))

    def loss_fn(out):
        return out.logsumexp(-1).mean()

    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(model(idx)).backward()

    graph = ss.profile(model, idx, loss_fn, warmup=1, repeat=3, name="tiny-gpt")
    n_ops = graph.n_ops
    # a CPU device has no host to swap to: the planner keeps and recomputes only
    cpu = ss.hardware("cpu")
    keep_all = ss.keep_all_peak(graph, cpu)
    smallest = ss.min_budget(graph, cpu)
    budget = smallest + (keep_all - smallest) // 2  # inside the reachable range at any width
    keep = ss.solve(graph, 1.0, cpu, solver="keep-all")
    rec = ss.solve(graph, budget, cpu, solver="heuristic")
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

    def plain_block():
        for _ in range(args.block):
            step()

    def under(plan):
        def block():
            with ss.apply(plan, model, graph=graph) as run:
                start = time.perf_counter()
                step()  # the context's checked first step
                first = time.perf_counter() - start
                for _ in range(args.block - 1):
                    step()
            return {"stats": run.stats, "first_s": first}

        return block

    policy = ss.checkpoint_policy(rec, graph)
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    def sac_block():
        for _ in range(args.block):
            model.zero_grad(set_to_none=True)
            out = checkpoint(
                model,
                idx,
                use_reentrant=False,
                context_fn=partial(create_selective_checkpoint_contexts, policy),
            )
            loss_fn(out).backward()

    per_op = 1e6 / args.block / n_ops
    keep_rounds = paired(plain_block, under(keep), args.rounds)
    swap_rounds = paired(plain_block, under(swaps), args.rounds)
    rec_rounds = paired(sac_block, under(rec), args.rounds)
    floor_rounds = paired(plain_block, identity_hooks_block(step, args.block), args.rounds)
    stats = swap_rounds[-1][2]["stats"]
    hooks_s, hooks_copies_s = time_in_hooks(model, graph, swaps, step, 4 * args.block)
    plain_s = median(a for a, _, _ in keep_rounds + swap_rounds) / args.block
    row = {
        "model": {"width": args.width, "layers": args.layers, "seq": args.seq, "batch": args.batch},
        "forward_ops": int(n_ops),
        "saved_tensors": int(len(graph.saved)),
        "block_steps": args.block,
        "rounds": args.rounds,
        "plain_step_s": plain_s,
        "keep_all_us_per_op": median((b - a) * per_op for a, b, _ in keep_rounds),
        "keep_all_untraced_steps": keep_rounds[-1][2]["stats"].untraced_steps,
        "swapped": swaps.count("swap"),
        "swap_plan_us_per_op": median((b - a) * per_op for a, b, _ in swap_rounds),
        "swap_host_us_per_op": median(
            (b - a - e["stats"].copy_s) * per_op for a, b, e in swap_rounds
        ),
        "swap_copies_us_per_op": median(e["stats"].copy_s * per_op for _, _, e in swap_rounds),
        # the same, less the context's first (checked) step: what every later step costs
        "swap_host_later_steps_us_per_op": median(
            (b - e["first_s"] - a * (args.block - 1) / args.block - e["stats"].copy_s)
            * 1e6
            / (args.block - 1)
            / n_ops
            for a, b, e in swap_rounds
        ),
        "swap_first_step_ms": 1e3 * median(e["first_s"] for _, _, e in swap_rounds),
        # time_in_hooks: inside slackswap's hooks, copies excluded, per forward op
        "swap_in_hooks_host_us_per_op": 1e6 * (hooks_s - hooks_copies_s) / n_ops,
        # torch's saved-tensor hooks doing nothing, over plain: what any hook on every save costs
        "identity_hooks_us_per_op": median((b - a) * per_op for a, b, _ in floor_rounds),
        # the spread of the paired rounds (a shared machine's noise): quartiles of the swap
        # plan's host time per op
        "swap_host_us_per_op_quartiles": quartiles(
            [(b - a - e["stats"].copy_s) * per_op for a, b, e in swap_rounds]
        ),
        "swap_hooked_steps": stats.hooked_steps,
        "recompute_budget_bytes": int(budget),
        "smallest_budget_bytes": int(smallest),
        "keep_all_peak_bytes": int(keep_all),
        "recomputed": rec.count("recompute"),
        "recompute_plan_over_torch_sac": median(b / a for a, b, _ in rec_rounds),
        "recompute_plan_step_s": median(b for _, b, _ in rec_rounds) / args.block,
        "torch_sac_same_decisions_step_s": median(a for a, _, _ in rec_rounds) / args.block,
        "tracked_peak_bytes": rec_rounds[-1][2]["stats"].peak_activation_bytes,
        "simulated_peak_bytes": ss.simulate(graph, rec).peak_bytes,
    }
    lines = [
        f"plain step                        {1e3 * plain_s:8.2f} ms ({n_ops} forward ops)",
        f"keep-all, over plain              {row['keep_all_us_per_op']:8.2f} us per forward op",
        f"swap plan ({row['swapped']} of {row['saved_tensors']} swapped), host  "
        f"{row['swap_host_us_per_op']:8.2f} us per forward op over plain, copies excluded "
        f"(copies {row['swap_copies_us_per_op']:.2f} us per op; "
        f"{row['swap_plan_us_per_op']:.2f} with them; quartiles "
        f"{row['swap_host_us_per_op_quartiles'][0]:.2f}-"
        f"{row['swap_host_us_per_op_quartiles'][1]:.2f}); later steps alone "
        f"{row['swap_host_later_steps_us_per_op']:.2f} (first step "
        f"{row['swap_first_step_ms']:.1f} ms); inside slackswap's hooks "
        f"{row['swap_in_hooks_host_us_per_op']:.2f}",
        f"torch's saved-tensor hooks doing nothing, over plain  "
        f"{row['identity_hooks_us_per_op']:.2f} us per forward op",
        f"recompute plan ({row['recomputed']} recomputed) / torch SAC, same decisions  "
        f"{row['recompute_plan_over_torch_sac']:.3f}x "
        f"({1e3 * row['recompute_plan_step_s']:.2f} vs "
        f"{1e3 * row['torch_sac_same_decisions_step_s']:.2f} ms)",
        f"tracked / simulated peak          {row['tracked_peak_bytes'] / 2**20:.2f} / "
        f"{row['simulated_peak_bytes'] / 2**20:.2f} MiB (budget {budget / 2**20:.2f} MiB, "
        f"keep-all {keep_all / 2**20:.2f}, smallest {smallest / 2**20:.2f})",
    ]
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(row, indent=1))
    from results_md import command_line, markdown_table, write_section

    write_section(
        f"executor_cpu_w{args.width}",
        f"Executor on CPU (width {args.width}, seq {args.seq}, batch {args.batch})",
        command_line(),
        markdown_table(
            ["what", "figure"],
            [
                ["plain step", f"{1e3 * plain_s:.2f} ms ({n_ops} forward ops)"],
                [
                    "keep-all, one context over "
                    f"{args.block} steps (median of {args.rounds} paired rounds)",
                    f"{row['keep_all_us_per_op']:.2f} us per forward op over plain",
                ],
                [
                    f"swap plan ({row['swapped']} of {row['saved_tensors']} swapped, emulated "
                    "link), later steps with hooks alone",
                    f"host {row['swap_host_us_per_op']:.2f} us per forward op over plain, "
                    f"copies excluded (the copies: {row['swap_copies_us_per_op']:.2f} us per "
                    f"op; {row['swap_plan_us_per_op']:.2f} with them); quartiles of the "
                    f"rounds {row['swap_host_us_per_op_quartiles'][0]:.2f}-"
                    f"{row['swap_host_us_per_op_quartiles'][1]:.2f}; the later steps alone "
                    f"{row['swap_host_later_steps_us_per_op']:.2f} (the checked first step: "
                    f"{row['swap_first_step_ms']:.1f} ms); inside slackswap's own hooks "
                    f"(a clock around each call, its own cost counted in) "
                    f"{row['swap_in_hooks_host_us_per_op']:.2f}",
                ],
                [
                    "torch's saved-tensor hooks alone (pack and unpack return the tensor: "
                    "torch's cost of calling Python at every save and unpack, a floor of any "
                    "plan that acts at saves), same paired rounds",
                    f"{row['identity_hooks_us_per_op']:.2f} us per forward op over plain",
                ],
                [
                    f"recompute plan ({row['recomputed']} recomputed) / torch selective "
                    "checkpointing, same decisions",
                    f"{row['recompute_plan_over_torch_sac']:.3f}x "
                    f"({1e3 * row['recompute_plan_step_s']:.2f} vs "
                    f"{1e3 * row['torch_sac_same_decisions_step_s']:.2f} ms)",
                ],
                [
                    "tracked / simulated peak of the recompute plan",
                    f"{row['tracked_peak_bytes'] / 2**20:.2f} / "
                    f"{row['simulated_peak_bytes'] / 2**20:.2f} MiB (budget "
                    f"{budget / 2**20:.2f} MiB: half way from the smallest, "
                    f"{smallest / 2**20:.2f}, to keep-all, {keep_all / 2**20:.2f})",
                ],
            ],
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
