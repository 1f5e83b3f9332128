"""The reference table: the seed's three workloads, every planner, simulated side by side.

Run through benchmarks/paper_table.py. Rows carry each planner's result row (slackswap.result_row,
the schema compare() and the CLI's sweep use) under its key.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from slackswap import (
    InfeasibleBudget,
    hardware,
    is_available,
    keep_all_peak,
    lp_bound,
    parse_budget,
    result_row,
    solve,
    workload,
)

PAPER = {"bert-large": 96.3, "gpt2-xl": 97.6, "llama-7b": 99.6}
BASELINES = ("keep-all", "recompute-all", "swap-all")
PLANNERS = ("heuristic", "cpsat")


def table_rows(
    models=tuple(PAPER),
    budgets=(0.5,),
    hw_name="a100-80gb-pcie4",
    planners=PLANNERS,
    time_limit_s: float = 60.0,
    progress=None,
) -> list[dict]:
    """One row per (model, budget): the paper's figure, each planner's simulated retention (%),
    the LP bound, and each baseline's retention, step time, peak and stall."""
    hw = hardware(hw_name)
    planners = tuple(p for p in planners if is_available(p))
    rows = []
    for model in models:
        g = workload(model, hw)
        peak = keep_all_peak(g, hw)
        for fraction in budgets:
            budget = parse_budget(float(fraction), g, hw)
            row: dict = {
                "model": model,
                "budget_fraction": float(fraction),
                "budget_bytes": budget,
                "keep_all_peak_bytes": peak,
                "ideal_step_time_s": g.ideal_step_time_s,
                "paper_retention": PAPER.get(model) if abs(fraction - 0.5) < 1e-9 else None,
            }
            for name in planners + BASELINES:
                key = "optimal" if name == "cpsat" else name.replace("-", "_")
                try:
                    # the heuristic column is the published scheme (no polishing search)
                    plan = solve(
                        g,
                        budget,
                        hw,
                        solver=name,
                        strict=name not in BASELINES,
                        time_limit_s=time_limit_s if name == "cpsat" else None,
                        **({"polish": False} if name == "heuristic" else {}),
                    )
                except InfeasibleBudget:
                    row[f"{key}_retention"] = None
                    row[f"{key}_fits"] = False
                    continue
                result = result_row(g, plan)
                row[f"{key}_retention"] = 100.0 * result["retention"] if result["fits"] else None
                row[f"{key}_fits"] = result["fits"]
                row[f"{key}_step_time_s"] = result["step_time_s"]
                row[f"{key}_peak_bytes"] = result["peak_bytes"]
                row[f"{key}_stall_s"] = result["stall_s"]
                if name not in BASELINES:
                    row[f"{key}_solve_s"] = result["wall_s"]
                    row[f"{key}_status"] = result["status"]
                    row[f"{key}_gap"] = result["gap"]
                    row[f"{key}_overhead_gap"] = result["overhead_gap"]
                    if plan.info.bound:
                        row[f"{key}_bound_retention"] = 100.0 * min(
                            1.0, g.ideal_step_time_s / plan.info.bound
                        )
            row["lp_bound_retention"] = 100.0 * lp_bound(g, budget, hw).retention
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def _pct(value) -> str:
    return "  -  " if value is None else f"{value:6.2f}"


def _gap(value) -> str:
    return "" if value is None else f"{100 * value:6.3f}%"


def format_rows(rows: list[dict]) -> str:
    lines = []
    head = (
        f"{'model':<11} {'budget':>6} {'paper':>6} {'optimal':>7} {'heur.':>6} {'LP bd':>6} "
        f"{'rec-all':>7} {'swap-all':>8} {'keep-all':>8}  {'opt. solve':>10} {'gap':>7}"
    )
    lines.append(head)
    lines.append("-" * len(head))
    for r in rows:
        solve_s = r.get("optimal_solve_s")
        lines.append(
            f"{r['model']:<11} {100 * r['budget_fraction']:5.0f}% {_pct(r.get('paper_retention'))} "
            f"{_pct(r.get('optimal_retention')):>7} {_pct(r.get('heuristic_retention'))} "
            f"{_pct(r.get('lp_bound_retention'))} {_pct(r.get('recompute_all_retention')):>7} "
            f"{_pct(r.get('swap_all_retention')):>8} {_pct(r.get('keep_all_retention')):>8}  "
            f"{'' if solve_s is None else f'{solve_s:9.2f}s':>10} "
            f"{_gap(r.get('optimal_gap')):>7}"
        )
    lines.append(
        "retention in % of ideal throughput (simulated); '-' = does not fit the budget; "
        "gap: the optimal plan's proven distance to the best bound (LP, integral LP, MILP)"
    )
    return "\n".join(lines)


def format_details(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        lines.append(
            f"{r['model']} at {100 * r['budget_fraction']:.0f}%: keep-all peak "
            f"{r['keep_all_peak_bytes'] / 2**30:.2f} GiB, budget {r['budget_bytes'] / 2**30:.2f} GiB, "
            f"ideal step {1e3 * r['ideal_step_time_s']:.1f} ms"
        )
        for key in ("optimal", "heuristic") + tuple(b.replace("-", "_") for b in BASELINES):
            if f"{key}_step_time_s" not in r:
                continue
            fits = "" if r.get(f"{key}_fits") else "  (does not fit)"
            lines.append(
                f"  {key:<14} step {1e3 * r[f'{key}_step_time_s']:9.1f} ms  peak "
                f"{r[f'{key}_peak_bytes'] / 2**30:7.2f} GiB  stall "
                f"{1e3 * r[f'{key}_stall_s']:8.1f} ms{fits}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, help="write the rows as a JSON list to this path")
    parser.add_argument(
        "--sweep", action="store_true", help="budgets 20%% to 100%% in steps of 10%%"
    )
    parser.add_argument("--budgets", help="comma-separated fractions (default 0.5)")
    parser.add_argument("--hardware", default="a100-80gb-pcie4")
    parser.add_argument("--time-limit", type=float, default=60.0, help="per exact solve, seconds")
    parser.add_argument(
        "--results", action="store_true", help="write the table into benchmarks/RESULTS.md"
    )
    args = parser.parse_args(argv)
    budgets = [0.5]
    if args.sweep:
        budgets = [round(0.1 * k, 1) for k in range(2, 11)]
    elif args.budgets:
        budgets = [float(x) for x in args.budgets.split(",")]
    print(f"slackswap reference table: {args.hardware}, budgets {budgets}", file=sys.stderr)
    rows = table_rows(
        budgets=budgets,
        hw_name=args.hardware,
        time_limit_s=args.time_limit,
        progress=lambda r: print(
            f"  done {r['model']} at {r['budget_fraction']:.0%}", file=sys.stderr
        ),
    )
    print(format_rows(rows))
    print()
    print(format_details(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.results:
        from results_md import command_line, markdown_table, write_section

        table = markdown_table(
            [
                "model",
                "budget",
                "seed",
                "exact",
                "heuristic",
                "LP bound",
                "recompute-all",
                "swap-all",
                "exact status",
                "gap",
                "overhead gap",
                "solve s",
            ],
            [
                [
                    r["model"],
                    f"{100 * r['budget_fraction']:.0f}%",
                    _cell(r.get("paper_retention")),
                    _cell(r.get("optimal_retention")),
                    _cell(r.get("heuristic_retention")),
                    _cell(r.get("lp_bound_retention")),
                    _cell(r.get("recompute_all_retention")),
                    _cell(r.get("swap_all_retention")),
                    r.get("optimal_status", "-"),
                    "-" if r.get("optimal_gap") is None else f"{100 * r['optimal_gap']:.3f}%",
                    "-"
                    if r.get("optimal_overhead_gap") is None
                    else f"{100 * r['optimal_overhead_gap']:.2f}%",
                    "-" if r.get("optimal_solve_s") is None else f"{r['optimal_solve_s']:.2f}",
                ]
                for r in rows
            ],
        )
        note = (
            "Retention in % of ideal throughput, simulated on each plan's own schedule; "
            "'-': does not fit the budget. gap: the exact plan's proven distance to the best "
            "bound (step time); overhead gap: the same over the plan's overhead (step time "
            "less ideal); 'optimal' means an overhead gap of at most 1%."
        )
        print(
            f"wrote {write_section('paper_table', 'Reference table (' + args.hardware + ')', command_line(), table + chr(10) + chr(10) + note)}",
            file=sys.stderr,
        )
    return 0


def _cell(value) -> str:
    return "-" if value is None else f"{value:.2f}"
