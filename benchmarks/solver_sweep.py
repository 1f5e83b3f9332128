"""Every solver across budgets on the reference workloads and a scaling family.

    python benchmarks/solver_sweep.py [--workloads bert-large,gpt2-xl,llama-7b]
        [--budgets 0.2,0.3,...,1.0] [--solvers heuristic,cpsat,cbc,highs] [--time-limit 30]
        [--out benchmarks/results/solver_sweep.jsonl] [--workers 1]

Rows go to a JSONL file (resumable: rows already there are skipped, as `slackswap sweep`), then a
markdown table (solver_sweep.md) and a plot of retention against budget per workload, with the
LP bound (solver_sweep.png). Workloads may be reference names or "gpt-L<layers>" for the scaling
family (GPT-style, hidden 1024, seq 1024, batch 4).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import slackswap as ss
from slackswap.cli import main as cli


def scaling_graph(name: str, hw):
    layers = int(name.split("L")[-1])
    cfg = ss.TransformerConfig(
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
    return ss.transformer_graph(cfg, hw, name=name)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workloads", default="bert-large,gpt2-xl,llama-7b")
    p.add_argument("--budgets", default="0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0")
    p.add_argument("--solvers", default="heuristic,cpsat,cbc,highs")
    p.add_argument("--time-limit", type=float, default=30.0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/solver_sweep.jsonl"))
    p.add_argument("--workers", type=int, default=1)
    p.add_argument(
        "--report-only",
        action="store_true",
        help="write the table and plot from the rows already in --out, run nothing",
    )
    args = p.parse_args()
    hw = ss.hardware("a100-80gb-pcie4")
    graphs = []
    for w in args.workloads.split(","):
        if w.startswith("gpt-L"):
            path = args.out.parent / f"{w}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(scaling_graph(w, hw).to_json())
            graphs.append(str(path))
        else:
            graphs.append(w)
    if not args.report_only:
        cli(
            [
                "sweep",
                "--workloads",
                ",".join(graphs),
                "--budgets",
                args.budgets,
                "--solvers",
                args.solvers,
                "--out",
                str(args.out),
                "--time-limit",
                str(args.time_limit),
                "--workers",
                str(args.workers),
            ]
        )
    rows = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["workload"] in graphs]
    bounds = {}
    for w in graphs:
        g = ss.load_graph(w) if Path(w).exists() else ss.workload(w, hw)
        for b in sorted({r["budget_fraction"] for r in rows if r["workload"] == w}):
            try:
                bounds[(w, b)] = ss.lp_bound(g, b, hw).retention
            except ss.InfeasibleBudget:
                bounds[(w, b)] = None
    table = defaultdict(dict)
    solvers = args.solvers.split(",")
    for r in rows:
        table[(r["workload"], r["budget_fraction"])][r["solver"]] = r
    lines = [
        "| workload | budget | " + " | ".join(solvers) + " | LP bound |",
        "|---|---|" + "---|" * (len(solvers) + 1),
    ]
    for (w, b), by in sorted(table.items()):
        cells = []
        for s in solvers:
            r = by.get(s)
            if r is None or r["retention"] is None:
                cells.append("-" if r is None else r["status"])
            else:
                gap = "" if r.get("gap") is None else f" (gap {100 * r['gap']:.2f}%)"
                cells.append(f"{100 * r['retention']:.2f}{gap}")
        lb = bounds.get((w, b))
        lines.append(
            f"| {Path(w).stem} | {100 * b:.0f}% | "
            + " | ".join(cells)
            + f" | {'-' if lb is None else f'{100 * lb:.2f}'} |"
        )
    md = args.out.with_suffix(".md")
    md.write_text("\n".join(lines) + "\n")
    from results_md import command_line, write_section

    write_section(
        "solver_sweep",
        "Every solver across budgets",
        command_line(),
        "\n".join(lines) + "\n\nRetention (%) simulated on each plan's own schedule, with "
        "each exact solver's proven gap (step time); '-' or a status: no plan fits.\n\n"
        "![retention against budget](results/solver_sweep.png)",
    )
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(graphs), figsize=(5 * len(graphs), 3.6), squeeze=False)
    for ax, w in zip(axes[0], graphs):
        for s in solvers:
            pts = sorted(
                (r["budget_fraction"], r["retention"])
                for r in rows
                if r["workload"] == w and r["solver"] == s and r["retention"] is not None
            )
            if pts:
                ax.plot([100 * x for x, _ in pts], [100 * y for _, y in pts], marker="o", label=s)
        pts = sorted((b, v) for (ww, b), v in bounds.items() if ww == w and v is not None)
        ax.plot([100 * x for x, _ in pts], [100 * y for _, y in pts], "k--", label="LP bound")
        ax.set_title(Path(w).stem)
        ax.set_xlabel("budget (% of keep-all peak)")
        ax.set_ylabel("retention (%)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)
    print(f"wrote {md} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
