"""The exact planner on CNN training graphs: recompute-only and with swaps, at 90 / 80 / 50%.

    python benchmarks/cnn_table.py [--nets vgg16,vgg19,fcn8,segnet,unet,mobilenet,resnet50]
        [--budgets 0.9,0.8,0.5] [--time-limit 10] [--batch 16]
        [--json benchmarks/results/cnn_table.json]
    python benchmarks/cnn_table.py --departure-work 6   # the departure bound alone, rows with swaps

Graphs from ``ss.cnn_graph`` (layer-level, PyTorch's saved tensors, roofline times on an A100 with
PCIe 4.0; 51-176 ops). Per (net, decisions, budget): the exact plan's overhead (step time over
the ideal, less 1), the heuristic's, the LP bound's, the status, the overhead gap (what is left
to prove of the overhead) and the solve time. "optimal" means proven within 1% of the overhead.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import slackswap as ss

sys.path.insert(0, str(Path(__file__).parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", default=",".join(ss.CNN_SHAPES))
    parser.add_argument("--budgets", default="0.9,0.8,0.5")
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument(
        "--work",
        type=float,
        default=None,
        metavar="S",
        help="the planner's work (solve(work_s=...)); default: the time limit",
    )
    parser.add_argument(
        "--anytime",
        action="store_true",
        help="phases share the clock instead of stopping on work limits",
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/cnn_table.json"))
    parser.add_argument("--results", action="store_true", help="write the table to RESULTS.md")
    parser.add_argument(
        "--departure-work",
        type=float,
        default=None,
        metavar="UNITS",
        help="instead: the departure bound alone on the rows with swaps, from the "
        "heuristic's plan, with this much CP-SAT work (deterministic time)",
    )
    parser.add_argument(
        "--departure-gap",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="with --departure-work: each round stops within this share of the "
        "overhead of its bound",
    )
    args = parser.parse_args()
    if args.departure_work is not None:
        return departure_work(args)
    lines: list[str] = []
    from results_md import recording_print

    print = recording_print(lines)  # noqa: A001 - each line also goes to RESULTS.md
    hw = ss.hardware("a100-80gb-pcie4")
    rows = []
    print(
        f"{'net':<10} {'decisions':<10} {'budget':>6} {'exact':>8} {'heur.':>8} {'LP bd':>8} "
        f"{'status':<9} {'ovh gap':>8} {'solve':>6}  plan"
    )
    for net in args.nets.split(","):
        g = ss.cnn_graph(net, hw, batch=args.batch)
        ideal = g.ideal_step_time_s
        for label, allowed in (("recompute", ("keep", "recompute")), ("all", None)):
            for budget in (float(b) for b in args.budgets.split(",")):
                row = {
                    "net": net,
                    "ops": g.n_ops,
                    "saved": len(g.saved),
                    "decisions": label,
                    "budget": budget,
                }
                try:
                    heuristic = ss.solve(g, budget, hw, solver="heuristic", allowed=allowed)
                    began = time.perf_counter()
                    exact = ss.solve(
                        g,
                        budget,
                        hw,
                        solver="cpsat",
                        allowed=allowed,
                        time_limit_s=args.time_limit,
                        work_s=args.work,
                        anytime=args.anytime,
                    )
                    wall = time.perf_counter() - began
                except ss.InfeasibleBudget as exc:
                    row["error"] = f"infeasible: {str(exc)[:120]}"
                    rows.append(row)
                    print(f"{net:<10} {label:<10} {budget:>6.0%} infeasible with these decisions")
                    continue
                bound = ss.lp_bound(g, budget, hw, allowed=allowed)

                def overhead(step, ideal=ideal):
                    return 100 * (step / ideal - 1)

                row.update(
                    exact_overhead_pct=overhead(exact.info.predicted_step_time_s),
                    heuristic_overhead_pct=overhead(heuristic.info.predicted_step_time_s),
                    lp_bound_overhead_pct=overhead(bound.step_time_s),
                    status=exact.info.status,
                    overhead_gap=exact.info.overhead_gap,
                    solve_s=wall,
                    clock_stopped=exact.info.extra.get("clock_stopped"),
                    plan=plan_digest(exact),
                )
                rows.append(row)
                gap = "-" if row["overhead_gap"] is None else f"{100 * row['overhead_gap']:.1f}%"
                print(
                    f"{net:<10} {label:<10} {budget:>6.0%} {row['exact_overhead_pct']:>7.3f}% "
                    f"{row['heuristic_overhead_pct']:>7.3f}% {row['lp_bound_overhead_pct']:>7.3f}% "
                    f"{row['status']:<9} {gap:>8} {wall:>5.1f}s  {row['plan']}",
                    flush=True,
                )
    done = [r for r in rows if "status" in r]
    proven = [r for r in done if r["status"] == "optimal"]
    print(
        f"proven within 1% of the overhead: {len(proven)} of {len(done)} "
        f"(recompute-only {sum(r['decisions'] == 'recompute' for r in proven)} of "
        f"{sum(r['decisions'] == 'recompute' for r in done)})"
    )
    from results_md import save_outputs

    save_outputs(
        args.json,
        rows,
        args.results,
        "cnn_table",
        "CNN training graphs: exact planner, recompute-only and with swaps",
        lines,
    )
    return 0


def plan_digest(plan) -> str:
    """A short digest of a plan's decisions and schedule: two runs that print the same one made
    the same plan (the wall time is the only column that may differ)."""
    import hashlib
    import json

    text = json.dumps([plan.decisions, plan.schedule.to_dict()], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def departure_work(args) -> int:
    """How much work the departure model takes to solve, per row: what its formulation's rows
    buy, measured on any machine alike (formulations/departure-bound.md, "Solving it")."""
    from slackswap.core.codes import decision_codes
    from slackswap.planners.departures import departure_bound

    hw = ss.hardware("a100-80gb-pcie4")
    print(f"{'net':<10} {'budget':>6} {'status':<9} {'bound':>8} {'work':>6} {'wall':>6}  rounds")
    solved, total = 0, 0.0
    for net in args.nets.split(","):
        g = ss.cnn_graph(net, hw, batch=args.batch)
        ideal = g.ideal_step_time_s
        for budget in (float(b) for b in args.budgets.split(",")):
            start = ss.solve(g, budget, hw, solver="heuristic")
            found = departure_bound(
                g,
                budget,
                hw,
                hint=decision_codes(g, start),
                incumbent_s=start.info.predicted_step_time_s,
                deterministic_time_s=args.departure_work,
                time_limit_s=600.0,
                gap=args.departure_gap,
            )
            solved += found.status in ("optimal", "trivial")
            total += found.work
            bound = (
                "-"
                if found.step_time_s is None
                else f"{100 * (found.step_time_s / ideal - 1):.4f}%"
            )
            print(
                f"{net:<10} {budget:>6.0%} {found.status:<9} {bound:>8} {found.work:>6.2f} "
                f"{found.wall_s:>5.1f}s  {found.note}",
                flush=True,
            )
    print(f"solved within {args.departure_work:g} units: {solved}; work in all {total:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
