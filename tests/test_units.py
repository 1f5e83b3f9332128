"""Sharded parameters: a rerun reads a unit's parameters only in that unit's backward, where
FSDP has gathered them. slackswap keeps reruns inside units; the other way (gathering on demand)
is refused: by the planners (not rebuildable), by complete() and by the independent checker."""

from __future__ import annotations

import pytest
from helpers import CAP, LINK, graph, op, tensor

import slackswap as ss


def two_units():
    """Unit A: op a0 (reads A's weights) makes x; unit B: b0 (reads B's weights) reads x and
    saves it, makes y, saved for b1 (unit B, no weights). Backward: b1, b0 in unit B, then a0."""
    return graph(
        [
            op("a0", 1, 1, [], ["x"], unit="A", param_unit="A"),
            op("b0", 1, 1, ["x"], ["y"], unit="B", param_unit="B"),
            op("b1", 1, 1, ["y"], ["z"], unit="B"),
        ],
        [tensor("x", 100, ["b0"]), tensor("y", 100, ["b1"]), tensor("z", 10)],
    )


def test_a_rerun_crossing_units_is_not_rebuildable_and_says_why():
    g = two_units()
    x, y = g.tensor_index["x"], g.tensor_index["y"]
    # x is rebuilt before b0's backward (unit B) by rerunning a0, which reads A's weights
    assert not g.can_recompute[x]
    assert "sharding unit 'A'" in g.recompute_blocker(x) and "'B'" in g.recompute_blocker(x)
    assert g.can_recompute[y]  # b0 reruns before b1's backward: both in unit B
    with pytest.raises(ss.PlanError, match="cannot be recomputed: op 'a0' reads the parameters"):
        ss.complete(ss.Plan(g.name, g.digest, 10**6, {"x": "recompute", "y": "keep"}), g, LINK)
    for solver in ("heuristic", "cpsat"):
        plan = ss.solve(g, ss.min_budget(g, LINK), LINK, solver=solver, work_s=5, time_limit_s=CAP)
        assert plan.decisions["x"] != "recompute"


def test_the_checker_refuses_a_rerun_outside_its_unit_on_its_own():
    g = two_units()
    # a closed plan written by hand (no planner, no complete()): x rebuilt before b0's backward
    plan = ss.Plan(
        g.name,
        g.digest,
        10**6,
        {"x": "recompute", "y": "keep"},
        schedule=ss.Schedule(recompute_at={"x": 4}),
        hardware=LINK,
    )
    check = ss.validate(g, plan)
    assert not check.ok
    assert any(
        v.kind == "recompute" and v.op == "a0" and "unit 'A'" in v.message for v in check.violations
    ), check.violations


def test_a_rebuild_nested_in_another_unit_is_blocked_too():
    """y (unit B's b0 output, read by c0 of unit C) has x in its rerun frontier; were x also
    recomputed it would be rebuilt with y, in C's backward, rerunning a0 (unit A)."""
    g = graph(
        [
            op("a0", 1, 1, [], ["x"], unit="A", param_unit="A"),
            op("a1", 1, 1, ["x"], ["w"], unit="A"),
            op("b0", 1, 1, ["x"], ["y"], unit="B"),
            op("c0", 1, 1, ["y", "w"], ["z"], unit="C", param_unit="C"),
        ],
        [
            tensor("x", 100, ["a1", "b0"]),
            tensor("w", 100, ["c0"]),
            tensor("y", 100, ["c0"]),
            tensor("z", 10),
        ],
    )
    x, y = g.tensor_index["x"], g.tensor_index["y"]
    assert g.can_recompute[y]  # b0 reads no parameters: it may rerun anywhere
    assert "C" in g.rebuild_units[x]  # pulled into C's backward by y's rebuild
    assert not g.can_recompute[x]


def test_graphs_without_units_are_unchanged():
    g = graph(
        [op("a", 1, 1, [], ["x"]), op("b", 1, 1, ["x"], ["y"])],
        [tensor("x", 100, ["b"]), tensor("y", 10)],
    )
    assert not g.has_units and g.can_recompute[g.tensor_index["x"]]
    assert "unit" not in g.to_json()
