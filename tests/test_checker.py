"""The independent checker: it agrees with the simulator on random plans, it shares no code with
the step model, and it catches the plans a bugged step model calls valid (mutation tests)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from helpers import HALF_DUPLEX, LINK, open_plan, random_graphs, seeded_decisions, seeded_graph
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slackswap as ss
from slackswap.check import simulate as simulate_module
from slackswap.core import stepmodel
from slackswap.core.graph import ActivationGraph

HARDWARE = (LINK, HALF_DUPLEX, LINK.with_link(name="test-latency", latency_s=0.05))


@st.composite
def scheduled_plans(draw):
    """A random graph and decisions, closed with the default schedule, whose positions are then
    moved at random within (and sometimes just outside) the ranges the rules allow."""
    g = draw(random_graphs())
    decisions = {}
    for t in g.saved:
        choices = ["keep", "swap"] + (["recompute"] if g.can_recompute[t] else [])
        decisions[g.tensors[t].name] = draw(st.sampled_from(choices))
    hw = draw(st.sampled_from(HARDWARE))
    peak = ss.keep_all_peak(g, hw)
    budget = draw(st.integers(max(1, peak // 4), max(1, 2 * peak)))
    plan = ss.complete(open_plan(g, decisions, budget), g, hw)
    if draw(st.booleans()):
        s = plan.schedule
        positions = g.n_positions
        move = st.integers(-2, 2)
        d2h = {t: min(positions - 1, max(0, p + draw(move))) for t, p in s.d2h_free.items()}
        h2d = {t: min(positions - 1, max(0, p + draw(move))) for t, p in s.h2d_issue.items()}
        rec = {t: min(positions - 1, max(0, p + draw(move))) for t, p in s.recompute_at.items()}
        plan = dataclasses.replace(plan, schedule=ss.Schedule(d2h, h2d, rec))
    return g, plan


def _agree(g, plan):
    """Checker and simulator: the same verdict, peak and step time (or both refuse)."""
    check = ss.validate(g, plan)
    try:
        sim = ss.simulate(g, plan)
    except ss.PlanError:
        assert not check.ok and check.violations[0].kind == "schedule"
        return None
    assert check.ok == sim.fits, (check.report(), sim.violations)
    assert check.peak_bytes == sim.peak_bytes
    assert math.isclose(check.step_time_s, sim.step_time_s, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(check.stall_s, sim.stall_s, rel_tol=1e-9, abs_tol=1e-9)
    return sim


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scheduled_plans())
def test_checker_and_simulator_agree_on_a_thousand_random_plans(case):
    _agree(*case)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scheduled_plans())
def test_checker_and_simulator_agree(case):
    _agree(*case)


def test_checker_agrees_on_seeded_graphs_with_groups_and_pinned_ops():
    """Graphs with RNG groups, workspaces and non-recomputable ops, every decision mix."""
    checked = 0
    for seed in range(60):
        g = seeded_graph(seed)
        for hw in HARDWARE:
            peak = ss.keep_all_peak(g, hw)
            for fraction in (0.4, 0.7, 1.0):
                plan = ss.complete(
                    open_plan(g, seeded_decisions(g, seed), int(peak * fraction)), g, hw
                )
                if _agree(g, plan) is not None:
                    checked += 1
    assert checked == 60 * 3 * 3


def test_checker_refuses_open_plans_and_names_what_is_missing():
    g = seeded_graph(3)
    decisions = {g.tensors[t].name: "swap" for t in g.saved}
    open_ = open_plan(g, decisions, 10**9)
    assert "not closed" in ss.validate(g, open_).report()
    half = dataclasses.replace(open_, hardware=LINK, schedule=ss.Schedule(d2h_free={}))
    report = ss.validate(g, half).report()
    assert "d2h_free has no position" in report and "not complete" in report


def test_checker_flags_a_false_step_time_claim():
    g = seeded_graph(5)
    plan = ss.solve(g, 0.6, LINK, solver="heuristic")
    assert ss.validate(g, plan).ok
    lie = plan.with_info(predicted_step_time_s=plan.info.predicted_step_time_s * 0.9)
    check = ss.validate(g, lie)
    assert not check.ok and check.violations[0].kind == "claim"


# ------------------------------------------------------------------------- mutation tests
# Each bug is patched into the step model or the simulator, never into the checker. Plans are
# made, closed and priced under the bug, as a planner would; the checker must flag every one the
# bugged model calls valid whose truth (the unpatched model) differs, and at least a few must
# exist, so no mutation test can pass by finding nothing.


def _free_one_position_early(monkeypatch):
    original = stepmodel._intervals

    def bugged(graph, codes, *args):
        exp = original(graph, codes, *args)
        end = exp.iv_end.copy()
        first_life = (
            (~exp.iv_transient)
            & (codes[exp.iv_tensor] == stepmodel.SWAP)
            & (exp.iv_start == graph.producer[exp.iv_tensor])
        )
        end[first_life] = np.maximum(exp.iv_start[first_life], end[first_life] - 1)
        return dataclasses.replace(exp, iv_end=end)

    monkeypatch.setattr(stepmodel, "_intervals", bugged)


def _drop_one_frontier_tensor(monkeypatch):
    closures = ActivationGraph._closures.func

    def bugged(self):
        ops, frontier = closures(self)
        return ops, tuple(f[1:] for f in frontier)

    prop = property(bugged)
    monkeypatch.setattr(
        ActivationGraph, "rerun_frontier", property(lambda self: prop.fget(self)[1])
    )


def _overlap_copies_on_a_lane(monkeypatch):
    monkeypatch.setattr(simulate_module, "lane_start", lambda lane_free_at, earliest: earliest)


def _skip_workspace(monkeypatch):
    monkeypatch.setattr(
        stepmodel.Expansion,
        "memory",
        lambda self, with_workspace=True: stepmodel.interval_memory(self, False),
    )


def _truth(g, plan):
    try:
        return ss.simulate(g, plan)
    except ss.PlanError:
        return None


@pytest.mark.parametrize(
    "mutation",
    [
        _free_one_position_early,
        _drop_one_frontier_tensor,
        _overlap_copies_on_a_lane,
        _skip_workspace,
    ],
)
@pytest.mark.slow
def test_checker_catches_what_a_bugged_step_model_lets_through(mutation, monkeypatch):
    caught = 0
    for seed in range(80):
        g = seeded_graph(seed)
        for hw in (LINK, HALF_DUPLEX):
            decisions = seeded_decisions(g, seed)
            with monkeypatch.context() as m:
                mutation(m)
                g_bug = ss.load_graph(g.to_dict())  # fresh cached columns under the bug
                try:
                    # priced under the bug: its peak becomes the budget, as a planner would
                    probe = ss.complete(open_plan(g_bug, decisions, 10**12), g_bug, hw)
                    bugged_peak = ss.simulate(g_bug, probe).peak_bytes
                    plan = ss.complete(open_plan(g_bug, decisions, bugged_peak), g_bug, hw)
                    bugged = ss.simulate(g_bug, plan)
                except ss.PlanError:
                    continue
                if not bugged.fits:
                    continue
                plan = plan.with_info(predicted_step_time_s=bugged.step_time_s)
                check = ss.validate(g_bug, plan)
            truth = _truth(g, plan)
            wrong = (
                truth is None
                or not truth.fits
                or not math.isclose(
                    truth.step_time_s, bugged.step_time_s, rel_tol=1e-9, abs_tol=1e-12
                )
            )
            if wrong:
                assert not check.ok, f"seed {seed}: the checker passed a plan the bug got wrong"
                caught += 1
            else:
                assert check.ok, f"seed {seed}: {check.report()}"
    print(mutation.__name__, "caught", caught)
    assert caught >= 5, f"the bug changed only {caught} plans: the mutation test proves nothing"


def test_solve_refuses_rather_than_return_a_plan_a_bugged_model_made(monkeypatch):
    """With workspaces skipped by the step model, planners aim below the true peak; solve()'s
    checker turns that into InfeasibleBudget instead of a plan that does not fit."""
    _skip_workspace(monkeypatch)
    refused = 0
    for seed in range(40):
        g = seeded_graph(seed)
        try:
            plan = ss.solve(g, 0.5, LINK, solver="heuristic")
        except ss.InfeasibleBudget:
            refused += 1
            continue
        monkeypatch.undo()
        assert ss.simulate(g, plan).fits
        _skip_workspace(monkeypatch)
    assert refused >= 1
