"""Odd input, in classes: every solver plans degenerate graphs, statuses are always documented,
a bound is a bound, byte sums never wrap, bad figures are refused by name, limits hold."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from helpers import CAP, LINK, graph, op, random_graphs, tensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slackswap as ss
from slackswap.core.graph import MAX_TOTAL_BYTES
from slackswap.core.plan import STATUSES

EXACT = [s for s in ("cpsat", "cbc", "highs", "scip") if ss.is_available(s)]


def chain(nbytes, fwd=1.0, bwd=2.0, ws=0):
    ops = [
        op(f"o{i}", fwd, bwd, [f"t{i - 1}"] if i else ["x"], [f"t{i}"], forward_workspace_bytes=ws)
        for i in range(len(nbytes))
    ]
    tensors = [
        tensor(f"t{i}", b, [f"o{min(i + 1, len(nbytes) - 1)}"]) for i, b in enumerate(nbytes)
    ]
    return graph(ops, tensors)


@pytest.mark.parametrize(
    "case", ["zero bytes", "zero times", "tiny times, huge bytes", "bytes from 1 to 1e12"]
)
@pytest.mark.parametrize(
    "solver", ["heuristic"] + [pytest.param(s, marks=pytest.mark.slow) for s in EXACT]
)
def test_degenerate_graphs_plan_with_every_solver(case, solver):
    g = {
        "zero bytes": lambda: chain([0] * 6),
        "zero times": lambda: chain([100] * 6, 0.0, 0.0),
        "tiny times, huge bytes": lambda: chain(
            [10**12, 10**9, 10**12, 10**9, 10**12, 10**9], 1e-9, 1e-9
        ),
        "bytes from 1 to 1e12": lambda: chain(
            [10**12, 1000, 10**12, 1000, 10**12, 1000], ws=4 * 10**11
        ),
    }[case]()
    budget = max(ss.min_budget(g, LINK), int(0.5 * ss.keep_all_peak(g, LINK)))
    plan = ss.solve(g, budget, LINK, solver=solver, work_s=2, time_limit_s=CAP)
    assert ss.validate(g, plan).ok and plan.info.status in STATUSES
    bound = ss.lp_bound(g, budget, LINK)
    assert bound.status in ("optimal", "unsolved", "timeout")
    assert ss.simulate(g, plan).step_time_s >= bound.step_time_s * (1 - 1e-7) - 1e-15


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(random_graphs(max_ops=6), st.floats(0.3, 1.0), st.sampled_from(EXACT or ["heuristic"]))
def test_statuses_are_documented_and_the_bound_holds(g, fraction, solver):
    budget = max(ss.min_budget(g, LINK), int(fraction * ss.keep_all_peak(g, LINK)))
    plan = ss.solve(g, budget, LINK, solver=solver, work_s=2, time_limit_s=CAP)
    assert plan.info.status in STATUSES
    step = ss.validate(g, plan).step_time_s
    if plan.info.bound is not None:
        assert step >= plan.info.bound * (1 - 1e-7) - 1e-15
    bound = ss.lp_bound(g, budget, LINK)
    assert bound.status != "infeasible"  # a feasible budget never gets the "infeasible" bound 0
    assert step >= bound.step_time_s * (1 - 1e-7) - 1e-15


def test_byte_sums_never_wrap_refused_at_the_boundary_by_tensor_name():
    def two(a, b):
        return {
            "format": "slackswap.graph/1",
            "name": "big",
            "ops": [{"name": "A", "forward_s": 1, "backward_s": 1, "outputs": ["a", "b"]}],
            "tensors": [
                {"name": "a", "bytes": a, "saved_for": ["A"]},
                {"name": "b", "bytes": b, "saved_for": ["A"]},
            ],
        }

    half = MAX_TOTAL_BYTES // 2
    g = ss.load_graph(two(half, half))  # exactly at the limit: exact sums
    assert ss.keep_all_peak(g, LINK) == MAX_TOTAL_BYTES == 2 * half
    with pytest.raises(ss.GraphError, match="tensor 'b'"):
        ss.load_graph(two(half, half + 1))
    for huge in (2**62, 2**64, 10**30):
        with pytest.raises(ss.GraphError, match="tensor 'a'"):
            ss.load_graph(two(huge, 1))


@pytest.mark.parametrize(
    "field, value",
    [
        ("latency_s", math.nan),
        ("latency_s", -1.0),
        ("d2h_bytes_per_s", math.inf),
        ("h2d_bytes_per_s", 0.0),
        ("peak_flops", math.nan),
        ("duplex", "yes"),
    ],
)
def test_hardware_figures_must_be_finite_and_sane(field, value):
    with pytest.raises(ValueError, match=field):
        LINK.with_link(**{field: value})


def test_budgets_one_rule_and_every_numpy_real():
    g = chain([100] * 4)
    peak = ss.keep_all_peak(g, LINK)
    for half in (0.5, np.float32(0.5), np.float64(0.5), "0.5", "50%"):
        assert ss.parse_budget(half, g, LINK) == int(0.5 * peak)
    for nbytes in (150, np.int32(150), np.uint64(150), "150", "150b"):
        assert ss.parse_budget(nbytes, g, LINK) == 150
    assert ss.parse_budget("1", g, LINK) == 1  # digits without a point are bytes, API and CLI alike
    for bad in (math.nan, -0.5, 1.5, "abc", "nan%", True, None, -3):
        with pytest.raises(ValueError):
            ss.parse_budget(bad, g, LINK)


@pytest.mark.parametrize("limit", [math.nan, -1.0, math.inf, "10"])
def test_time_limits_must_be_finite_seconds(limit):
    g = chain([100] * 4)
    with pytest.raises(ValueError, match="time_limit_s"):
        ss.solve(g, 0.8, LINK, solver="heuristic", time_limit_s=limit)


@pytest.mark.slow
@pytest.mark.parametrize("solver", EXACT)
@pytest.mark.parametrize("limit", [0.05, 1.0])
def test_the_time_limit_holds(solver, limit):
    """solve() returns within max(0.5 s, 10%) of its limit (solver libraries already loaded),
    with the best plan found so far. After the cap the plan is still closed (its minimal pass,
    the checker; for HiGHS and CBC, a child process ended and read): that work is allowed for as
    four heuristic solves of the same graph take on this machine now (0.5 s idle), so a loaded
    machine does not fail a cap that holds (HiGHS at 1 s took 2.45 s beside two busy processes
    and the suite's other worker) while a cap ignored still fails by seconds to minutes."""
    g = ss.workload("bert-large", "a100-80gb-pcie4")
    ss.solve(g, 0.3, "a100-80gb-pcie4", solver=solver, time_limit_s=0.01)  # imports, caches
    start = time.perf_counter()
    ss.solve(g, 0.3, "a100-80gb-pcie4", solver="heuristic")
    closing = 4 * (time.perf_counter() - start)
    start = time.perf_counter()
    plan = ss.solve(g, 0.3, "a100-80gb-pcie4", solver=solver, time_limit_s=limit)
    assert time.perf_counter() - start <= limit + max(0.5, 0.1 * limit) + closing
    assert plan.info.status in STATUSES and ss.validate(g, plan).ok


def _bert_dict():
    return ss.workload("bert-large", "a100-80gb-pcie4").to_dict()


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda d: d["ops"][0].update(recomputable="no"), "recomputable must be true or false"),
        (lambda d: d["ops"][0].update(recomputable=0.0), "recomputable must be true or false"),
        (lambda d: [o.update(forward_s=1e308) for o in d["ops"]], "time passes"),
        (lambda d: d["tensors"][0].update(bytes=float("inf")), "non-negative integer"),
        (lambda d: d["tensors"][0].update(bytes=2**70), "bytes"),
    ],
)
def test_corrupt_graph_fields_get_named_errors(corrupt, message):
    d = _bert_dict()
    corrupt(d)
    with pytest.raises(ss.GraphError, match=message):
        ss.load_graph(d)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[" * 100000, "nested too deeply"),
        ("hello " * 1000, "not JSON"),
        ("{not json", "not valid JSON"),
        ("/no/such/graph.json", "does not exist"),
    ],
)
def test_bad_graph_and_plan_text_gets_named_errors(text, message):
    with pytest.raises(ss.GraphError, match=message):
        ss.load_graph(text)
    with pytest.raises(ss.PlanError, match=message):
        ss.load_plan(text)


def test_unknown_options_are_refused_by_name():
    g = chain([100] * 4)
    with pytest.raises(ValueError, match="takes no option.*alowed"):
        ss.solve(g, 0.8, LINK, solver="heuristic", alowed=("keep", "recompute"))  # a typo
    if EXACT:
        with pytest.raises(ValueError, match="takes no option.*gapp"):
            ss.solve(g, 0.8, LINK, solver=EXACT[0], gapp=0.0)


@pytest.mark.parametrize(
    "solver,option,value,message",
    [
        ("cpsat", "departure", "False", "departure must be True or False"),  # truthy: would be on
        ("cpsat", "coarse", 0, "coarse must be True or False"),
        ("cpsat", "full", "yes", "full must be True or False"),
        ("heuristic", "polish", "no", "polish must be True or False"),
        ("cpsat", "workers", 0, r"workers must be an integer >= 1"),
        ("cpsat", "seed", "1", r"seed must be an integer >= 0"),
        ("cpsat", "seed", True, r"seed must be an integer >= 0"),
        ("cpsat", "gap", float("nan"), r"gap must be a finite number >= 0"),
        ("cpsat", "gap", -0.1, r"gap must be a finite number >= 0"),
        ("cpsat", "strategy", 1, "strategy must be one of auto, whole, lp-guided"),
        ("cpsat", "strategy", "wholee", "strategy must be one of"),  # ran lp-guided silently
    ],
)
def test_options_of_the_wrong_type_are_refused_by_name(solver, option, value, message):
    g = chain([100] * 4)
    with pytest.raises((TypeError, ValueError), match=message):
        ss.solve(g, 0.8, LINK, solver=solver, **{option: value})
    with pytest.raises(TypeError, match="strict must be True or False"):
        ss.solve(g, 0.8, LINK, solver="heuristic", strict="no")


def test_the_time_limit_counts_from_solves_entry(monkeypatch):
    """solve()'s first call in a process loads the planner (about 0.5 s of OR-Tools' import, a
    1 s limit ran 1.15 s): the planner's deadline counts from solve()'s entry, its work limits
    from the time limit alone."""
    from slackswap.planners.base import Problem, get_planner
    from slackswap.planners.heuristic import SlackSwapHeuristic

    seen = {}
    original = SlackSwapHeuristic.solve

    def spy(self, problem, **options):
        seen["began"], seen["called"] = problem.began, time.perf_counter()
        return original(self, problem, **options)

    monkeypatch.setattr(SlackSwapHeuristic, "solve", spy)
    g = chain([100] * 6)
    before = time.perf_counter()
    ss.solve(g, 0.6, LINK, solver="heuristic")
    assert before <= seen["began"] <= seen["called"]
    if "cpsat" in EXACT:
        # a caller whose clock started 10 s ago with a 5 s limit: nothing clock-capped starts
        budget = int(0.6 * ss.keep_all_peak(g, LINK))
        late = get_planner("cpsat").solve(
            Problem(g, LINK, budget, began=time.perf_counter() - 10), time_limit_s=5.0
        )
        on_time = get_planner("cpsat").solve(Problem(g, LINK, budget), time_limit_s=5.0)
        assert "lp_bound" in late.info.extra["clock_stopped"]
        assert "lp_bound" not in on_time.info.extra.get("clock_stopped", [])
