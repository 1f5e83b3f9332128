"""The exact planner's bounds on every graph the test suite and the benchmarks hold, recorded for
tests/test_heuristic_references.py, which holds the heuristic within twice the optimum's
overhead plus 1% of the step on each of them.

    python benchmarks/heuristic_references.py [--time-limit 30] [--workload-time-limit 60]
        [--json tests/data/heuristic_references.json] [--only SOURCE]
    python benchmarks/heuristic_references.py --verdicts [--results]   # today's heuristic

The graphs and budgets are tests/reference_graphs.py's SOURCES. Per (graph, budget, decisions):
the exact planner's plan (default solver, default work; the reference workloads at the
reference table's 60 s) and its bound, a lower bound on any plan's step time, with the graph's
digest. The test compares the heuristic against the bound (the optimum is at least the bound, so
a heuristic within the allowance of the bound is within it of the optimum). Prints each row and,
from the heuristic's plan of today, whether it is within the allowance.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).parent))

import slackswap as ss  # noqa: E402


def reference_row(source: str, g, hw, fraction: float, decisions: str, limit: float) -> dict:
    """One row: the budget, the exact planner's step and bound (None where no plan fits)."""
    from reference_graphs import ALLOWED

    allowed = ALLOWED[decisions]
    budget = ss.parse_budget(fraction, g, hw)
    row = {
        "source": source,
        "digest": g.digest,
        "hardware": hw.name,
        "fraction": fraction,
        "budget_bytes": budget,
        "decisions": decisions,
        "ideal_step_s": g.ideal_step_time_s,
    }
    began = time.perf_counter()
    try:
        plan = ss.solve(g, budget, hw, allowed=allowed, time_limit_s=limit)
    except ss.InfeasibleBudget as exc:
        smallest = ss.smallest_budget(g, hw, allowed=allowed)
        row.update(
            exact_step_s=None,
            bound_step_s=None,
            status="infeasible",
            # proven: no plan of any planner fits; else the heuristic may find one (not a fault)
            no_plan_proven=smallest.lower_bytes > budget,
            reason=str(exc)[:200],
        )
    else:
        row.update(
            exact_step_s=plan.info.predicted_step_time_s,
            bound_step_s=plan.info.bound,
            status=str(plan.info.status),
            no_plan_proven=False,
        )
    row["solve_s"] = time.perf_counter() - began
    return row


def heuristic_verdict(row: dict, g, hw) -> str:
    """Today's heuristic against the row's bound: the test's check, in words."""
    from reference_graphs import ALLOWED

    try:
        plan = ss.solve(
            g, row["budget_bytes"], hw, solver="heuristic", allowed=ALLOWED[row["decisions"]]
        )
    except ss.InfeasibleBudget:
        if row["status"] != "infeasible":
            return "no plan (COLLAPSE: the exact planner has one)"
        return "no plan" + (" (none exists)" if row["no_plan_proven"] else " (nor the exact's)")
    if row["bound_step_s"] is None:
        return "plan (exact: none; no bound)"
    ideal = row["ideal_step_s"]
    over = plan.info.predicted_step_time_s - ideal
    allowance = 2 * max(0.0, row["bound_step_s"] - ideal) + 0.01 * ideal
    verdict = "within" if over <= allowance + 1e-12 else "OUTSIDE"
    return (
        f"{verdict}: heuristic {100 * over / ideal:.3f}%, allowance {100 * allowance / ideal:.3f}%"
    )


def verdicts(path: Path, results: bool) -> int:
    """Today's heuristic against each recorded bound, and the counts (``results``: also as a
    section of RESULTS.md)."""
    from reference_graphs import graph_of
    from results_md import recording_print, write_printed_section

    lines: list[str] = []
    print = recording_print(lines)  # noqa: A001 - each line also goes to RESULTS.md

    counts: dict[str, int] = {}
    worst = (0.0, "")
    for row in json.loads(path.read_text())["rows"]:
        g, hw = graph_of(row["source"])
        verdict = heuristic_verdict(row, g, hw)
        counts[verdict.split(":")[0].split(" (")[0]] = (
            counts.get(verdict.split(":")[0].split(" (")[0], 0) + 1
        )
        if verdict.startswith(("within", "OUTSIDE")) and row["bound_step_s"] is not None:
            ideal = row["ideal_step_s"]
            plan_over = float(verdict.split("heuristic ")[1].split("%")[0]) / 100 * ideal
            share = plan_over / (2 * max(0.0, row["bound_step_s"] - ideal) + 0.01 * ideal)
            worst = max(worst, (share, f"{row['source']} {row['decisions']} {row['fraction']:.0%}"))
        print(
            f"{row['source']:<48} {row['decisions']:<9} {row['fraction']:>4.0%} "
            f"{row['status']:<10} {verdict}"
        )
    print(
        f"{sum(counts.values())} rows: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    )
    print(f"largest share of the allowance used: {worst[0]:.2f} ({worst[1]})")
    if results:
        write_printed_section(
            "heuristic_references",
            "The heuristic against the exact planner's bounds on every suite and benchmark graph",
            lines,
        )
    return 0


def main() -> int:
    from reference_graphs import SOURCES, graph_of

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--workload-time-limit", type=float, default=60.0)
    parser.add_argument(
        "--json", type=Path, default=ROOT / "tests" / "data" / "heuristic_references.json"
    )
    parser.add_argument("--only", default=None, help="one source (the other rows are kept)")
    parser.add_argument("--results", action="store_true", help="with --verdicts: RESULTS.md")
    parser.add_argument(
        "--verdicts",
        action="store_true",
        help="no exact solves: today's heuristic against the recorded bounds",
    )
    args = parser.parse_args()
    if args.verdicts:
        return verdicts(args.json, args.results)
    kept = []
    if args.only and args.json.exists():
        kept = [r for r in json.loads(args.json.read_text())["rows"] if r["source"] != args.only]
    rows = []
    for source, fractions, decisions in SOURCES:
        if args.only and source != args.only:
            continue
        g, hw = graph_of(source)
        limit = args.workload_time_limit if source.startswith("workload:") else args.time_limit
        for label in decisions:
            for fraction in fractions:
                row = reference_row(source, g, hw, fraction, label, limit)
                rows.append(row)
                bound = row["bound_step_s"]
                print(
                    f"{source:<48} {label:<9} {fraction:>4.0%} {row['status']:<10} "
                    f"bound {'-' if bound is None else format(100 * (bound / row['ideal_step_s'] - 1), '.3f') + '%':>8} "
                    f"{row['solve_s']:5.1f}s  {heuristic_verdict(row, g, hw)}",
                    flush=True,
                )
                args.json.write_text(
                    json.dumps(
                        {
                            "generated_by": "python benchmarks/heuristic_references.py",
                            "rows": kept + rows,
                        },
                        indent=1,
                    )
                    + "\n"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
