"""How long the SlackSwap heuristic takes to plan, against the number of saved tensors.

    python benchmarks/heuristic_speed.py [--json benchmarks/results/heuristic_speed.json]

Goal: under 50 ms for a graph of about 2,000 saved tensors (planning alone; solve() then
validates and simulates the plan, which is reported separately).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import slackswap as ss
from slackswap.core.budget import parse_budget
from slackswap.planners.heuristic import heuristic_codes


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--json", type=Path, default=Path("benchmarks/results/heuristic_speed.json")
    )
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    hw = ss.hardware("a100-80gb-pcie4")
    rows = []
    for layers in (10, 40, 80, 160):
        cfg = ss.TransformerConfig(
            layers=layers,
            hidden=2048,
            heads=16,
            ffn=8192,
            seq_len=2048,
            micro_batch=1,
            vocab=32000,
            causal=True,
        )
        g = ss.transformer_graph(cfg, hw)
        budget = parse_budget(0.5, g, hw)
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            heuristic_codes(g, hw, budget)
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        ss.solve(g, budget, hw, solver="heuristic")
        with_checks = time.perf_counter() - start
        row = {
            "layers": layers,
            "saved_tensors": int(len(g.saved)),
            "ops": g.n_ops,
            "plan_ms_median": 1e3 * statistics.median(times),
            "solve_with_validation_ms": 1e3 * with_checks,
        }
        rows.append(row)
        print(
            f"{layers:4d} layers  {row['saved_tensors']:5d} saved tensors  plan "
            f"{row['plan_ms_median']:7.1f} ms  (solve() with validation and simulation "
            f"{row['solve_with_validation_ms']:7.1f} ms)"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    from results_md import command_line, markdown_table, write_section

    write_section(
        "heuristic_speed",
        "Heuristic speed",
        command_line(),
        markdown_table(
            [
                "layers",
                "ops",
                "saved tensors",
                "heuristic ms (median)",
                "solve() ms (closed, checked, simulated)",
            ],
            [
                [
                    r["layers"],
                    r["ops"],
                    r["saved_tensors"],
                    f"{r['plan_ms_median']:.1f}",
                    f"{r['solve_with_validation_ms']:.1f}",
                ]
                for r in rows
            ],
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
