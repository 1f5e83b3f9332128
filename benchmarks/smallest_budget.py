"""The smallest budget against its lower bound, on the CNNs and the reference models.

    python benchmarks/smallest_budget.py [--allowed keep,recompute] [--results]
        [--json benchmarks/results/smallest_budget.json]

For each graph (the CNN shapes at batch 16 and the three reference workloads, A100 preset):
``ss.smallest_budget`` with the decisions allowed (default keep and recompute: where the minimum
is a search, not the closed form), how it was found, its proven lower bound and the gap between
them (what is still unproven), whether the full heuristic fits any budget below it (it should
not), and the wall time. With every decision allowed the minimum is the offload floor, proven.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import slackswap as ss

sys.path.insert(0, str(Path(__file__).parent))

BELOW = (0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999)
NEAR = 0.05  # a lower bound within this share of the smallest budget found is reported as near


def beaten_by_heuristic(g, hw, mask, minimum: int) -> int | None:
    """The smallest peak of a heuristic plan that fits a budget below ``minimum``, or None."""
    from slackswap.core.stepmodel import expand
    from slackswap.planners.base import Problem, get_planner

    heuristic = get_planner("heuristic")
    best = None
    for fraction in BELOW:
        budget = int(minimum * fraction)
        sol = heuristic.solve(Problem(g, hw, budget, mask))
        peak = int(expand(g, sol.codes, sol.schedule, hw, budget_bytes=budget).memory().max())
        if peak <= budget and (best is None or peak < best):
            best = peak
    return best


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--allowed", default="keep,recompute", help="'all' or a comma list")
    parser.add_argument(
        "--json", type=Path, default=Path("benchmarks/results/smallest_budget.json")
    )
    parser.add_argument("--results", action="store_true", help="write the table to RESULTS.md")
    args = parser.parse_args()
    from results_md import recording_print, save_outputs

    from slackswap.solve_options import restriction_mask

    lines: list[str] = []
    print = recording_print(lines)  # noqa: A001 - each line also goes to RESULTS.md
    allowed = None if args.allowed == "all" else tuple(args.allowed.split(","))
    hw = ss.hardware("a100-80gb-pcie4")
    graphs = [(name, ss.cnn_graph(name, hw)) for name in ss.CNN_SHAPES]
    graphs += [(name, ss.workload(name, hw)) for name in ("bert-large", "gpt2-xl", "llama-7b")]
    print(f"allowed: {args.allowed}; hardware {hw.name}")
    print(
        f"{'graph':12s} {'method':13s} {'smallest GB':>11s} {'lower GB':>9s} {'unproven':>8s} "
        f"{'heuristic below':>15s} {'wall s':>7s}"
    )
    rows = []
    for name, g in graphs:
        began = time.perf_counter()
        smallest = ss.smallest_budget(g, hw, allowed=allowed)
        wall = time.perf_counter() - began
        unproven = 1 - smallest.lower_bytes / smallest.budget_bytes
        below = beaten_by_heuristic(
            g, hw, restriction_mask(g, hw, allowed, None), smallest.budget_bytes
        )
        rows.append(
            {
                "graph": name,
                "method": smallest.method,
                "budget_bytes": smallest.budget_bytes,
                "lower_bytes": smallest.lower_bytes,
                "proven": smallest.proven,
                "unproven_share": unproven,
                "heuristic_below_bytes": below,
                "wall_s": wall,
            }
        )
        print(
            f"{name:12s} {smallest.method:13s} {smallest.budget_bytes / 1e9:11.3f} "
            f"{smallest.lower_bytes / 1e9:9.3f} "
            f"{'proven' if smallest.proven else f'{100 * unproven:.1f}%':>8s} "
            f"{'none' if below is None else f'{below / 1e9:.3f} GB':>15s} {wall:7.1f}",
            flush=True,
        )
    unproven_rows = [r for r in rows if not r["proven"]]
    near = [r for r in unproven_rows if r["unproven_share"] <= NEAR]
    print(
        f"{len(rows) - len(unproven_rows)} of {len(rows)} proven, {len(near)} more within "
        f"{100 * NEAR:.0f}% of their bound; the largest unproven share "
        f"{100 * max((r['unproven_share'] for r in rows), default=0):.1f}%; "
        f"beaten below: {sum(r['heuristic_below_bytes'] is not None for r in rows)}"
    )
    save_outputs(
        args.json,
        rows,
        args.results,
        f"smallest-budget-{args.allowed.replace(',', '-')}",
        f"The smallest budget against its lower bound ({args.allowed})",
        lines,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
