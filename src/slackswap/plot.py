"""Plots: device memory over the step against the budget, a Gantt chart of the compute
stream and the two copy lanes, and tokens per second against the batch for each strategy
(matplotlib, PNG and SVG)."""

from __future__ import annotations

from pathlib import Path

from .check.simulate import SimResult
from .core.graph import ActivationGraph


def plot_memory(
    results: dict[str, SimResult], budget: int, path: str | Path, title: str = ""
) -> list[Path]:
    """Memory over time for one or more plans, with the budget line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for label, sim in results.items():
        t = list(sim.memory_time_s * 1e3) + [sim.step_time_s * 1e3]
        m = list(sim.memory_bytes / 2**30) + [0.0]
        ax.step(t, m, where="post", label=f"{label} ({100 * sim.retention:.1f}%)")
    ax.axhline(budget / 2**30, color="red", linestyle="--", label="budget")
    ax.set_xlabel("time in step (ms)")
    ax.set_ylabel("activation memory (GiB)")
    ax.set_title(title or "Device activation memory over one step")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def plot_gantt(
    graph: ActivationGraph, sim: SimResult, path: str | Path, title: str = ""
) -> list[Path]:
    """The compute stream (forward, reruns, backward) and the D2H / H2D lanes over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3))
    colors = {0: "tab:blue", 1: "tab:orange", 2: "tab:green"}
    for start, end, _, kind in sim.compute_intervals:
        ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (20, 8), color=colors[int(kind)])
    for start, end, _ in sim.d2h_intervals:
        ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (10, 8), color="tab:purple")
    for start, end, _ in sim.h2d_intervals:
        ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (0, 8), color="tab:red")
    ax.set_yticks([4, 14, 24], ["H2D", "D2H", "compute"])
    ax.set_xlabel("time in step (ms)")
    from matplotlib.patches import Patch

    ax.legend(
        handles=[
            Patch(color="tab:blue", label="forward"),
            Patch(color="tab:orange", label="rerun"),
            Patch(color="tab:green", label="backward"),
            Patch(color="tab:purple", label="offload"),
            Patch(color="tab:red", label="prefetch"),
        ],
        loc="upper right",
        fontsize=7,
        ncol=5,
    )
    ax.set_title(title or f"{graph.name}: compute and copy lanes")
    fig.tight_layout()
    return _save(fig, path)


def plot_throughput(
    curve: dict, path: str | Path, dimension: str = "batch", title: str = ""
) -> list[Path]:
    """Tokens per second against the size (``LargestFit.curve``: per size, its strategy rows),
    one line per strategy; filled markers where the step fits the device, hollow where not."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels: dict[str, str] = {}
    for rows in curve.values():
        for r in rows:
            labels.setdefault(r.strategy, r.label)
    for strategy, label in labels.items():
        points = sorted(
            (size, r) for size, rows in curve.items() for r in rows if r.strategy == strategy
        )
        xs = [size for size, _ in points]
        ys = [r.tokens_per_s for _, r in points]
        (line,) = ax.plot(xs, ys, "-", alpha=0.6, label=label)
        fits = [(x, y) for (x, y), (_, r) in zip(zip(xs, ys), points) if r.fits]
        over = [(x, y) for (x, y), (_, r) in zip(zip(xs, ys), points) if not r.fits]
        if fits:
            ax.plot(*zip(*fits), "o", color=line.get_color())
        if over:
            ax.plot(*zip(*over), "o", mfc="none", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel(dimension)
    ax.set_ylabel("tokens per second (predicted)")
    ax.set_title(title or f"Throughput against {dimension} (hollow: does not fit)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path) -> list[Path]:
    import matplotlib.pyplot as plt

    base = Path(path)
    if base.suffix in (".png", ".svg"):
        base = base.with_suffix("")
    base.parent.mkdir(parents=True, exist_ok=True)
    out = [base.with_suffix(".png"), base.with_suffix(".svg")]
    fig.savefig(out[0], dpi=120)
    fig.savefig(out[1])
    plt.close(fig)
    return out
