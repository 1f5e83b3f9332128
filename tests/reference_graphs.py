"""The graphs the test suite and the benchmarks hold, by name, for the heuristic's check against
the exact planner's recorded bounds (tests/data/heuristic_references.json, written by
benchmarks/heuristic_references.py).

A source names a graph and the hardware it is planned for: "file:NAME" (tests/data/NAME, on the
test link where the file records no hardware), "cnn:NET" (``ss.cnn_graph``, batch 16, the CNN
table's), "workload:NAME" (the reference table's) and "gpt:LAYERS" (solve_scaling.py's
transformer).
"""

from __future__ import annotations

from pathlib import Path

from helpers import LINK

import slackswap as ss

DATA = Path(__file__).parent / "data"
A100 = "a100-80gb-pcie4"

# (source, budgets as fractions of the keep-all peak, decisions: "all" and/or "recompute")
SOURCES: tuple[tuple[str, tuple[float, ...], tuple[str, ...]], ...] = (
    ("file:heuristic_collapse_transformer.json", (0.3, 0.5, 0.7), ("all", "recompute")),
    ("file:heuristic_collapse_transformer_wide.json", (0.3, 0.5, 0.7), ("all", "recompute")),
    ("file:heuristic_collapse_transformer_lanes.json", (0.3, 0.5, 0.7), ("all", "recompute")),
    ("file:tiny_times_skips.json", (0.3, 0.5, 0.7), ("all", "recompute")),
    ("file:tinygpt_cpu_profile.json", (0.3, 0.5, 0.7), ("recompute",)),
    *((f"cnn:{net}", (0.9, 0.8, 0.5), ("all", "recompute")) for net in ss.CNN_SHAPES),
    *(
        (f"workload:{name}", (0.2, 0.3, 0.4, 0.5, 0.6), ("all",))
        for name in ("bert-large", "gpt2-xl", "llama-7b")
    ),
    ("gpt:2", (0.2, 0.4, 0.7), ("all", "recompute")),
    ("gpt:4", (0.2, 0.4, 0.7), ("all", "recompute")),
)

ALLOWED = {"all": None, "recompute": ("keep", "recompute")}


def graph_of(source: str) -> tuple[ss.ActivationGraph, ss.Hardware]:
    """The graph a source names and the hardware it is planned for."""
    kind, _, name = source.partition(":")
    if kind == "file":
        g = ss.load_graph(DATA / name)
        recorded = g.extra.get("hardware")
        return g, (ss.Hardware.from_dict(dict(recorded)) if recorded else LINK)
    hw = ss.hardware(A100)
    if kind == "cnn":
        return ss.cnn_graph(name, hw, batch=16), hw
    if kind == "workload":
        return ss.workload(name, hw), hw
    if kind == "gpt":
        import sys

        sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
        from solve_scaling import config

        layers = int(name)
        return ss.transformer_graph(config(layers), hw, name=f"gpt-{layers}L"), hw
    raise ValueError(f"unknown graph source {source!r}")
