"""Pipeline stages: the GPT-2 XL workload split into 4 stages under 1F1B with 8 micro-batches,
every stage at one budget (half of stage 0's keep-all peak under the schedule), planned by
slackswap against what users configure by hand.

    python benchmarks/pipeline_stages.py [--workload gpt2-xl] [--stages 4] [--micro-batches 8]
        [--schedule 1f1b|gpipe|interleaved-1f1b] [--stages-per-rank 1] [--fraction 0.5]
        [--time-limit 20] [--collectives-on-link]

With ``--collectives-on-link`` the messages between stages (the residual stream and its
gradient) cross the host link beside the plans' copies (PCIe nodes without NVLink).

For each way of running the stages, every stage's predicted peak under the schedule (the
step model composed over the schedule: formulations/pipeline.md), whether it fits, and the
pipeline's predicted step and throughput (tokens per second, the whole batch over the step):

- keep-all on every stage (the budget is not met where the first stages hold more);
- recompute everything: every stage whose keep-all does not fit its budget reruns every
  tensor it can rebuild (Megatron's full recompute), the others keep all;
- offload everything: those stages swap every saved tensor instead;
- slackswap, the heuristic (``ss.plan_for_stages``), and the exact planner (cpsat) at the
  one-step budget the heuristic's search found.

Predictions of the step model on the hardware preset; no GPU measured them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import slackswap as ss

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_md import command_line, markdown_table, write_section  # noqa: E402


def by_hand(graphs, schedule, budget, hw, solver: str) -> list[ss.StagePlan]:
    """``solver`` ("recompute-all", "swap-all") on every stage of a rank whose keep-all does
    not fit."""
    out = {}
    for r in range(schedule.ranks):
        mine = schedule.stages_of(r)
        fits = ss.keep_all_rank_peak([graphs[s] for s in mine], schedule, r, hw) <= budget
        for s in mine:
            g = graphs[s]
            keep = ss.solve(g, 1.0, hw, solver="keep-all")
            p = keep if fits else ss.solve(g, 1.0, hw, solver=solver, strict=False)
            out[s] = ss.StagePlan(s, schedule, (p,) * schedule.micro_batches, budget)
    return [out[s] for s in range(len(graphs))]


def row(name: str, graphs, stage_plans, tokens: int, wall_s: float | None) -> dict:
    result = ss.simulate_pipeline(graphs, stage_plans)
    return {
        "plan": name,
        "stage_peaks_bytes": [s.peak_bytes for s in result.stages],
        "fits": [s.fits for s in result.stages],
        "step_s": result.step_s,
        "ideal_step_s": result.ideal_step_s,
        "tokens_per_s": tokens / result.step_s,
        "of_ideal": result.ideal_step_s / result.step_s,
        "decisions": [
            {d: sp.plans[0].count(d) for d in ("keep", "swap", "recompute")} for sp in stage_plans
        ],
        "distinct_plans_per_stage": [len({id(p) for p in sp.plans}) for sp in stage_plans],
        "wall_s": wall_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="gpt2-xl")
    parser.add_argument("--hardware", default="a100-80gb-pcie4")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "interleaved-1f1b"))
    parser.add_argument("--stages-per-rank", type=int, default=1)
    parser.add_argument("--collectives-on-link", action="store_true")
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    variant = "" if args.schedule == "1f1b" else "_" + args.schedule.replace("-", "_")
    variant += "_link" if args.collectives_on_link else ""
    if args.json is None:
        args.json = Path(f"benchmarks/results/pipeline_stages{variant}.json")
    hw = ss.hardware(args.hardware)
    if args.collectives_on_link:
        hw = hw.with_link(name=f"{hw.name}-comms-on-link", collectives_on_link=True)
    graphs = ss.workload_stages(args.workload, args.stages, hw)
    schedule = ss.PipelineSchedule(
        args.schedule, args.stages, args.micro_batches, args.stages_per_rank
    )
    keep_peaks = [
        ss.keep_all_rank_peak([graphs[s] for s in schedule.stages_of(r)], schedule, r, hw)
        for r in range(schedule.ranks)
    ]
    budget = int(args.fraction * keep_peaks[0])
    config = ss.WORKLOADS[args.workload]
    tokens = args.micro_batches * config.micro_batch * config.seq_len
    rows = []
    keep = [
        ss.StagePlan(
            s, schedule, (ss.solve(g, 1.0, hw, solver="keep-all"),) * args.micro_batches, budget
        )
        for s, g in enumerate(graphs)
    ]
    rows.append(row("keep-all", graphs, keep, tokens, None))
    rows.append(
        row("recompute everything", graphs, by_hand(graphs, schedule, budget, hw, "recompute-all"),
            tokens, None)
    )  # fmt: skip
    rows.append(
        row("offload everything", graphs, by_hand(graphs, schedule, budget, hw, "swap-all"),
            tokens, None)
    )  # fmt: skip
    for solver in ("heuristic", "cpsat"):
        start = time.perf_counter()
        stage_plans = ss.plan_for_stages(
            graphs, budget, schedule, hw, solver=solver, time_limit_s=args.time_limit
        )
        rows.append(
            row(f"slackswap ({solver})", graphs, stage_plans, tokens, time.perf_counter() - start)
        )
    gib = 2**30
    for r in rows:
        peaks = " / ".join(f"{p / gib:.2f}" for p in r["stage_peaks_bytes"])
        print(
            f"{r['plan']:26s} peaks {peaks} GiB, fits {all(r['fits'])}, step "
            f"{1e3 * r['step_s']:.1f} ms ({100 * r['of_ideal']:.2f}% of ideal), "
            f"{r['tokens_per_s']:.0f} tokens/s"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "workload": args.workload,
                "hardware": hw.name,
                "schedule": schedule.to_dict(),
                "budget_bytes": budget,
                "keep_all_stage_peaks_bytes": keep_peaks,
                "rows": rows,
            },
            indent=1,
        )
    )
    per_rank = f" ({args.stages_per_rank} a rank)" if args.stages_per_rank > 1 else ""
    link = ", messages between stages on the host link" if args.collectives_on_link else ""
    write_section(
        f"pipeline_stages{variant}",
        f"Pipeline stages: {args.workload} in {args.stages} stages{per_rank}, {args.schedule}, "
        f"{args.micro_batches} micro-batches{link}, every rank at {100 * args.fraction:.0f}% of "
        f"rank 0's keep-all ({budget / gib:.2f} GiB)",
        command_line(),
        markdown_table(
            [
                "plan",
                "rank peaks GiB",
                "all fit",
                "step ms",
                "of ideal",
                "tokens/s",
                "planned in s",
            ],
            [
                [
                    r["plan"],
                    " / ".join(f"{p / gib:.2f}" for p in r["stage_peaks_bytes"]),
                    "yes" if all(r["fits"]) else "no",
                    f"{1e3 * r['step_s']:.1f}",
                    f"{100 * r['of_ideal']:.2f}%",
                    f"{r['tokens_per_s']:.0f}",
                    "-" if r["wall_s"] is None else f"{r['wall_s']:.1f}",
                ]
                for r in rows
            ],
        )
        + "\n\nKeep-all rank peaks under the schedule: "
        + " / ".join(f"{p / gib:.2f}" for p in keep_peaks)
        + f" GiB ({', '.join(str(schedule.in_flight_on_rank(r)) for r in range(schedule.ranks))}"
        " micro-batches in flight). Micro-batches on a plan of their own (slackswap, "
        "heuristic): "
        + " / ".join(str(n) for n in rows[3]["distinct_plans_per_stage"])
        + " distinct plans per stage. Predictions of the step model for the "
        f"`{hw.name}` preset (formulations/pipeline.md); no GPU measured them.",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
