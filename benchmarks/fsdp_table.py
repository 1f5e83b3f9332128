"""Llama-7B-like on 8 ranks of FSDP2: how much hideable copy time the collectives take when they
share the PCIe link (no NVLink), and how much retention each planner keeps, against an NVLink
node where they do not.

    python benchmarks/fsdp_table.py [--budgets 0.3,0.4,0.5] [--time-limit 30] [--world 8]
        [--json benchmarks/results/fsdp_table.json] [--results]

Per rank: the same activations as one GPU, plus one all-gather per decoder layer in forward and
again in backward (reshard_after_forward) and one reduce-scatter of its gradients
(``ss.workload(..., fsdp_world=8)``; traffic per shared/reference.md). Retention in % of the
ideal step (compute alone), simulated on each plan's schedule.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import slackswap as ss

LINKS = {
    "PCIe, no NVLink": True,  # collectives cross the host link
    "NVLink node": False,
}


def lane_seconds(graph: ss.ActivationGraph, hw: ss.Hardware) -> tuple[float, float]:
    """Seconds the collectives occupy the D2H and H2D lanes."""
    d2h = sum(hw.d2h_time(c.d2h_bytes) for c in graph.collectives if c.d2h_bytes)
    h2d = sum(hw.h2d_time(c.h2d_bytes) for c in graph.collectives if c.h2d_bytes)
    return d2h, h2d


def rows(
    budgets, time_limit_s: float, world: int, base: str = "a100-80gb-pcie4", progress=None
) -> list[dict]:
    out = []
    for label, shared in LINKS.items():
        hw = ss.hardware(base).with_link(
            name=f"{base}{'-no-nvlink' if shared else '-nvlink'}", collectives_on_link=shared
        )
        graph = ss.workload("llama-7b", hw, fsdp_world=world)
        d2h, h2d = lane_seconds(graph, hw)
        step = graph.ideal_step_time_s
        for budget in budgets:
            row = {
                "link": label,
                "world": world,
                "budget_fraction": budget,
                "collective_d2h_s": d2h if shared else 0.0,
                "collective_h2d_s": h2d if shared else 0.0,
                "ideal_step_s": step,
            }
            for solver in ("heuristic", "cpsat"):
                began = time.perf_counter()
                plan = ss.solve(graph, budget, hw, solver=solver, time_limit_s=time_limit_s)
                check = ss.validate(graph, plan)
                assert check.ok, check.violations
                row[f"{solver}_retention"] = step / check.step_time_s
                row[f"{solver}_status"] = plan.info.status
                row[f"{solver}_gap"] = plan.info.gap
                row[f"{solver}_s"] = time.perf_counter() - began
            lp = ss.lp_bound(graph, budget, hw)
            row["lp_bound_retention"] = lp.retention
            row["lp_status"] = lp.status
            out.append(row)
            if progress:
                progress(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budgets", default="0.3,0.4,0.5")
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/fsdp_table.json"))
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    budgets = [float(x) for x in args.budgets.split(",")]
    table = rows(
        budgets,
        args.time_limit,
        args.world,
        progress=lambda r: print(
            f"  done {r['link']} at {r['budget_fraction']:.0%}", file=sys.stderr
        ),
    )
    lines = [
        f"{'link':<16} {'budget':>6} {'FSDP D2H':>9} {'FSDP H2D':>9} {'heur.':>6} "
        f"{'exact':>6} {'LP bd':>6} {'exact status':>13} {'gap':>7} {'solve':>6}"
    ]
    for r in table:
        gap = r["cpsat_gap"]
        lines.append(
            f"{r['link']:<16} {r['budget_fraction']:>6.0%} {1e3 * r['collective_d2h_s']:>7.0f}ms "
            f"{1e3 * r['collective_h2d_s']:>7.0f}ms {100 * r['heuristic_retention']:>6.2f} "
            f"{100 * r['cpsat_retention']:>6.2f} {100 * r['lp_bound_retention']:>6.2f} "
            f"{r['cpsat_status']:>13} {'-' if gap is None else f'{100 * gap:.3f}%':>7} "
            f"{r['cpsat_s']:>5.1f}s"
        )
    print("\n".join(lines))
    step = table[0]["ideal_step_s"] if table else 0.0
    print(
        f"ideal step {1e3 * step:.0f} ms per rank; FSDP D2H/H2D: seconds the collectives "
        "occupy each lane of the host link (the copy time they take from the activations)"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(table, indent=1))
    if args.results:
        from results_md import command_line, markdown_table, write_section

        body = markdown_table(
            [
                "link",
                "budget",
                "FSDP on D2H",
                "FSDP on H2D",
                "heuristic",
                "exact",
                "LP bound",
                "exact status",
                "gap",
                "solve s",
            ],
            [
                [
                    r["link"],
                    f"{100 * r['budget_fraction']:.0f}%",
                    f"{1e3 * r['collective_d2h_s']:.0f} ms",
                    f"{1e3 * r['collective_h2d_s']:.0f} ms",
                    f"{100 * r['heuristic_retention']:.2f}",
                    f"{100 * r['cpsat_retention']:.2f}",
                    f"{100 * r['lp_bound_retention']:.2f}",
                    r["cpsat_status"],
                    "-" if r["cpsat_gap"] is None else f"{100 * r['cpsat_gap']:.3f}%",
                    f"{r['cpsat_s']:.1f}",
                ]
                for r in table
            ],
        )
        note = (
            f"\n\nLlama-7B-like, one rank of {table[0]['world'] if table else 8}-way FSDP2 "
            f"(reshard after forward), ideal step {1e3 * step:.0f} ms. FSDP on D2H/H2D: "
            "seconds the collectives occupy each lane of the PCIe link, taken from the copy "
            "time compute could hide. Retention in % of the ideal step, simulated and "
            "checked on each plan's own schedule."
        )
        write_section(
            "fsdp_table",
            "FSDP2: collectives on the copy lanes (Llama-7B, 8 ranks)",
            command_line(),
            body + note,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
