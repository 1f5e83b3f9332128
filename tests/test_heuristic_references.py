"""The heuristic never collapses on the graphs the suite and the benchmarks hold: on each
recorded (graph, budget, decisions), its overhead is at most twice the optimum's plus 1% of the
step. The optimum is at least the exact planner's recorded bound (a lower bound on any plan's
step time), so the test measures against the bound: a pass is a proof.

The bounds come from benchmarks/heuristic_references.py (about 10 minutes of exact solves); the
heuristic runs here, on the same graph (its digest is checked)."""

from __future__ import annotations

import json
from functools import cache

import pytest
from reference_graphs import ALLOWED, DATA, SOURCES, graph_of

import slackswap as ss

REFERENCES = json.loads((DATA / "heuristic_references.json").read_text())["rows"]


@cache
def _graph(source: str):
    return graph_of(source)


def test_every_source_and_budget_has_a_recorded_bound():
    """The references cover SOURCES exactly: a source added there without its rows fails."""
    wanted = {
        (source, label, fraction)
        for source, fractions, decisions in SOURCES
        for label in decisions
        for fraction in fractions
    }
    recorded = {(r["source"], r["decisions"], r["fraction"]) for r in REFERENCES}
    assert wanted == recorded, (
        "regenerate with python benchmarks/heuristic_references.py: "
        f"missing {sorted(wanted - recorded)[:5]}, stale {sorted(recorded - wanted)[:5]}"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "row", REFERENCES, ids=[f"{r['source']}-{r['decisions']}-{r['fraction']}" for r in REFERENCES]
)
def test_the_heuristic_is_within_twice_the_optimum_plus_one_percent(row):
    g, hw = _graph(row["source"])
    assert g.digest == row["digest"], (
        f"{row['source']} changed since its bound was recorded: regenerate with "
        f"python benchmarks/heuristic_references.py --only {row['source']}"
    )
    budget, allowed = row["budget_bytes"], ALLOWED[row["decisions"]]
    if row["status"] == "infeasible":
        if row["no_plan_proven"]:
            with pytest.raises(ss.InfeasibleBudget):
                ss.solve(g, budget, hw, solver="heuristic", allowed=allowed)
        return  # no exact plan to measure against
    plan = ss.solve(g, budget, hw, solver="heuristic", allowed=allowed)
    assert ss.validate(g, plan).ok
    ideal = row["ideal_step_s"]
    bound = row["bound_step_s"]
    assert bound is not None and bound <= row["exact_step_s"] * (1 + 1e-9)
    over = plan.info.predicted_step_time_s - ideal
    allowance = 2 * max(0.0, bound - ideal) + 0.01 * ideal
    assert over <= allowance * (1 + 1e-9) + 1e-15, (
        f"heuristic overhead {over:.4g} s, allowance {allowance:.4g} s (bound {bound:.6g} s, "
        f"ideal {ideal:.6g} s)"
    )
