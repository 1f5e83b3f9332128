"""The heuristic against the proven optimum on the test suite's CNN- and transformer-shaped
graph families, at more draws than the suite's 20.

    python benchmarks/heuristic_families.py [--draws 100]
        [--json benchmarks/results/heuristic_families.json]

Draws come from tests/test_heuristic_quality.py's strategies (hypothesis, derandomized: the
same draws on every run), each at a budget between its smallest and its keep-all peak, with
every decision or keep and recompute only. A draw counts when the exact planner proves its
optimum; the heuristic is within the bound when its overhead is at most twice the optimum's
plus 1% of the step. Prints the counts per family and each draw outside the bound.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def run_family(family, draws: int) -> dict:
    """The draws of one family: how many, how many outside the bound, and those messages."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from test_heuristic_quality import _check

    counts: dict = {"draws": 0, "outside": 0, "cases": []}

    @settings(
        max_examples=draws,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(family(), st.floats(0.1, 0.9), st.sampled_from([None, ("keep", "recompute")]))
    def draw(g, fraction, allowed):
        counts["draws"] += 1
        try:
            _check(g, fraction, allowed)
        except AssertionError as exc:
            counts["outside"] += 1
            counts["cases"].append(str(exc))
            print(f"  {family.__name__}: {exc}", flush=True)

    draw()
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument(
        "--json", type=Path, default=Path("benchmarks/results/heuristic_families.json")
    )
    args = parser.parse_args()
    from test_heuristic_quality import cnn_graphs, transformer_graphs

    summary = {}
    for family in (cnn_graphs, transformer_graphs):
        counts = run_family(family, args.draws)
        summary[family.__name__] = counts
        print(
            f"{family.__name__}: {counts['draws'] - counts['outside']} of {counts['draws']} "
            "draws within the bound (draws without a proven optimum count as within)",
            flush=True,
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
