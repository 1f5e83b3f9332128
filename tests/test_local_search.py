"""Local search: each move is judged by the simulator, so it never returns a worse plan, and it
repairs what aggregate planners get wrong (a copy that cannot be hidden)."""

from pathlib import Path

import numpy as np
import pytest
from helpers import LINK, graph, op, plan, random_plans, tensor
from hypothesis import HealthCheck, given, settings

import slackswap as ss
from slackswap.check.simulate import simulate_decisions
from slackswap.core.codes import codes_to_decisions, decision_codes
from slackswap.core.plan import KEEP, RECOMPUTE
from slackswap.planners.base import Problem
from slackswap.planners.baselines import recompute_all_codes
from slackswap.planners.local_search import improve


def unhidden_copy_graph():
    # A -> a (300 B, saved for B); B reads a -> b (10 B); C reads b -> c (10 B).
    # Forward A 0..1, B 1..2, C 2..2.5; backward C, B, A take 0.5, 1, 1: ideal step 5 s.
    return graph(
        [
            op("A", 1.0, 1.0, ["batch"], ["a"]),
            op("B", 1.0, 1.0, ["a"], ["b"]),
            op("C", 0.5, 0.5, ["b"], ["c"]),
        ],
        [tensor("a", 300, ["B"]), tensor("b", 10), tensor("c", 10)],
    )


def test_swap_that_stalls_becomes_keep_when_memory_allows():
    g = unhidden_copy_graph()
    # swap: the 3 s D2H copy (t=1..4) cannot be hidden by 1.5 s of compute, so backward B
    # waits for it and for the prefetch: 9 s. Keeping a peaks at a + b + c = 320 B <= 1000.
    start = decision_codes(g, {"a": "swap"})
    assert simulate_decisions(g, start, LINK, 1000).step_time_s == pytest.approx(9.0)
    result = improve(g, LINK, 1000, start)
    assert int(result.codes[g.tensor_index["a"]]) == KEEP
    assert result.sim.step_time_s == pytest.approx(5.0)
    assert result.moves == 1 and result.complete


def test_swap_that_stalls_becomes_recompute_when_keep_does_not_fit():
    g = unhidden_copy_graph()
    # budget 315 B: keep peaks at 320 B (over), recompute frees a after B (forward C holds
    # b + c = 20 B) and rebuilds it before backward B (A runs again: +1 s): 6 s, peak a + b = 310 B.
    start = decision_codes(g, {"a": "swap"})
    assert simulate_decisions(g, start, LINK, 315).step_time_s >= 9.0
    assert not ss.simulate(g, plan(g, {"a": "keep"}, 315), LINK).fits
    result = improve(g, LINK, 315, start)
    assert int(result.codes[g.tensor_index["a"]]) == RECOMPUTE
    assert result.sim.step_time_s == pytest.approx(6.0)
    assert result.sim.peak_bytes == 310


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(random_plans(low=0.3, high=1.2))
def test_never_worse_than_the_start_and_the_plan_checks_out(case):
    g, start_plan = case
    budget = start_plan.budget_bytes
    start = decision_codes(g, start_plan)
    before = simulate_decisions(g, start, LINK, budget)
    result = improve(g, LINK, budget, start)
    after = result.sim
    over = (max(0, before.peak_bytes - budget), max(0, after.peak_bytes - budget))
    assert over[1] <= over[0]
    if over[1] == over[0]:
        assert after.step_time_s <= before.step_time_s + 1e-12
    # what it returns is what the decisions simulate to, and a fitting plan passes the validator
    p = plan(g, codes_to_decisions(g, result.codes), budget)
    sim = ss.simulate(g, p, LINK)
    assert sim.step_time_s == pytest.approx(after.step_time_s)
    assert sim.fits == after.fits
    if sim.fits:
        assert ss.validate(g, p, LINK).ok
    if result.moves == 0:
        assert np.array_equal(result.codes, start)


def test_random_groups_move_together():
    # A draws two dropout masks from one RNG stream (100 B each, saved for B); B -> b (100 B,
    # saved for C); C -> c. Ideal: 0.1 + 1 + 0.1 forward, the same backward = 2.4 s.
    g = graph(
        [
            op("A", 0.1, 0.1, ["batch"], ["m1", "m2"]),
            op("B", 1.0, 1.0, ["m1", "m2"], ["b"]),
            op("C", 0.1, 0.1, ["b"], ["c"]),
        ],
        [
            tensor("m1", 100, ["B"], group="rng"),
            tensor("m2", 100, ["B"], group="rng"),
            tensor("b", 100, ["C"]),
            tensor("c", 10),
        ],
    )
    # budget 300 B: keeping both masks peaks at m1 + m2 + b + c = 310 B at forward C; keep m1
    # and swap m2 fits but the 1 s prefetch of m2 behind a 0.1 s backward C stalls (3.3 s);
    # recomputing both (A runs again, 0.1 s) is 2.5 s, but only as a pair: one mask alone may
    # not be recomputed.
    start = decision_codes(g, {"m1": "keep", "m2": "swap", "b": "keep"})
    assert simulate_decisions(g, start, LINK, 300).step_time_s == pytest.approx(3.3)
    result = improve(g, LINK, 300, start)
    assert [int(result.codes[g.tensor_index[n]]) for n in ("m1", "m2")] == [RECOMPUTE, RECOMPUTE]
    assert result.sim.step_time_s == pytest.approx(2.5)
    assert result.sim.peak_bytes == 300


@pytest.mark.slow
def test_warm_start_is_never_worse_than_the_heuristic():
    from slackswap.planners.exact.warmstart import warm_start
    from slackswap.planners.limits import WorkLimits

    g = ss.workload("bert-large", "a100-80gb-pcie4")
    hw = ss.hardware("a100-80gb-pcie4")
    budget = ss.parse_budget(0.4, g, hw)
    ws = warm_start(Problem(g, hw, budget), work=WorkLimits.for_work(10.0))
    assert ws.sim.fits
    assert ws.step_time_s <= ws.heuristic_sim.step_time_s
    # the integral relaxation's bound is a bound: no plan, the warm start included, beats it
    assert ws.bound_s is not None and ws.bound_s <= ws.step_time_s
    assert set(ws.notes) >= {"integral_lp"}


def test_the_warm_start_runs_the_heuristic_once_per_distinct_restriction(monkeypatch):
    """Keep and recompute only (a CPU): the recompute-only start is the problem itself and the
    offload-only start leaves keep alone; neither runs the heuristic again. With every decision
    allowed, both restricted problems are planned by it."""
    from slackswap.planners.exact.warmstart import warm_start
    from slackswap.planners.heuristic import SlackSwapHeuristic
    from slackswap.planners.limits import WorkLimits

    masks = []
    plain_solve = SlackSwapHeuristic.solve

    def counted(self, problem, **options):
        masks.append(problem.mask)
        return plain_solve(self, problem, **options)

    monkeypatch.setattr(SlackSwapHeuristic, "solve", counted)
    g = ss.load_graph(Path(__file__).parent / "data" / "tinygpt_cpu_profile.json")
    cpu = ss.hardware("cpu")
    keep_recompute = ss.core.restrict.decision_mask(g, ("keep", "recompute"))
    problem = Problem(g, cpu, ss.parse_budget(0.7, g, cpu), mask=keep_recompute)
    ws = warm_start(problem, work=WorkLimits.for_work(1.0), polish=False)
    assert len(masks) == 1 and np.array_equal(masks[0], keep_recompute)
    assert ws.sim.fits
    masks.clear()
    warm_start(
        Problem(g, LINK, ss.parse_budget(0.7, g, LINK)), work=WorkLimits.for_work(1.0), polish=False
    )
    assert len(masks) == 3  # the problem, then recompute-only and offload-only


def test_time_limit_stops_the_search_and_says_so():
    g = unhidden_copy_graph()
    start = decision_codes(g, {"a": "swap"})
    result = improve(g, LINK, 1000, start, time_limit_s=0.0)
    assert not result.complete and result.moves == 0
    assert np.array_equal(result.codes, start)
    assert result.sim.step_time_s == pytest.approx(9.0)


def test_a_work_limit_gives_the_same_plan_whatever_the_clock():
    """The search stops on simulated positions, not seconds: two runs with the same work limit
    (and clocks far apart) take the same moves to the same plan, and stop at the limit."""
    g = ss.workload("bert-large", "a100-80gb-pcie4")
    hw = ss.hardware("a100-80gb-pcie4")
    budget = ss.parse_budget(0.3, g, hw)
    start = recompute_all_codes(g)
    work = 40 * g.n_positions
    runs = [
        improve(g, hw, budget, start, time_limit_s=limit, max_work=work) for limit in (60.0, 3600.0)
    ]
    assert np.array_equal(runs[0].codes, runs[1].codes)
    assert runs[0].evaluations == runs[1].evaluations and runs[0].moves == runs[1].moves
    assert not runs[0].complete and work <= runs[0].work <= work + g.n_positions


def test_an_exchange_trades_a_dear_rerun_for_a_cheap_one():
    """tests/data/heuristic_collapse_transformer.json at 280 bytes, from the plan the rules end
    with: q1 (60 bytes) is rerun for 0.35 s; n1 (20 bytes) and both softmax outputs are copied.
    Copying q1 alone makes copies wait (no faster); keeping it alone waits 0.257 s for copies
    (10.408 s, 0.095 s faster) and the single-move search does not take it; the exchange (q1
    back, n1 rerun for 0.0117 s instead) does better, and the search ends with q1 no longer
    rerun, at least 0.2 s faster than the start and 0.15 s faster than keeping q1 alone."""
    from pathlib import Path

    from slackswap.core.plan import SWAP

    g = ss.load_graph(Path(__file__).parent / "data" / "heuristic_collapse_transformer.json")
    index = g.tensor_index
    from slackswap.core.codes import keep_all_codes

    start = keep_all_codes(g)
    start[[index["q1"], index["g0"]]] = RECOMPUTE
    for name in ("n0", "q0", "a0", "o0", "u0", "d0", "n1", "a1", "o1"):
        start[index[name]] = SWAP
    before = simulate_decisions(g, start, LINK, 280)
    assert before.fits
    copied = start.copy()
    copied[index["q1"]] = SWAP  # q1 copied alone: its copies wait, the step is no faster
    assert simulate_decisions(g, copied, LINK, 280).step_time_s >= before.step_time_s
    kept = start.copy()
    kept[index["q1"]] = KEEP
    kept_alone = simulate_decisions(g, kept, LINK, 280)
    assert kept_alone.fits and kept_alone.stall_s > 0.2
    alone = improve(g, LINK, 280, start, time_limit_s=float("inf"))  # single moves only
    assert alone.codes[index["q1"]] == RECOMPUTE
    result = improve(g, LINK, 280, start, time_limit_s=float("inf"), exchanges=True)
    assert result.codes[index["q1"]] != RECOMPUTE
    assert result.codes[index["n1"]] == RECOMPUTE
    assert result.sim.fits
    assert result.sim.step_time_s <= before.step_time_s - 0.2
    assert result.sim.step_time_s <= kept_alone.step_time_s - 0.15


def test_the_heuristic_refuses_exchanges_without_its_polish():
    """exchanges= steers the polish's local search: with polish=False it would be ignored."""
    g = ss.load_graph(Path(__file__).parent / "data" / "heuristic_collapse_transformer.json")
    with pytest.raises(ValueError, match="exchanges"):
        ss.solve(g, 280, LINK, solver="heuristic", polish=False, exchanges=False)
    plain = ss.solve(g, 280, LINK, solver="heuristic", exchanges=False)
    assert ss.validate(g, plain, LINK).ok


def test_a_move_that_stops_a_rebuild_stops_every_rebuild_of_the_same_rerun():
    """N (1 s) makes n (50 B) and s (10 B), both saved for M. Rebuilding both reruns N once: the
    step is 1 + 0.5 forward, 1 (rerun) + 0.5 + 1 backward = 4.0 s. Keeping n alone still reruns
    N for s (4.0 s), and so does keeping s alone: no single move improves. Keeping n stops s's
    rebuild too (the same rerun): 3.0 s, the ideal step."""
    from slackswap.core.codes import keep_all_codes

    g = graph(
        [
            op("N", 1.0, 1.0, ["batch"], ["n", "s"]),
            op("M", 0.5, 0.5, ["n", "s"], ["m"]),
        ],
        [tensor("n", 50, ["M"]), tensor("s", 10, ["M"]), tensor("m", 10)],
    )
    budget = ss.keep_all_peak(g, LINK)
    index = g.tensor_index
    start = keep_all_codes(g)
    start[[index["n"], index["s"]]] = RECOMPUTE
    assert simulate_decisions(g, start, LINK, budget).step_time_s == pytest.approx(4.0)
    for name in ("n", "s"):
        alone = start.copy()
        alone[index[name]] = KEEP
        assert simulate_decisions(g, alone, LINK, budget).step_time_s == pytest.approx(4.0)
    result = improve(g, LINK, budget, start, time_limit_s=float("inf"))
    assert result.codes[index["n"]] == KEEP and result.codes[index["s"]] == KEEP
    assert result.sim.step_time_s == pytest.approx(3.0)
