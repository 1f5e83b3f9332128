"""The exact planner with and without its coarse start on deep graphs of repeated blocks.

    python benchmarks/coarse_start.py [--limit 120] [--layers 160,640] [--profiled-layers 48]
                                      [--results]

For each graph, the exact planner's plan with the coarse start (the default) and without
(``coarse=False``): overhead over the ideal step, overhead gap to the bound, the warm start it
came from, wall time. GPT-style analytic graphs (benchmarks/solve_scaling.py's family, on the
A100 PCIe 4.0 link) and a Hugging Face GPT-2 profiled at the aten level on this machine, planned
for this CPU (its recorded hardware: keep and recompute only). Writes benchmarks/results/coarse_start.json; with ``--results`` a
section of benchmarks/RESULTS.md too.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from solve_scaling import config

import slackswap as ss

HW = "a100-80gb-pcie4"


def profiled_gpt2(layers: int) -> ss.ActivationGraph:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=layers,
        n_embd=128,
        n_head=2,
        n_positions=128,
        vocab_size=1000,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = {"input_ids": torch.randint(0, 1000, (2, 128))}
    return ss.profile(model, ids, lambda o: o.logits.pow(2).mean(), warmup=1, repeat=3)


def row(
    name: str, g: ss.ActivationGraph, budget: float, limit: float, coarse: bool, hw: str | None
) -> dict:
    began = time.perf_counter()
    plan = ss.solve(g, budget, hw, time_limit_s=limit, coarse=coarse)
    wall = time.perf_counter() - began
    extra = plan.info.extra
    note = extra.get("coarse", {})
    out = {
        "graph": name,
        "ops": g.n_ops,
        "saved": int(len(g.saved)),
        "budget": budget,
        "coarse": coarse,
        "status": plan.info.status,
        "overhead_pct": 100 * (plan.info.predicted_step_time_s / g.ideal_step_time_s - 1),
        "overhead_gap_pct": None
        if plan.info.overhead_gap is None
        else 100 * plan.info.overhead_gap,
        "warm_start": extra.get("warm_start"),
        "coarse_note": note,
        "wall_s": wall,
    }
    gap = "-" if out["overhead_gap_pct"] is None else f"{out['overhead_gap_pct']:.1f}%"
    blocks = f"{note['blocks']}/{note['of']}" if "blocks" in note else note.get("status", "-")[:9]
    print(
        f"{name:16s} {g.n_ops:6d} {budget:4.0%} {'on' if coarse else 'off':>6s} "
        f"{out['overhead_pct']:8.3f}% {gap:>7s} {blocks:>9s} {wall:6.1f}s  "
        f"{out['warm_start']}",
        flush=True,
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=float, default=120.0)
    parser.add_argument("--budget", type=float, default=0.4)
    parser.add_argument("--layers", default="160,640")
    parser.add_argument("--profiled-layers", type=int, default=48)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/coarse_start.json"))
    parser.add_argument(
        "--results",
        action="store_true",
        help="also write the table as a section of benchmarks/RESULTS.md",
    )
    args = parser.parse_args()
    hw = ss.hardware(HW)
    graphs = [
        (f"gpt-{n}L", ss.transformer_graph(config(int(n)), hw), HW)
        for n in args.layers.split(",")
        if n
    ]
    if args.profiled_layers:
        # planned for the CPU it was profiled on (its recorded hardware): keep and recompute only
        graphs.append(
            (f"hf-gpt2-{args.profiled_layers}L-cpu", profiled_gpt2(args.profiled_layers), None)
        )
    print(
        f"{'graph':16s} {'ops':>6s} {'bdgt':>4s} {'coarse':>6s} {'overhead':>9s} {'gap':>7s} "
        f"{'blocks':>9s} {'wall':>7s}  warm start",
        flush=True,
    )
    rows = [
        row(name, g, args.budget, args.limit, coarse, plan_hw)
        for name, g, plan_hw in graphs
        for coarse in (True, False)
    ]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1, default=str))
    if not args.results:
        return 0
    from results_md import command_line, markdown_table, write_section

    table = markdown_table(
        [
            "graph",
            "ops",
            "budget",
            "coarse start",
            "overhead",
            "overhead gap",
            "blocks",
            "wall",
            "warm start",
        ],
        [
            [
                r["graph"],
                r["ops"],
                f"{r['budget']:.0%}",
                "on" if r["coarse"] else "off",
                f"{r['overhead_pct']:.3f}%",
                "-" if r["overhead_gap_pct"] is None else f"{r['overhead_gap_pct']:.1f}%",
                f"{r['coarse_note']['blocks']} of {r['coarse_note']['of']}"
                if "blocks" in r["coarse_note"]
                else r["coarse_note"].get("status", "-"),
                f"{r['wall_s']:.1f} s",
                r["warm_start"],
            ]
            for r in rows
        ],
    )
    write_section(
        "coarse_start", "Exact planner on deep graphs: the coarse start", command_line(), table
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
