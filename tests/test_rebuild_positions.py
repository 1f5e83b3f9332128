"""Tensor.rebuilt_before: the latest position a recomputed tensor may be rebuilt at (torch's
checkpoint reruns a region at once, at its entry). The step model rebuilds there, the exact
planner never later, and the checker refuses a plan that rebuilds later."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import CAP, LINK, graph, op, open_plan, random_graphs, tensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slackswap as ss


def chain(rebuilt_before=None):
    """x -> A -> a -> B -> b -> C -> c -> D -> d; B's output b is saved for C (and rebuilt from
    a, which B's backward reads); c is saved for D, whose backward takes 5 bytes of workspace."""
    ops = [
        op("A", 1.0, 1.0, ["x"], ["a"]),
        op("B", 1.0, 1.0, ["a"], ["b"]),
        op("C", 1.0, 1.0, ["b"], ["c"]),
        op("D", 1.0, 1.0, ["c"], ["d"], backward_workspace_bytes=5),
    ]
    tensors = [
        tensor("a", 100, ["B"]),
        tensor("b", 10, ["C"]),
        tensor("c", 1000, ["D"]),
        tensor("d", 1, []),
    ]
    if rebuilt_before:
        tensors[1]["rebuilt_before"] = rebuilt_before
    return graph(ops, tensors)


def test_the_graph_checks_and_keeps_the_field():
    g = chain("D")
    assert g.tensors[g.tensor_index["b"]].rebuilt_before == "D"
    again = ss.load_graph(g.to_json())
    assert again.digest == g.digest != chain().digest
    assert list(g.rebuild_position) == [-1, 4, -1, -1]  # backward of D: 2 x 4 - 1 - 3
    with pytest.raises(ss.GraphError, match="tensor 'b'.*unknown op 'E'"):
        chain("E")
    # b's first backward use is C's (position 5); A's backward (position 7) comes after it
    with pytest.raises(ss.GraphError, match="tensor 'b'.*after the tensor's first backward use"):
        chain("A")
    ops = [op("A", 1.0, 1.0, ["x"], ["a"]), op("B", 1.0, 1.0, ["a"], ["b"])]
    with pytest.raises(ss.GraphError, match="tensor 'b'.*not saved"):
        graph(ops, [tensor("a", 1, ["B"]), {**tensor("b", 1, []), "rebuilt_before": "B"}])


def test_a_recomputed_tensor_is_rebuilt_at_its_latest_position_and_held_from_there():
    """Recompute b: rebuilt before C's backward (position 5) by default; with rebuilt_before D,
    before D's backward (position 4), so D's backward holds b's 10 bytes more."""
    decisions = {"a": "keep", "b": "recompute", "c": "keep"}
    plain, forced = chain(), chain("D")
    budget = ss.keep_all_peak(plain, LINK)
    p_plain = ss.complete(open_plan(plain, decisions, budget), plain, LINK)
    p_forced = ss.complete(open_plan(forced, decisions, budget), forced, LINK)
    assert p_plain.schedule.recompute_at["b"] == 5 and p_forced.schedule.recompute_at["b"] == 4
    s_plain, s_forced = ss.simulate(plain, p_plain), ss.simulate(forced, p_forced)

    # D's backward runs at the last point of position 4 (a rerun, when there is one, before it)
    def at_d(sim):
        return sim.memory_bytes[sim.expansion.position_first_point[5] - 1]

    # at D's backward: a (100), c (1000) and the workspace (5); b (10) only when rebuilt there
    assert at_d(s_plain) == 1105 and at_d(s_forced) == 1115
    assert s_forced.step_time_s == s_plain.step_time_s  # B reruns once either way
    assert ss.validate(forced, p_forced).ok


def test_the_checker_refuses_a_rebuild_after_the_latest_position():
    """A plan that rebuilds b at its first use (5) on the graph that says D (4): the simulator
    runs it as written; the checker names the rule."""
    g = chain("D")
    late = ss.complete(
        open_plan(
            g,
            {"a": "keep", "b": "recompute", "c": "keep"},
            ss.keep_all_peak(g, LINK),
            {"recompute_at": {"b": 5}},
        ),
        g,
        LINK,
    )
    assert ss.simulate(g, late).fits
    check = ss.validate(g, late)
    assert not check.ok
    assert any("latest rebuild position" in str(v) and v.tensor == "b" for v in check.violations)


@st.composite
def annotated(draw):
    """A random graph whose recomputable saved tensors get a random latest rebuild position
    (an op at or after their first backward reader)."""
    g = draw(random_graphs(max_ops=7))
    tensors = list(g.tensors)
    for t in g.saved:
        if g.can_recompute[t] and draw(st.booleans()):
            first = int(g.first_backward_use[t])
            at = draw(st.integers(first, g.n_ops - 1))
            tensors[t] = replace(tensors[t], rebuilt_before=g.ops[at].name)
    return replace(g, tensors=tuple(tensors))


@pytest.mark.parametrize("solver", ["heuristic", pytest.param("cpsat", marks=pytest.mark.slow)])
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(annotated(), st.floats(0.0, 1.0))
def test_every_planner_rebuilds_no_later_than_the_graph_allows(solver, g, fraction):
    lo, hi = ss.min_budget(g, LINK), ss.keep_all_peak(g, LINK)
    budget = int(lo + fraction * (hi - lo))
    # strict=False: a plan that breaks a rule comes back (strict would refuse it as infeasible)
    options = {"gap": 0.0} if solver == "cpsat" else {}
    plan = ss.solve(
        g, budget, LINK, solver=solver, work_s=5, time_limit_s=CAP, strict=False, **options
    )
    check = ss.validate(g, plan)
    assert not [v for v in check.violations if v.kind != "memory"], check.violations
    for name, position in plan.schedule.recompute_at.items():
        latest = g.rebuild_position[g.tensor_index[name]]
        assert latest < 0 or position <= latest
    if solver == "cpsat":
        assert check.ok  # the exact planner's plans fit (the heuristic may find none at all)


@pytest.mark.parametrize("solver", ["heuristic", pytest.param("cpsat", marks=pytest.mark.slow)])
def test_no_plan_rebuilds_later_to_fit(solver):
    """a kept (pinned), keep and recompute only, at 1110 bytes (C's forward holds a, b, c: 100 +
    10 + 1000): at D's backward a, c and the workspace take 1105, so b (10) fits there neither
    kept nor rebuilt; recomputing b fits only when it is rebuilt at its first use (C's backward,
    position 5). On the graph that says b is rebuilt before D's backward no plan fits; on the plain graph
    the plan recomputes b at position 5."""
    options = dict(allowed=("keep", "recompute"), pins={"a": "keep"}, work_s=5, time_limit_s=CAP)
    plain = ss.solve(chain(), 1110, LINK, solver=solver, **options)
    assert plain.decisions["b"] == "recompute" and plain.schedule.recompute_at["b"] == 5
    with pytest.raises(ss.InfeasibleBudget):
        ss.solve(chain("D"), 1110, LINK, solver=solver, **options)
    loose = ss.solve(chain("D"), 1110, LINK, solver=solver, strict=False, **options)
    assert {v.kind for v in ss.validate(chain("D"), loose).violations} == {"memory"}
