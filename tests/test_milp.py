"""The exact planner: its plans are checked by the validator and the simulator, the backends
agree, and it is never beaten by the heuristic, the baselines or exhaustive search."""

import itertools

import pytest
from helpers import CAP, LINK, graph, op, plan, random_graphs, tensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slackswap as ss

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def graph_budget(draw, max_ops=5, max_saved=None):
    g = draw(random_graphs(max_ops=max_ops, max_saved=max_saved))
    lo, hi = ss.min_budget(g, LINK), ss.keep_all_peak(g, LINK)
    budget = draw(st.integers(max(lo, 1), max(hi, lo, 1)))
    return g, budget


def resolvable(g, span):
    """Whether every op's time is a whole number of the exact models' time units or more."""
    return all(t == 0 or t >= 1e-5 * span for o in g.ops for t in (o.forward_s, o.backward_s))


def retention(g, p):
    sim = ss.simulate(g, p, LINK)
    assert sim.fits
    return sim.retention


@pytest.mark.slow
@SETTINGS
@given(graph_budget())
def test_backends_agree_and_plans_check_out(case):
    g, budget = case
    objectives = {}
    for solver in ("cpsat", "cbc", "highs", "scip"):
        p = ss.solve(g, budget, LINK, solver=solver, work_s=20, time_limit_s=CAP, gap=0.0)
        assert ss.validate(g, p, LINK).ok
        sim = ss.simulate(g, p, LINK)
        assert sim.fits and sim.peak_bytes <= budget
        span = g.ideal_step_time_s + sum(2 * g.tensors[t].bytes / 100.0 for t in g.saved)
        if resolvable(g, span):
            assert p.info.status == "optimal"
        else:
            # an op under the models' time unit (span / 1e7) cannot be told from zero: a proof
            # may be out of reach, and then the plan says so rather than claim one
            assert p.info.status in ("optimal", "feasible") and p.info.bound <= sim.step_time_s
        # the model's step time (its objective) is the simulator's, to rounding: under 1%, and
        # in absolute terms at most one time unit (1e-7 of ideal + copy time) per op and transfer
        assert p.info.predicted_step_time_s == pytest.approx(sim.step_time_s, rel=1e-12)
        assert p.info.objective >= sim.step_time_s * (1 - 1e-12)
        assert p.info.objective == pytest.approx(
            sim.step_time_s, rel=0.01, abs=1e-7 * span * (2 * g.n_ops + 2 * len(g.saved)) + 1e-15
        )
        objectives[solver] = p.info.objective
    # their optima agree to the rounding: CP-SAT's time unit is 10x finer (span / 1e8, exact
    # integers) than CBC's, HiGHS's and SCIP's (span / 1e7), so each objective is within the coarser
    # model's rounding of the one optimum
    values = list(objectives.values())
    rounding = 1e-7 * span * (2 * g.n_ops + 2 * len(g.saved))
    assert max(values) - min(values) <= 1e-6 * max(values) + rounding + 1e-9, objectives


@pytest.mark.slow
@SETTINGS
@given(graph_budget())
def test_optimal_beats_heuristic_beats_baselines_and_respects_lp_bound(case):
    g, budget = case
    best = retention(g, ss.solve(g, budget, LINK, solver="cpsat", gap=0.0))
    heuristic = retention(g, ss.solve(g, budget, LINK, solver="heuristic"))
    baselines = []
    for name in ("keep-all", "recompute-all", "swap-all"):
        sim = ss.simulate(g, ss.solve(g, budget, LINK, solver=name, strict=False), LINK)
        if sim.fits:
            baselines.append(sim.retention)
    assert best >= heuristic - 1e-9
    assert heuristic >= max(baselines, default=0.0) - 1e-9
    assert best <= ss.lp_bound(g, budget, LINK).retention + 1e-6


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(graph_budget(), st.floats(0.0, 1.0))
def test_optimal_step_time_never_worse_with_more_budget(case, more):
    g, budget = case
    bigger = budget + int(more * max(1, ss.keep_all_peak(g, LINK) - budget))
    t1 = ss.solve(g, budget, LINK, solver="cpsat", gap=0.0).info.predicted_step_time_s
    t2 = ss.solve(g, bigger, LINK, solver="cpsat", gap=0.0).info.predicted_step_time_s
    assert t2 <= t1 * (1 + 1e-9) + 1e-12


def exhaustive_best(g, budget):
    names = [g.tensors[t].name for t in g.saved]
    choices = [["keep", "swap"] + (["recompute"] if g.can_recompute[t] else []) for t in g.saved]
    best = 0.0
    for combo in itertools.product(*choices):
        sim = ss.simulate(g, plan(g, dict(zip(names, combo)), budget), LINK)
        if sim.fits:
            best = max(best, sim.retention)
    return best


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(graph_budget(max_ops=5, max_saved=5))
def test_exhaustive_search_never_beats_the_solver(case):
    g, budget = case
    p = ss.solve(g, budget, LINK, solver="cpsat", gap=0.0)
    assert retention(g, p) >= exhaustive_best(g, budget) - 1e-9


@pytest.mark.slow
def test_exhaustive_seven_tensors():
    # a chain with a skip: 7 saved tensors, 3^7 decision vectors
    ops = [
        op("A", 1.0, 2.0, ["x"], ["a"]),
        op("B", 0.2, 0.4, ["a"], ["b"]),
        op("C", 2.0, 4.0, ["b"], ["c"]),
        op("D", 0.1, 0.2, ["c", "a"], ["d"]),
        op("E", 1.5, 3.0, ["d"], ["e"]),
        op("F", 0.1, 0.3, ["e"], ["f"]),
        op("G", 1.0, 2.0, ["f"], ["g"]),
    ]
    tensors = [
        tensor("a", 300, ["B"]),
        tensor("b", 100, ["C"]),
        tensor("c", 300, ["D"]),
        tensor("d", 100, ["E"]),
        tensor("e", 300, ["F"]),
        tensor("f", 100, ["G"]),
        tensor("g", 50, ["G"]),
    ]
    g = graph(ops, tensors)
    lo, hi = ss.min_budget(g, LINK), ss.keep_all_peak(g, LINK)
    budget = lo + (hi - lo) // 3
    p = ss.solve(g, budget, LINK, solver="cpsat", gap=0.0)
    assert retention(g, p) >= exhaustive_best(g, budget) - 1e-9


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(graph_budget(max_ops=5, max_saved=5))
def test_the_models_own_bound_less_its_rounding_is_below_every_plan(case):
    """Over every position the model rounds each op, copy and rerun up to its time unit; its
    bound, less what that can add to a plan (Formulation.rounding_units), is a proof:
    exhaustive search over every decision finds no plan below it."""
    g, budget = case
    p = ss.solve(
        g, budget, LINK, solver="cpsat", gap=0.0, warm_start=False, full=True, strategy="whole"
    )
    milp_bound = p.info.extra.get("milp_bound_s")
    assert milp_bound is not None
    best = None
    names = [g.tensors[t].name for t in g.saved]
    choices = [["keep", "swap"] + (["recompute"] if g.can_recompute[t] else []) for t in g.saved]
    for combo in itertools.product(*choices):
        sim = ss.simulate(g, plan(g, dict(zip(names, combo)), budget), LINK)
        if sim.fits:
            best = sim.step_time_s if best is None else min(best, sim.step_time_s)
    assert milp_bound <= best * (1 + 1e-12)
    # and the proof is not thrown away: the plan (over every schedule, so it can beat the
    # default schedules searched above) is within the rounding's few time units of it
    f_unit = (g.ideal_step_time_s + sum(2 * g.tensors[t].bytes / 100.0 for t in g.saved)) / 1e8
    slack = p.info.predicted_step_time_s - milp_bound
    assert slack <= f_unit * (2 * g.n_ops + 2 * len(g.saved) + 3 * g.n_ops**2 + 2) + 1e-15


def three_op_model():
    """The fine-time model over every position of ops A, B (1 s forward, 2 s backward) and C
    (0 s), each saving its output (100 bytes), at the keep-all peak on the link."""
    from slackswap.planners.exact.formulate import formulate

    g = graph(
        [
            op("A", 1.0, 2.0, ["x"], ["a"]),
            op("B", 1.0, 2.0, ["a"], ["b"]),
            op("C", 0.0, 0.0, ["b"], ["c"]),
        ],
        [tensor("a", 100, ["B"]), tensor("b", 100, ["C"]), tensor("c", 100, ["C"])],
    )
    return formulate(g, LINK, ss.keep_all_peak(g, LINK), full=True, exact_arithmetic=True)


def test_rounding_taken_off_the_bound_counts_reruns_a_plan_can_afford():
    """Two ops of 1 s forward, one of 0 s, at span 12 s (6 s of compute, 6 copies of 1 s): the
    time unit is 1.2e-7 s, so 1 s is 8,333,333.33 units, rounded up by 0.67 of a unit, and 2 s
    by 0.33. Positions and copies add their round-ups once each. Reruns: a plan 0.5 s over the
    ideal reruns at most half a second of 1 s ops (fractionally: 0.33 of a unit); 2.5 s over, 2.5
    of them (1.67 units); with no plan known, every rerun the model has."""
    f = three_op_model()
    unit = f.scaling.time_unit
    assert unit == pytest.approx(12.0 / 1e8)
    one, two = 8_333_334 - 1.0 / unit, 16_666_667 - 2.0 / unit
    assert one == pytest.approx(2 / 3, abs=1e-6) and two == pytest.approx(1 / 3, abs=1e-6)
    fixed = 2 * one + 2 * two + 6 * one  # forward A, B; backward A, B; 3 tensors x 2 copies
    one_second_reruns = sum(1 for q, _ in f.rerun if q in (0, 1))
    assert one_second_reruns >= 3
    ideal = f.graph.ideal_step_time_s
    assert f.rounding_units(ideal + 0.5) == pytest.approx(fixed + 1.0 + 0.5 * one, abs=1e-6)
    assert f.rounding_units(ideal + 2.5) == pytest.approx(fixed + 1.0 + 2.5 * one, abs=1e-6)
    assert f.rounding_units(None) == pytest.approx(fixed + 1.0 + one_second_reruns * one, abs=1e-6)


@pytest.mark.slow
def test_the_proof_round_bounds_every_rebuild_position_on_a_cnn_plan_with_swaps():
    """VGG16 at 90% with swaps: the plan of the candidate windows (recompute conv1_1's output,
    swap six small tensors: 0.592% of overhead) is the optimum, but the LP bounds stop at 0.32%.
    The model over every position (102 x 39 cells), hinted with it, offers every recomputed
    tensor every backward position before its first use (formulations/milp.md, "Candidates"):
    its bound is then a bound, at most the plan's step; it no longer proves the plan in 60 s of
    work (the departure bound does: test_departures.py, and the default solve below)."""
    hw = ss.hardware("a100-80gb-pcie4")
    g = ss.cnn_graph("vgg16", hw, batch=16)
    p = ss.solve(g, 0.9, hw, solver="cpsat", work_s=60, time_limit_s=CAP, departure=False)
    proof = p.info.extra["proof_round"]
    assert proof["bound_s"] is not None
    assert proof["bound_s"] <= p.info.predicted_step_time_s * (1 + 1e-9)
    windows = ss.solve(
        g, 0.9, hw, solver="cpsat", work_s=60, time_limit_s=CAP, full=False, departure=False
    )
    assert "proof_round" not in windows.info.extra and windows.info.status != "optimal"
    assert windows.info.predicted_step_time_s == pytest.approx(p.info.predicted_step_time_s)
    proven = ss.solve(g, 0.9, hw, solver="cpsat", work_s=60, time_limit_s=CAP)
    assert proven.info.status == "optimal"
    assert proven.info.predicted_step_time_s == pytest.approx(p.info.predicted_step_time_s)


def test_timeout_returns_a_plan_no_worse_than_heuristic():
    g = ss.workload("bert-large", "a100-80gb-pcie4")
    hw = "a100-80gb-pcie4"
    p = ss.solve(g, 0.4, hw, solver="cpsat", time_limit_s=1.0)
    h = ss.solve(g, 0.4, hw, solver="heuristic")
    assert p.info.status in ("timeout", "feasible", "optimal")
    assert ss.validate(g, p, hw).ok
    assert ss.simulate(g, p, hw).retention >= ss.simulate(g, h, hw).retention - 1e-12
    # a bound, unless the clock (1 s, on a loaded machine) stopped the LP bound, which says so
    stopped = p.info.extra.get("clock_stopped") or ()
    assert (p.info.gap is not None and p.info.bound is not None) or "lp_bound" in stopped, stopped


def test_infeasible_budget_names_the_minimum():
    g = graph(
        [op("A", 1, 1, ["x"], ["a"]), op("B", 1, 1, ["a"], ["b"])],
        [tensor("a", 100, ["B"]), tensor("b", 10, ["B"])],
    )
    with pytest.raises(ss.InfeasibleBudget) as info:
        ss.solve(g, 109, LINK, solver="cpsat")
    assert info.value.min_budget_bytes == 110


def test_compare_rows():
    g = graph(
        [op("A", 1, 1, ["x"], ["a"]), op("B", 3, 3, ["x"], ["b"]), op("C", 1, 1, ["x"], ["c"])],
        [tensor("a", 100, ["A"]), tensor("b", 10, ["B"]), tensor("c", 100, ["C"])],
    )
    rows = ss.compare(
        g, 110, LINK, solvers=("heuristic", "cpsat", "cbc", "highs", "scip", "keep-all")
    )
    by = {r["solver"]: r for r in rows}
    assert set(by) == {"heuristic", "cpsat", "cbc", "highs", "scip", "keep-all"}
    for name in ("cpsat", "cbc", "highs", "scip"):
        assert by[name]["status"] == "optimal" and by[name]["retention"] == pytest.approx(1.0)
        assert by[name]["peak_bytes"] <= 110
    assert by["keep-all"]["fits"] is False
    for key in ("retention", "step_time_s", "peak_bytes", "stall_s", "wall_s", "status", "gap"):
        assert key in by["cpsat"]


def test_unknown_solver_is_refused():
    g = graph([op("A", 1, 1, ["x"], ["a"])], [tensor("a", 1, ["A"])])
    with pytest.raises(ValueError, match="unknown solver 'gurobi'"):
        ss.solve(g, 1.0, LINK, solver="gurobi")


@pytest.mark.slow
def test_sizes_without_a_common_unit_still_prove_and_bound_every_plan():
    """Sizes that share no unit and span more than BYTE_RANGE units (gcd 1, 3,000,017 bytes the
    largest) are rounded in the model. Over every schedule position (7 ops) they are rounded
    down and the budget up, so the model is a relaxation: its bound is a proof (status
    "optimal"), and exhaustive search over every decision finds nothing below it."""
    from slackswap.planners.exact.formulate import formulate
    from slackswap.planners.scaling import BYTE_RANGE

    fast = LINK.with_link(d2h_bytes_per_s=1e6, h2d_bytes_per_s=1e6)  # 3 s for the largest
    ops = [
        op("A", 1.0, 2.0, ["x"], ["a"]),
        op("B", 0.2, 0.4, ["a"], ["b"]),
        op("C", 2.0, 4.0, ["b"], ["c"]),
        op("D", 0.1, 0.2, ["c", "a"], ["d"]),
        op("E", 1.5, 3.0, ["d"], ["e"]),
        op("F", 0.1, 0.3, ["e"], ["f"]),
        op("G", 1.0, 2.0, ["f"], ["g"]),
    ]
    sizes = {
        "a": 3_000_017,
        "b": 1_000_003,
        "c": 2_999_999,
        "d": 999_983,
        "e": 3_000_001,
        "f": 1_000_001,
        "g": 500_009,
    }
    users = {
        "a": ["B", "D"],
        "b": ["C"],
        "c": ["D"],
        "d": ["E"],
        "e": ["F"],
        "f": ["G"],
        "g": ["G"],
    }
    g = graph(ops, [tensor(t, sizes[t], users[t]) for t in sizes])
    lo, hi = ss.min_budget(g, fast), ss.keep_all_peak(g, fast)
    budget = lo + (hi - lo) // 3
    f = formulate(g, fast, budget)
    assert f.full and not f.scaling.exact_bytes and f.scaling.relaxed_bytes
    assert max(sizes.values()) // f.scaling.byte_unit <= BYTE_RANGE
    p = ss.solve(g, budget, fast, solver="cpsat", gap=0.0)
    assert p.info.status == "optimal"
    names = [g.tensors[t].name for t in g.saved]
    best = None
    for combo in itertools.product(*[["keep", "swap", "recompute"]] * len(names)):
        sim = ss.simulate(g, plan(g, dict(zip(names, combo)), budget, hw=fast), fast)
        if sim.fits:
            best = sim.step_time_s if best is None else min(best, sim.step_time_s)
    assert p.info.bound <= best * (1 + 1e-12)
    assert p.info.predicted_step_time_s <= best * (1 + 1e-9)


def test_the_exact_plan_is_never_slower_than_its_start_on_tiny_op_times():
    """Ops of 3.45e-202 s (a case hypothesis found): the MILP's plan was taken over the warm
    start although 33% slower, being within an absolute 1e-12 s of it."""
    t = 3.4531147189067924e-202
    g = graph(
        [op("op0", t, 0.0, [], ["t0_0", "t0_1"]), op("op1", t, 0.0, [], ["t1_0"])],
        [tensor("t0_0", 1, ["op0"]), tensor("t0_1", 0, []), tensor("t1_0", 1, ["op1"])],
    )
    for budget in range(ss.min_budget(g, LINK), ss.keep_all_peak(g, LINK) + 1):
        best = ss.simulate(g, ss.solve(g, budget, LINK, solver="cpsat", gap=0.0), LINK)
        heuristic = ss.simulate(g, ss.solve(g, budget, LINK, solver="heuristic"), LINK)
        assert best.step_time_s <= heuristic.step_time_s * (1 + 1e-9)


def test_highs_at_a_work_limit_returns_its_incumbent_and_bound(caplog):
    """HiGHS through highspy: a node limit ends the search with the incumbent and HiGHS's dual
    bound (PuLP's interface raised KeyError: HighsModelStatus.kSolutionLimit and lost both)."""
    import logging

    if not ss.is_available("highs"):
        pytest.skip("highspy is not installed")
    g = ss.cnn_graph("resnet50")
    with caplog.at_level(logging.WARNING, logger="slackswap"):
        plan = ss.solve(g, 0.6, "a100-80gb-pcie4", solver="highs", work_s=0.05, time_limit_s=60)
    assert plan.info.status in ("feasible", "optimal")
    assert plan.info.bound is not None and plan.info.bound <= plan.info.objective + 1e-12
    assert ss.validate(g, plan).ok
    assert "KeyError" not in caplog.text and "Traceback" not in caplog.text


def test_each_start_is_bounded_by_the_base_durations_before_and_after_it():
    """start_bounds (milp.md): forward A, B (1 s each), C (0 s), then backward C, B, A (0, 2,
    2 s). At span 12 s the time unit is 1.2e-7 s: 1 s is 8,333,334 units (rounded up), 2 s
    16,666,667. The earliest start of position k is the durations before it; the latest leaves
    the durations from k to the last position's start before T_ub."""
    f = three_op_model()
    one, two = 8_333_334, 16_666_667
    durations = [one, one, 0, 0, two, two]  # positions 0..5; the last one's is not needed
    bounds = {v.name: (v.lb, v.ub) for v in f.model.vars if v.name.startswith("start[")}
    top = bounds["start[5]"][1]
    assert bounds["start[0]"] == (0, top - (one + one + 0 + 0 + two))
    assert bounds["start[1]"] == (one, top - (one + 0 + 0 + two))
    assert bounds["start[2]"] == (2 * one, top - two)
    assert bounds["start[3]"] == (2 * one, top - two)
    assert bounds["start[4]"] == (2 * one, top - two)
    assert bounds["start[5]"] == (2 * one + two, top)
    assert bounds["start[5]"][0] == sum(durations[:5])  # the five positions before it


def test_where_nothing_may_swap_the_cuts_state_memory_alone():
    """allowed=('keep', 'recompute'): the lane-capacity cuts keep their memory row
    (cut_memory over cut_kept_or_rebuilt) and drop every lane's running sum; with swaps allowed
    both are there."""
    from slackswap.core.restrict import decision_mask
    from slackswap.planners.exact.formulate import formulate

    g = graph(
        [op("A", 1.0, 2.0, ["x"], ["a"]), op("B", 1.0, 2.0, ["a"], ["b"])],
        [tensor("a", 100, ["B"]), tensor("b", 100, ["B"])],
    )
    budget = ss.keep_all_peak(g, LINK)
    for allowed, lanes in ((("keep", "recompute"), False), (None, True)):
        mask = None if allowed is None else decision_mask(g, allowed, None, 0)
        f = formulate(g, LINK, budget, full=True, mask=mask)
        names = {v.name.split("[")[0] for v in f.model.vars}
        rows = {c.name.split("[")[0] for c in f.model.constraints}
        assert "cut_kept_or_rebuilt" in names and "cut_memory" in rows
        assert ("cut_departed" in names) is lanes and ("cut_offloaded_produced" in names) is lanes


def test_where_nothing_may_swap_each_position_starts_as_the_one_before_ends():
    """Where nothing may swap nothing waits for a lane (milp.md, "Where nothing may swap"):
    compute_order is an equality, no tensor has a lane job, and each start is at most the base
    durations and the rerun candidates before it. Forward A, B (1 s each); backward B, A (2 s
    each); a and b (read by backward B) may be rebuilt before it, rerunning A and B (1 s each).
    The time unit is 1e-7 s: 1 s is 10,000,000 units. The smallest budget's model
    (earliest=False) keeps the general form."""
    from slackswap.core.restrict import decision_mask
    from slackswap.planners.exact.formulate import formulate

    g = graph(
        [op("A", 1.0, 2.0, ["x"], ["a"]), op("B", 1.0, 2.0, ["a"], ["b"])],
        [tensor("a", 100, ["B"]), tensor("b", 100, ["B"])],
    )
    budget = ss.keep_all_peak(g, LINK)
    mask = decision_mask(g, ("keep", "recompute"), None, 0)
    f = formulate(g, LINK, budget, full=True, exact_arithmetic=True, mask=mask)
    one, two = 10_000_000, 20_000_000
    assert f.scaling.time_unit == pytest.approx(1e-7)
    reruns = {(g.ops[q].name, r) for q, r in f.rerun}
    assert reruns == {("A", 2), ("B", 2)}  # before backward B, at position 2
    bounds = {v.name: (v.lb, v.ub) for v in f.model.vars if v.name.startswith("start[")}
    assert bounds["start[0]"] == (0, 0)
    assert bounds["start[1]"] == (one, one)
    assert bounds["start[2]"] == (2 * one, 2 * one)
    # backward A: after forward A, B and backward B (2 s), and at most both reruns before it
    assert bounds["start[3]"] == (2 * one + two, 2 * one + two + 2 * one)
    order = [c for c in f.model.constraints if c.name.startswith("compute_order")]
    assert len(order) == 3 and all(c.lo == c.hi for c in order)
    assert not f.d2h_done and not f.h2d_done and not f.issue_order
    general = formulate(
        g, LINK, budget, full=True, exact_arithmetic=True, mask=mask, earliest=False
    )
    order = [c for c in general.model.constraints if c.name.startswith("compute_order")]
    assert all(c.hi is None for c in order) and len(general.d2h_done) == 2


def test_cpsats_byte_unit_keeps_a_plan_at_the_budgets_edge():
    """Sizes sharing no unit (milp.md, "Scaling and rounding"): a 1,000,003 and a 1,000,001 byte
    tensor, both kept, at the keep-all peak of 2,000,004 bytes. For the floating-point backends
    the byte unit is ceil(2,000,004 / 1e6) = 3: the sizes round up to 333,335 + 333,334 =
    666,669 units against a budget of floor(2,000,004 / 3) = 666,668, and keep-all, which fits,
    is out of the model. CP-SAT's range (1e9) keeps the unit at 1 byte: exact, and keep-all in."""
    import numpy as np

    from slackswap.planners.exact.formulate import formulate
    from slackswap.planners.exact.hint import complete_hint

    g = graph(
        [op("A", 1.0, 2.0, ["x"], ["a"]), op("B", 1.0, 2.0, ["a"], ["b"])],
        [tensor("a", 1_000_003, ["B"]), tensor("b", 1_000_001, ["B"])],
    )
    budget = ss.keep_all_peak(g, LINK)
    assert budget == 2_000_004
    keep_all = np.zeros(len(g.tensors), dtype=np.int64)
    exact = formulate(g, LINK, budget, full=False, exact_arithmetic=True)
    assert exact.scaling.byte_unit == 1 and exact.scaling.exact_bytes
    assert exact.model.first_violation(complete_hint(exact, keep_all, {}, {}, {})) is None
    rounded = formulate(g, LINK, budget, full=False, exact_arithmetic=False)
    assert rounded.scaling.byte_unit == 3 and not rounded.scaling.exact_bytes
    assert list(rounded.scaling.bytes_of([1_000_003, 1_000_001])) == [333_335, 333_334]
    assert rounded.scaling.budget_of(budget) == 666_668
    violation = rounded.model.first_violation(complete_hint(rounded, keep_all, {}, {}, {}))
    assert violation is not None and violation.startswith("memory_budget")


@pytest.mark.slow
def test_where_the_lp_decides_the_plan_the_model_is_searched_whole():
    """HF BERT of 12 layers profiled on CPU (keep and recompute), at 30%: 4,563 binaries, over
    WHOLE_MODEL_BINARIES, but the LP decides 237 of its 241 tensors as the warm start does, so
    LP-guided rounds would search four tensors (milp.md, "Solving"). Searched whole, the same
    work proves a better plan than the rounds keep. Work, not the clock, ends both."""
    from pathlib import Path

    g = ss.load_graph(Path(__file__).parent / "data" / "bert12_cpu_profile.json")
    whole = ss.solve(g, 0.3, work_s=10, time_limit_s=600)
    assert whole.info.extra["strategy"] == "whole"
    assert whole.info.status == "optimal" and whole.info.overhead_gap <= 0.01
    rounds = ss.solve(g, 0.3, work_s=10, time_limit_s=600, strategy="lp-guided")
    assert rounds.info.extra["strategy"] == "lp-guided"
    assert whole.info.predicted_step_time_s < rounds.info.predicted_step_time_s
    for p in (whole, rounds):
        assert ss.validate(g, p).ok and ss.simulate(g, p).fits


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(graph_budget(max_ops=5, max_saved=5))
def test_keep_and_recompute_alone_the_models_bound_is_below_every_plan(case):
    """The model with no lane rows in its cuts (nothing may swap) still cuts off no plan: its
    bound over every position, less its rounding, is below every keep/recompute plan that fits."""
    g, budget = case
    allowed = ("keep", "recompute")
    try:
        p = ss.solve(
            g,
            budget,
            LINK,
            solver="cpsat",
            gap=0.0,
            warm_start=False,
            full=True,
            strategy="whole",
            allowed=allowed,
        )
    except ss.InfeasibleBudget:
        p = None
    names = [g.tensors[t].name for t in g.saved]
    choices = [["keep"] + (["recompute"] if g.can_recompute[t] else []) for t in g.saved]
    best = None
    for combo in itertools.product(*choices):
        sim = ss.simulate(g, plan(g, dict(zip(names, combo)), budget), LINK)
        if sim.fits:
            best = sim.step_time_s if best is None else min(best, sim.step_time_s)
    if best is None:
        return
    assert p is not None, "a keep/recompute plan fits where the solver found none"
    assert ss.validate(g, p).ok and ss.simulate(g, p, LINK).fits
    assert p.info.extra["milp_bound_s"] <= best * (1 + 1e-12)
