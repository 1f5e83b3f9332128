"""Writes the notebooks (source of truth for their cells) and executes them in place.

python notebooks/build_notebooks.py            # write and execute all three
SLACKSWAP_NOTEBOOK_SMALL=1 ...                 # the small sizes CI uses
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent

QUICKSTART = [
    (
        "md",
        "# slackswap quick start\n\nPlan the activation memory of a training step: for every "
        "saved activation, keep it, swap it to host memory, or recompute it, under a budget.",
    ),
    (
        "code",
        "import os\nimport slackswap as ss\n"
        "SMALL = os.environ.get('SLACKSWAP_NOTEBOOK_SMALL') == '1'\n"
        "hw = ss.hardware('a100-80gb-pcie4')\n"
        "cfg = ss.TransformerConfig(layers=2 if SMALL else 8, hidden=1024, heads=16, ffn=4096,\n"
        "                           seq_len=1024, micro_batch=4, vocab=0, causal=True)\n"
        "g = ss.transformer_graph(cfg, hw)\nprint(g.summary())",
    ),
    (
        "md",
        "Solve at 40% of the keep-all peak with the SlackSwap heuristic and the exact planner "
        "(CP-SAT), and compare them with the LP bound and the baselines.",
    ),
    (
        "code",
        "rows = ss.compare(g, 0.4, hw, solvers=('heuristic', 'cpsat', 'recompute-all', 'swap-all'), time_limit_s=20)\n"
        "bound = ss.lp_bound(g, 0.4, hw)\n"
        "for r in rows:\n"
        "    print(f\"{r['solver']:14s} {r['status']:10s} retention {100 * r['retention']:6.2f}%  peak {r['peak_bytes'] / 2**30:.2f} GiB  fits {r['fits']}\")\n"
        "print(f'LP bound       retention {100 * bound.retention:6.2f}%')",
    ),
    (
        "code",
        "%matplotlib inline\nfrom slackswap.plot import plot_memory\nfrom IPython.display import Image\n"
        "plans = {s: ss.solve(g, 0.4, hw, solver=s, time_limit_s=20) for s in ('heuristic', 'cpsat')}\n"
        "sims = {s: ss.simulate(g, p, hw) for s, p in plans.items()}\n"
        "paths = plot_memory(sims, plans['cpsat'].budget_bytes, 'quickstart-memory')\nImage(str(paths[0]))",
    ),
]

SWEEP = [
    (
        "md",
        "# Retention against budget\n\nEvery planner across budgets, with the LP bound above them all.",
    ),
    (
        "code",
        "import os\nimport slackswap as ss\nimport matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
        "SMALL = os.environ.get('SLACKSWAP_NOTEBOOK_SMALL') == '1'\n"
        "hw = ss.hardware('a100-80gb-pcie4')\n"
        "g = ss.transformer_graph(ss.TransformerConfig(layers=2 if SMALL else 6, hidden=1024, heads=16, ffn=4096, seq_len=1024, micro_batch=4, vocab=0, causal=True), hw)\n"
        "budgets = [0.3, 0.5, 0.8] if SMALL else [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]",
    ),
    (
        "code",
        "results = {s: [] for s in ('heuristic', 'cpsat', 'lp bound')}\n"
        "for b in budgets:\n"
        "    for s in ('heuristic', 'cpsat'):\n"
        "        p = ss.solve(g, b, hw, solver=s, time_limit_s=10)\n"
        "        results[s].append(100 * ss.simulate(g, p, hw).retention)\n"
        "    results['lp bound'].append(100 * ss.lp_bound(g, b, hw).retention)\n"
        "for s, v in results.items():\n    print(s, [round(x, 2) for x in v])",
    ),
    (
        "code",
        "fig, ax = plt.subplots(figsize=(6, 4))\n"
        "for s, v in results.items():\n    ax.plot([100 * b for b in budgets], v, marker='o', label=s)\n"
        "ax.set_xlabel('budget (% of keep-all peak)'); ax.set_ylabel('retention (% of ideal)'); ax.legend(); ax.grid(alpha=0.3)\n"
        "fig.savefig('sweep.png', dpi=100)\nfrom IPython.display import Image\nImage('sweep.png')",
    ),
]

REAL = [
    (
        "md",
        "# A real model: profile, plan, train\n\nProfile a small GPT-style model in torch, plan it "
        "at 50% of its activation peak, and train a few steps under the plan; gradients are "
        "bit-identical to plain training.",
    ),
    (
        "code",
        "import torch\nimport slackswap as ss\ntorch.manual_seed(0)\n"
        "layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)\n"
        "model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)\n"
        "x = torch.randn(4, 32, 64)\nloss_fn = lambda out: out.pow(2).mean()\n"
        "graph = ss.profile(model, x, loss_fn)\nprint(graph.summary())",
    ),
    (
        "code",
        "hw = ss.calibrate_link()  # the documented CPU preset without a GPU\n"
        "lo, hi = ss.min_budget(graph, hw), ss.keep_all_peak(graph, hw)\n"
        "plan = ss.solve(graph, (lo + hi) // 2, hw, solver='cpsat', time_limit_s=10)\n"
        "print({d: plan.count(d) for d in ('keep', 'swap', 'recompute')}, plan.info.status)\n"
        "print(ss.simulate(graph, plan, hw).summary())",
    ),
    (
        "code",
        "def grads(use_plan, seed=1):\n"
        "    torch.manual_seed(seed); model.zero_grad(set_to_none=True)\n"
        "    if use_plan:\n"
        "        with ss.apply(plan, model, graph=graph) as run:\n"
        "            loss_fn(model(x)).backward()\n"
        "        print(run.stats)\n"
        "    else:\n"
        "        loss_fn(model(x)).backward()\n"
        "    return [p.grad.clone() for p in model.parameters()]\n"
        "same = all(torch.equal(a, b) for a, b in zip(grads(False), grads(True)))\nprint('bit-identical gradients:', same)",
    ),
]

NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_budget_sweep.ipynb": SWEEP,
    "03_real_model.ipynb": REAL,
}


def build(name: str, cells) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.cells = [
        nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
        for kind, src in cells
    ]
    return nb


def execute(nb: nbformat.NotebookNode, cwd: Path, timeout: int = 600) -> nbformat.NotebookNode:
    NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    ).execute()
    return nb


def main() -> int:
    for name, cells in NOTEBOOKS.items():
        nb = execute(build(name, cells), HERE)
        nbformat.write(nb, HERE / name)
        print(f"wrote {HERE / name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
