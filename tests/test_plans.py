"""Closed plans: every planner's plan carries its complete schedule and hardware, round-trips
through JSON unchanged, and is simulated and checked on that schedule alone; old /1 files load."""

from __future__ import annotations

import json
import logging

import pytest
from helpers import CAP, HALF_DUPLEX, LINK, open_plan, random_graphs, seeded_decisions, seeded_graph
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slackswap as ss


@pytest.mark.parametrize(
    "solver",
    [
        s if s in ("heuristic", "cpsat", "keep-all") else pytest.param(s, marks=pytest.mark.slow)
        for s in ss.solver_names()
    ],
)
def test_every_planner_returns_a_closed_plan_that_round_trips(solver, tmp_path):
    if not ss.is_available(solver):
        pytest.skip(f"{solver} is not installed")
    g = seeded_graph(11)
    plan = ss.solve(g, 0.6, LINK, solver=solver, strict=False, work_s=5, time_limit_s=CAP)
    assert plan.is_complete and plan.hardware == LINK
    swapped = set(plan.tensors("swap"))
    assert set(plan.schedule.d2h_free) == set(plan.schedule.h2d_issue) == swapped
    assert set(plan.schedule.recompute_at) == set(plan.tensors("recompute"))
    path = tmp_path / "plan.json"
    plan.save(path)
    assert json.loads(path.read_text())["format"] == "slackswap.plan/2"
    again = ss.load_plan(path)
    assert again == plan and again.hardware == LINK
    sim, sim_again = ss.simulate(g, plan), ss.simulate(g, again)
    assert sim_again.step_time_s == sim.step_time_s == plan.info.predicted_step_time_s
    assert sim_again.peak_bytes == sim.peak_bytes
    check = ss.validate(g, again)
    assert check.ok == sim.fits and check.peak_bytes == sim.peak_bytes


def test_open_plans_are_refused_downstream_and_completed_once(caplog):
    g = seeded_graph(4)
    hand = open_plan(g, seeded_decisions(g, 4), ss.keep_all_peak(g, LINK))
    with pytest.raises(ss.PlanError, match="complete"):
        ss.simulate(g, hand, LINK)
    with caplog.at_level(logging.WARNING, logger="slackswap"):
        closed = ss.complete(hand, g, LINK)
    assert "completed" in caplog.text
    assert closed.is_complete and closed.info.extra["schedule"].startswith("schedule completed")
    assert ss.complete(closed, g, LINK) is closed  # a closed plan is never planned again
    # the completion is the one solve() uses: same decisions, same schedule, same time
    assert closed.schedule == ss.complete(hand, g, LINK).schedule


def test_version_1_files_still_load_and_complete_deterministically():
    g = ss.workload("bert-large", "a100-80gb-pcie4")
    plan = ss.solve(g, 0.5, "a100-80gb-pcie4", solver="heuristic")
    old = {
        "format": "slackswap.plan/1",
        "graph": g.name,
        "graph_digest": g.digest,
        "budget_bytes": plan.budget_bytes,
        "decisions": dict(plan.decisions),
        "info": {"solver": "heuristic", "status": "heuristic"},
    }
    loaded = ss.load_plan(json.dumps(old))
    assert not loaded.is_complete and loaded.hardware is None  # without its graph: as written
    done = ss.load_plan(json.dumps(old), graph=g)
    assert done.is_complete and done.hardware == ss.hardware("a100-80gb-pcie4")
    # /1 plans were made for the A100 preset by default: the step model's default positions
    # for these decisions there (the solved plan's own positions may differ: it turned some
    # tensors back to keep after scheduling the others, planners/minimal.py)
    again = ss.complete(
        ss.Plan(g.name, g.digest, plan.budget_bytes, dict(plan.decisions)), g, "a100-80gb-pcie4"
    )
    assert done.schedule == again.schedule
    assert ss.simulate(g, done).step_time_s == ss.simulate(g, again).step_time_s
    # a /1 plan with a partial schedule keeps the positions it gives
    first = next(iter(plan.schedule.d2h_free))
    partial = {**old, "schedule": {"d2h_free": {first: plan.schedule.d2h_free[first]}}}
    assert ss.load_plan(partial, graph=g).schedule.d2h_free[first] == plan.schedule.d2h_free[first]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("format", "slackswap.plan/9", "format"),
        ("graph_digest", 12345, "graph_digest"),
        ("info", 5, "info"),
        ("hardware", "a100", "hardware"),
        ("hardware", {"name": "x", "d2h_bytes_per_s": -1}, "hardware"),
        ("schedule", None, "complete schedule"),
    ],
)
def test_bad_plan_files_get_named_errors(field, value, message):
    g = seeded_graph(2)
    data = ss.solve(g, 0.7, LINK, solver="heuristic").to_dict()
    data[field] = value
    with pytest.raises(ss.PlanError, match=message):
        ss.load_plan(data)


def test_solve_plans_for_the_graphs_own_hardware_unless_told():
    """No silent A100: an analytic workload keeps its preset, an explicit hardware wins, and the
    plan says which was used."""
    g = ss.workload("bert-large", "h100-sxm-pcie5")
    plan = ss.solve(g, 0.5, solver="heuristic")
    assert plan.hardware.name == "h100-sxm-pcie5"
    assert plan.info.extra["hardware_from"] == "graph"
    other = ss.solve(g, 0.5, "a100-80gb-pcie4", solver="heuristic")
    assert other.hardware.name == "a100-80gb-pcie4"
    assert other.info.extra["hardware_from"] == "argument"
    bare = ss.load_graph({k: v for k, v in g.to_dict().items() if k != "hardware"})
    assert ss.solve(bare, 0.5, solver="heuristic").info.extra["hardware_from"] == "default"


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(random_graphs(max_ops=8), st.floats(0.05, 1.0), st.sampled_from([LINK, HALF_DUPLEX]))
def test_solve_predicts_what_simulating_the_closed_plan_gives(g, fraction, hw):
    """solve() simulates the closed plan on the expansion it closed it with; simulating the plan
    from its JSON schedule alone must give the same step time and peak, to the bit."""
    lo, hi = ss.min_budget(g, hw), ss.keep_all_peak(g, hw)
    budget = max(lo, int(lo + fraction * (hi - lo)))
    plan = ss.solve(g, budget, hw, solver="heuristic", strict=False)
    again = ss.load_plan(plan.to_json())
    sim = ss.simulate(g, again)
    assert sim.step_time_s == plan.info.predicted_step_time_s
    assert sim.fits == ss.validate(g, again).ok


class _StaleSimulation:
    """A planner whose Solution carries the simulation of other decisions than its own (every
    tensor offloaded) or of another budget: solve() must close the plan from the decisions."""

    name = "stale-simulation"
    options: frozenset[str] = frozenset({"other"})

    def is_available(self) -> bool:
        return True

    def solve(self, problem, time_limit_s=None, other="decisions"):
        from slackswap.check.simulate import simulate_decisions
        from slackswap.core.plan import SolveInfo
        from slackswap.planners.base import Solution
        from slackswap.planners.baselines import keep_all_codes, swap_all_codes

        g, hw = problem.graph, problem.hardware
        codes = keep_all_codes(g)
        if other == "budget":
            sim = simulate_decisions(g, codes, hw, problem.budget_bytes // 2)
        elif other == "hardware":  # a link 1000x slower: the same decisions, another schedule
            slow = hw.with_link(
                d2h_bytes_per_s=hw.d2h_bytes_per_s / 1000, h2d_bytes_per_s=hw.h2d_bytes_per_s / 1000
            )
            sim = simulate_decisions(g, swap_all_codes(g), slow, problem.budget_bytes)
            codes = swap_all_codes(g)
        else:
            sim = simulate_decisions(g, swap_all_codes(g), hw, problem.budget_bytes)
        return Solution(
            codes, None, SolveInfo(solver=self.name, status="heuristic"), simulation=sim
        )


@pytest.mark.parametrize("other", ["decisions", "budget", "hardware"])
def test_a_simulation_of_other_decisions_is_not_the_plans(other):
    ss.register_solver("stale-simulation", f"{__name__}:_StaleSimulation")
    g = seeded_graph(3)
    plan = ss.solve(g, 1.0, LINK, solver="stale-simulation", other=other, strict=False)
    assert set(plan.decisions.values()) == ({"swap"} if other == "hardware" else {"keep"})
    sim = ss.simulate(g, plan)
    assert plan.info.predicted_step_time_s == sim.step_time_s
    if other != "hardware":
        assert sim.step_time_s == g.ideal_step_time_s
    assert ss.validate(g, plan).ok


def test_a_plan_file_with_a_key_given_twice_is_refused():
    g = ss.workload("bert-large", "a100-80gb-pcie4")
    plan = ss.solve(g, 0.5, "a100-80gb-pcie4", solver="heuristic")
    name = next(iter(plan.decisions))
    text = plan.to_json().replace('"decisions": {', f'"decisions": {{"{name}": "recompute", ', 1)
    with pytest.raises(ss.PlanError, match=f"key '{name}' is given twice"):
        ss.load_plan(text)
    graph_text = g.to_json().replace('"name": ', '"name": "twice", "name": ', 1)
    with pytest.raises(ss.GraphError, match="given twice"):
        ss.load_graph(graph_text)


@pytest.mark.parametrize("solver", ["heuristic", "cpsat"])
@pytest.mark.slow
def test_the_checker_holds_a_plan_to_its_claims(solver):
    """A status consistent with the gap and the bound, a bound never above the step: what
    solve() returns passes; each false claim is refused, naming it."""
    g = ss.workload("bert-large", "a100-80gb-pcie4")
    plan = ss.solve(g, 0.5, "a100-80gb-pcie4", solver=solver)
    assert ss.validate(g, plan).ok
    step = plan.info.predicted_step_time_s
    lies = {
        "above its own step": plan.with_info(bound=1.5 * step, gap=None, overhead_gap=None),
        "'optimal'": plan.with_info(status="optimal", bound=0.5 * step, gap=0.5, overhead_gap=None),
        "gap of": plan.with_info(bound=0.9 * step, gap=0.5, overhead_gap=None),
        "without a bound": plan.with_info(bound=None, gap=0.1, overhead_gap=None),
        "overhead gap": plan.with_info(bound=0.99 * step, gap=0.01, overhead_gap=0.9),
    }
    for what, lie in lies.items():
        verdict = ss.validate(g, lie)
        assert not verdict.ok and any(what in str(v) for v in verdict.violations), (what, verdict)
