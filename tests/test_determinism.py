"""Results that do not depend on the machine: work limits end every phase the clock does not,
the phases the clock did end are named, and CP-SAT's two workers search deterministically
(interleaved) without the abort OR-Tools 9.15 has on an infeasible complete hint."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from helpers import CAP, LINK, seeded_graph

import slackswap as ss
from slackswap.planners.exact.model import Model

pytestmark = pytest.mark.skipif(not ss.is_available("cpsat"), reason="OR-Tools not installed")


def test_first_violation_names_the_broken_row():
    m = Model()
    a, b = m.binary("a"), m.var("b", 0, 10)
    m.le("a_plus_b", [(a, 1), (b, 1)], 5)
    m.ge("b_when_a", [(b, 1)], 4, enforce=(a,))
    assert m.first_violation({a: 1, b: 4}) is None  # 1 + 4 <= 5, and b >= 4 since a = 1
    assert m.first_violation({a: 1, b: 5}) == "a_plus_b"  # 1 + 5 = 6 > 5
    assert m.first_violation({a: 1, b: 3}) == "b_when_a"  # a = 1 enforces b >= 4
    assert m.first_violation({a: 0, b: 3}) is None  # not enforced when a = 0
    assert m.first_violation({a: 0, b: 11}) == "b"  # outside b's domain [0, 10]
    assert m.first_violation({a: 0}) == "incomplete"


@pytest.mark.slow
def test_interleaved_cpsat_survives_an_infeasible_complete_hint():
    """A skip graph with 0 / 1e-9 / 1e-6 s ops, whose complete hint the rounded model rejects:
    OR-Tools aborts the whole process when such a hint reaches an interleaved search, so the
    solve runs in a child."""
    code = textwrap.dedent("""
        import slackswap as ss
        g = ss.load_graph("tests/data/tiny_times_skips.json")
        hw = ss.hardware("a100-80gb-pcie4").with_link(d2h_bytes_per_s=24e9, h2d_bytes_per_s=24e9,
                                                          latency_s=0.0)
        for budget in (2611029, 3274060, 5456767):
            plan = ss.solve(g, budget, hw, solver="cpsat", time_limit_s=2, workers=2)
            print("status", plan.info.status)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("status") == 3


@pytest.mark.parametrize("seed", [1, pytest.param(7, marks=pytest.mark.slow)])
def test_same_input_same_plan_and_proof_when_no_clock_stopped_a_phase(seed):
    g = seeded_graph(seed, n_ops=8)
    budget = (ss.min_budget(g, LINK) + ss.keep_all_peak(g, LINK)) // 2
    plans = [
        ss.solve(g, budget, LINK, solver="cpsat", work_s=30, time_limit_s=CAP) for _ in range(2)
    ]
    first, second = plans
    assert first.info.extra["clock_stopped"] == []  # small graph, ample time: work limits alone
    assert first.decisions == second.decisions
    assert first.schedule == second.schedule
    assert (first.info.status, first.info.bound, first.info.gap) == (
        second.info.status,
        second.info.bound,
        second.info.gap,
    )


def test_a_clock_ended_phase_is_named_and_the_plan_says_timeout():
    g = ss.workload("bert-large", "a100-80gb-pcie4")
    # 30 s of work cannot be done within a 1 s cap on any machine: the cap binds, and whatever
    # it cut is said, with status "timeout" (another machine would return another plan)
    plan = ss.solve(g, 0.3, "a100-80gb-pcie4", solver="cpsat", time_limit_s=1.0, work_s=30.0)
    assert plan.info.extra["clock_stopped"], plan.info.extra
    assert plan.info.status == "timeout"
    assert ss.validate(g, plan).ok


@pytest.mark.slow
def test_a_short_time_limit_sizes_the_work_and_the_clock_does_not_bind():
    g = ss.workload("bert-large", "a100-80gb-pcie4")
    # with work sized by a 1 s limit, the integral relaxation (182,166 cells, about 1.2 s for
    # its root node here) is too large for the work and is left out by size, not by the clock:
    # the same plan on any machine
    plans = [
        ss.solve(g, 0.3, "a100-80gb-pcie4", solver="cpsat", time_limit_s=60.0, work_s=1.0)
        for _ in range(2)
    ]
    assert plans[0].info.extra["clock_stopped"] == []
    assert plans[0].info.extra["integral_lp"]["reason"] == "model too large for the work"
    assert plans[0].decisions == plans[1].decisions
    assert plans[0].info.status == plans[1].info.status != "timeout"


@pytest.mark.slow
def test_the_default_runs_every_phase_on_work_limits():
    g = seeded_graph(5, n_ops=10)
    budget = ss.min_budget(g, LINK)
    plan = ss.solve(g, budget, LINK, solver="cpsat", time_limit_s=120, work_s=20)
    limits = plan.info.extra["work_limits"]
    # the integral relaxations stop on branch-and-bound nodes, not on a share of the clock
    assert limits["anytime"] is False and limits["relax_nodes"] >= 1
    assert limits["relax_cap_s"] == float("inf") and limits["search_cap_s"] is None
    assert plan.info.extra["clock_stopped"] == []
    assert ss.validate(g, plan).ok
    # anytime=True lets the clock stop the phases instead; the old switch is gone, by name
    anytime = ss.solve(g, budget, LINK, solver="cpsat", time_limit_s=5, anytime=True)
    assert anytime.info.extra["work_limits"]["anytime"] is True
    with pytest.raises(ValueError, match="deterministic"):
        ss.solve(g, budget, LINK, solver="cpsat", deterministic=True)


@pytest.mark.slow
def test_the_default_gives_the_same_plan_beside_two_busy_processes():
    """FCN8 at 50% with swaps (the departure bound, the relaxations, the local searches, the
    proof): the same decisions, schedule, status and bound idle and with two busy processes on
    the machine's cores, and no phase stopped by the clock (its cap far above the work)."""
    g = ss.cnn_graph("fcn8", "a100-80gb-pcie4")

    def plan():
        return ss.solve(g, 0.5, "a100-80gb-pcie4", solver="cpsat", work_s=10, time_limit_s=CAP)

    idle = plan()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded = plan()
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert idle.info.extra["clock_stopped"] == loaded.info.extra["clock_stopped"] == []
    assert idle.decisions == loaded.decisions and idle.schedule == loaded.schedule
    assert (idle.info.status, idle.info.bound, idle.info.gap) == (
        loaded.info.status,
        loaded.info.bound,
        loaded.info.gap,
    )


def test_a_cpsat_round_runs_only_where_its_work_pays_for_its_models_size():
    from slackswap.planners.limits import WorkLimits

    work = WorkLimits.for_work(10.0)
    # 10 s of work: the MILP's share is 25%, 2.5 s, 1.25 s for each of the two LP-guided rounds;
    # the model's size costs 2e-5 s a nonzero
    assert work.milp_s == 2.5
    assert work.cpsat_round_runs(1.25, 62_500)  # 2e-5 x 62,500 = 1.25 s: just paid for
    assert not work.cpsat_round_runs(1.25, 62_600)  # 1.252 s: the floor alone would run it
    assert not work.cpsat_round_runs(1.25, 117_900)  # HF GPT-2, 12 layers, at 30%: 2.36 s
    assert work.cpsat_round_runs(1.25, 300)  # a tiny model runs on the floor's 0.05 units
    assert work.cpsat_dtime(1.25, 300) == pytest.approx(0.25 * (1.25 - 2e-5 * 300))
    assert WorkLimits.for_work(10.0, anytime=True).cpsat_round_runs(1.25, 10**7)


@pytest.mark.slow
def test_rounds_whose_work_does_not_pay_for_the_model_are_skipped_by_size_not_the_clock():
    g = seeded_graph(1, n_ops=30)  # 60 positions, swaps on the link: a MILP of 5,908 nonzeros
    budget = (ss.min_budget(g, LINK) + ss.keep_all_peak(g, LINK)) // 2
    # the whole model in one round, with the MILP's 25% of the work. work_s=0.3: 0.075 s against
    # 5,908 nonzeros x 2e-5 = 0.118 s of building and presolve: not run, on any machine
    plans = [
        ss.solve(g, budget, LINK, solver="cpsat", time_limit_s=CAP, work_s=0.3) for _ in range(2)
    ]
    first, second = plans
    skipped = first.info.extra["milp_rounds"]
    assert skipped["status"] == "skipped" and "5908 nonzeros" in skipped["reason"]
    assert "rounds" not in first.info.extra and first.info.extra["reason"] == skipped["reason"]
    assert first.info.extra["clock_stopped"] == [] and first.info.status != "timeout"
    assert first.decisions == second.decisions and first.schedule == second.schedule
    assert ss.validate(g, first).ok
    # work_s=0.5: 0.125 s >= 0.118 s, the round runs
    searched = ss.solve(g, budget, LINK, solver="cpsat", time_limit_s=CAP, work_s=0.5)
    assert "milp_rounds" not in searched.info.extra
    assert searched.info.extra["strategy"] == "whole"
    assert ss.validate(g, searched).ok
    # where no start fits (another graph at its smallest keep-and-recompute budget) the MILP is
    # the search left: it runs on CP-SAT's floor whatever its size (4,983 nonzeros, 0.0997 s,
    # against 0.075 s of work)
    other, kept = seeded_graph(2, n_ops=20), ("keep", "recompute")
    smallest = ss.min_budget(other, LINK, allowed=kept)
    tight = ss.solve(
        other, smallest, LINK, solver="cpsat", time_limit_s=CAP, work_s=0.3, allowed=kept
    )
    assert tight.info.extra["warm_start_step_time_s"] == float("inf")
    assert tight.info.extra["model"]["nonzeros"] == 4983
    assert "milp_rounds" not in tight.info.extra
    assert ss.validate(other, tight).ok and ss.simulate(other, tight).fits


@pytest.mark.slow
def test_the_proof_round_runs_only_where_its_work_pays_for_its_models_size():
    g = seeded_graph(1, n_ops=30)  # 2,040 positions x saved tensors: a proof round is built
    budget = (ss.min_budget(g, LINK) + ss.keep_all_peak(g, LINK)) // 2
    # its model over every position has 38,730 nonzeros: 0.77 s of building and presolve at
    # 2e-5 s each. work_s=1 gives the proof round 20% of it, 0.2 s: not run, on any machine
    short = ss.solve(g, budget, LINK, solver="cpsat", work_s=1.0, time_limit_s=CAP)
    assert short.info.extra["proof_round"] == {"skipped": "38730 nonzeros for 0.2 s of work"}
    assert short.info.extra["clock_stopped"] == [] and ss.validate(g, short).ok
    # work_s=4: 0.8 s >= 0.77 s, it runs
    longer = ss.solve(g, budget, LINK, solver="cpsat", work_s=4.0, time_limit_s=CAP)
    assert longer.info.extra["proof_round"]["model"]["nonzeros"] == 38730
    assert ss.validate(g, longer).ok


def test_the_heuristics_polish_stops_at_the_callers_time_limit_and_says_so():
    """solve(solver="heuristic")'s time limit is a hard cap: with 1 us the polish (bounded by
    work, 0.5-0.8 s on GPT-2 XL here) is stopped by the clock after simulating its start, the
    plan is the rules' own, checked and fitting, and info names the phase. With a cap far above
    the work (600 s), the work ends it: no phase is named."""
    hw = ss.hardware("a100-80gb-pcie4")
    g = ss.workload("gpt2-xl", hw)
    capped = ss.solve(g, 0.5, hw, solver="heuristic", time_limit_s=1e-6)
    assert capped.info.extra["clock_stopped"] == ["polish"]
    assert ss.validate(g, capped).ok and ss.simulate(g, capped).fits
    free = ss.solve(g, 0.5, hw, solver="heuristic", time_limit_s=600)
    assert "clock_stopped" not in free.info.extra and free.info.extra["polish_moves"] > 0
    assert ss.simulate(g, free).step_time_s <= ss.simulate(g, capped).step_time_s
