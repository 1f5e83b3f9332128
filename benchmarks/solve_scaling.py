"""Exact-planner solve time against the number of layers, per backend.

    python benchmarks/solve_scaling.py [--layers 1,2,4,8,16] [--solvers cpsat,cbc,highs]
        [--time-limit 60] [--budgets 0.4,0.2] [--json benchmarks/results/solve_scaling.json]
    python benchmarks/solve_scaling.py --size-goals   # 640 layers and 50,000 ops, against goals

A GPT-style transformer (hidden 1024, seq 1024, batch 4, no dropout: 12 saved tensors per layer)
on a100-80gb-pcie4. Prints and saves, per (budget, layers, solver): saved tensors, model size, wall
time, status, the gap on the step and on the overhead ("optimal": within 1% of the overhead), and
simulated retention beside the heuristic's and the LP bound. Also plots wall time
against layers (PNG next to the JSON).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import slackswap as ss


def config(layers: int) -> ss.TransformerConfig:
    return ss.TransformerConfig(
        layers=layers,
        hidden=1024,
        heads=16,
        ffn=4096,
        seq_len=1024,
        micro_batch=4,
        vocab=0,
        dropout=0.0,
        causal=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", default="1,2,4,8,16,32")
    parser.add_argument("--solvers", default="cpsat,cbc,highs")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument(
        "--budgets",
        default="0.4,0.2",
        help="fractions of the keep-all peak (or 1.05x the smallest feasible)",
    )
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/solve_scaling.json"))
    parser.add_argument(
        "--size-goals",
        action="store_true",
        help="only the size goals: 640 layers (heuristic, LP bound, exact at "
        "120 s) and a 50,000-op graph through the heuristic",
    )
    parser.add_argument(
        "--size-goal",
        choices=["640", "50k"],
        help="one part of --size-goals (each runs in its own process)",
    )
    args = parser.parse_args()
    hw = ss.hardware("a100-80gb-pcie4")
    if args.size_goal:
        budget = float(args.budgets.split(",")[0])
        return _goals_640_layers(hw, budget) if args.size_goal == "640" else _goal_50k(hw, budget)
    if args.size_goals:
        return size_goals(float(args.budgets.split(",")[0]))
    rows = []
    for fraction, layers in [
        (float(b), int(x)) for b in args.budgets.split(",") for x in args.layers.split(",")
    ]:
        g = ss.transformer_graph(config(layers), hw, name=f"gpt-{layers}L")
        # the fraction of the keep-all peak, or just above the smallest feasible budget
        budget = max(ss.parse_budget(fraction, g, hw), int(1.05 * ss.min_budget(g, hw)))
        heuristic = ss.simulate(g, ss.solve(g, budget, hw, solver="heuristic"), hw).retention
        bound = ss.lp_bound(g, budget, hw).retention
        for solver in args.solvers.split(","):
            plan = ss.solve(g, budget, hw, solver=solver, time_limit_s=args.time_limit)
            sim = ss.simulate(g, plan, hw)
            row = {
                "budget": fraction,
                "budget_bytes": budget,
                "budget_of_peak": budget / ss.keep_all_peak(g, hw),
                "overhead_gap": plan.info.overhead_gap,
                "layers": layers,
                "saved_tensors": int(len(g.saved)),
                "solver": solver,
                "binaries": plan.info.extra.get("model", {}).get("binaries"),
                "strategy": plan.info.extra.get("strategy"),
                "wall_s": plan.info.wall_s,
                "status": plan.info.status,
                "gap": plan.info.gap,
                "retention": sim.retention,
                "heuristic_retention": heuristic,
                "lp_bound_retention": bound,
                "warm_start": plan.info.extra.get("warm_start"),
                "warm_start_retention": g.ideal_step_time_s
                / plan.info.extra["warm_start_step_time_s"]
                if plan.info.extra.get("warm_start_step_time_s")
                else None,
            }
            rows.append(row)
            gap = "-" if row["gap"] is None else f"{100 * row['gap']:.3f}%"
            ogap = "-" if row["overhead_gap"] is None else f"{100 * row['overhead_gap']:.2f}%"
            print(
                f"{fraction:4.0%} {layers:4d} layers {row['saved_tensors']:5d} saved  {solver:6s} "
                f"{row['wall_s']:7.2f} s  {row['status']:9s} gap {gap:>8s} (overhead {ogap:>7s})  retention "
                f"{100 * sim.retention:6.2f}% (heuristic {100 * heuristic:6.2f}%, LP bound "
                f"{100 * bound:6.2f}%)",
                flush=True,
            )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    from results_md import command_line, markdown_table, write_section

    table = markdown_table(
        [
            "budget",
            "layers",
            "saved",
            "solver",
            "wall s",
            "status",
            "gap",
            "overhead gap",
            "exact",
            "warm start",
            "heuristic",
            "LP bound",
        ],
        [
            [
                f"{r['budget']:.0%} ({r['budget_of_peak']:.0%})",
                r["layers"],
                r["saved_tensors"],
                r["solver"],
                f"{r['wall_s']:.1f}",
                r["status"],
                "-" if r["gap"] is None else f"{100 * r['gap']:.2f}%",
                "-" if r["overhead_gap"] is None else f"{100 * r['overhead_gap']:.2f}%",
                f"{100 * r['retention']:.2f}%",
                r["warm_start"] or "-",
                f"{100 * r['heuristic_retention']:.2f}%",
                f"{100 * r['lp_bound_retention']:.2f}%",
            ]
            for r in rows
        ],
    )
    write_section(
        "solve_scaling",
        "Exact planner: solve time against size",
        command_line(),
        table + "\n\nGPT-style layers (hidden 1024, seq 1024, batch 4); budget: the "
        "fraction of the keep-all peak asked for (in brackets the budget used, when "
        "1.05x the smallest feasible budget is larger). gap: proven distance of the step "
        "time to the best bound; overhead gap: the same over the overhead (step less "
        'ideal); "optimal" means within 1% of the overhead.\n\n'
        "![solve time](results/solve_scaling.png)",
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for solver in args.solvers.split(","):
            for fraction in sorted({r["budget"] for r in rows}):
                pts = [
                    (r["saved_tensors"], r["wall_s"])
                    for r in rows
                    if r["solver"] == solver and r["budget"] == fraction
                ]
                ax.plot(*zip(*pts), marker="o", label=f"{solver} {fraction:.0%}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("saved tensors")
        ax.set_ylabel("solve wall time (s)")
        ax.set_title("Exact planner solve time")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.json.with_suffix(".png"), dpi=120)
    except ImportError:
        pass
    return 0


def _timed(fn):
    import time

    began = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - began


def _goals_640_layers(hw, budget: float) -> int:
    g = ss.transformer_graph(config(640), hw, name="gpt-640L")
    print(f"640 layers: {g.n_ops} ops, {len(g.saved)} saved tensors", flush=True)
    _, wall = _timed(lambda: ss.solve(g, budget, hw, solver="heuristic"))
    print(f"  heuristic solve(): {wall:.1f} s (goal < 2 s)", flush=True)
    bound, wall = _timed(lambda: ss.lp_bound(g, budget, hw))
    print(f"  lp_bound: {wall:.1f} s, {bound.status} (goal < 30 s)", flush=True)
    plan, wall = _timed(lambda: ss.solve(g, budget, hw, time_limit_s=120))
    gap = plan.info.overhead_gap
    print(
        f"  exact, 120 s limit: {wall:.1f} s, {plan.info.status}, overhead gap "
        f"{'-' if gap is None else f'{100 * gap:.1f}%'} (goal < 5%)",
        flush=True,
    )
    extra = plan.info.extra
    coarse = extra.get("coarse", {})
    overhead = plan.info.predicted_step_time_s / g.ideal_step_time_s - 1
    print(
        f"    overhead {100 * overhead:.2f}% of the ideal step; warm start: "
        f"{extra.get('warm_start', '-')}; coarse start: {coarse.get('status', '-')}"
        + (
            f" ({coarse['blocks']} of {coarse['of']} repeated blocks, {coarse['wall_s']:.1f} s)"
            if "blocks" in coarse
            else ""
        ),
        flush=True,
    )
    return 0


def _goal_50k(hw, budget: float) -> int:
    big = ss.transformer_graph(config(5000), hw, name="gpt-5000L")
    _, wall = _timed(lambda: ss.solve(big, budget, hw, solver="heuristic"))
    print(f"{big.n_ops} ops: heuristic solve(): {wall:.1f} s (goal < 10 s)", flush=True)
    return 0


def size_goals(budget: float) -> int:
    """The size goals, measured: each figure beside its goal, with the graph's size. Each part
    runs in a fresh process, as a user runs it: after the 640-layer exact solve in the same
    process the 50,003-op heuristic took 12.5 s instead of 8 s (README, Known limits)."""
    import subprocess
    import sys

    for part in ("640", "50k"):
        done = subprocess.run(
            [sys.executable, __file__, "--size-goal", part, "--budgets", str(budget)], check=False
        )
        if done.returncode:
            return done.returncode
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
