"""The smallest budget says what the allowed decisions reach: a plan exists at it, and where it
is proven none exists one byte below (keep and recompute only, a CPU device, pins)."""

from __future__ import annotations

import pytest
import torch
from helpers import CAP, LINK, random_graphs, seeded_graph
from hypothesis import HealthCheck, given, settings

import slackswap as ss
from slackswap.core.budget import offload_floor

CPU = ss.hardware("cpu")


@pytest.mark.parametrize("seed", [2, 6, 7])
@pytest.mark.slow
def test_the_cpu_minimum_is_above_the_offload_floor_and_a_plan_exists_at_it(seed):
    """On these graphs every tensor offloaded needs 33-38% of keep-all, which no keep/recompute
    plan reaches (the minimum is 42-63%): the old floor named a budget no plan fits."""
    g = seeded_graph(seed, n_ops=12)
    floor = offload_floor(g, CPU)
    smallest = ss.smallest_budget(g, CPU)
    assert smallest.proven and smallest.budget_bytes > floor
    assert ss.min_budget(g, CPU) == smallest.budget_bytes
    plan = ss.solve(g, smallest.budget_bytes, CPU)
    assert ss.validate(g, plan).ok
    for budget in (floor, smallest.budget_bytes - 1):
        with pytest.raises(ss.InfeasibleBudget) as info:
            ss.solve(g, budget, CPU)
        assert info.value.min_budget_bytes == smallest.budget_bytes


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs(max_ops=7))
def test_a_plan_fits_the_reported_minimum_and_none_below_a_proven_one(g):
    for hw, allowed in ((CPU, None), (LINK, ("keep", "recompute")), (LINK, None)):
        smallest = ss.smallest_budget(g, hw, allowed=allowed)
        assert smallest.lower_bytes <= smallest.budget_bytes
        assert offload_floor(g, hw) <= smallest.lower_bytes
        plan = ss.solve(g, smallest.budget_bytes, hw, allowed=allowed, work_s=2, time_limit_s=CAP)
        assert ss.validate(g, plan).ok
        if smallest.proven and smallest.budget_bytes > 0:
            with pytest.raises(ss.InfeasibleBudget) as info:
                ss.solve(
                    g, smallest.budget_bytes - 1, hw, allowed=allowed, work_s=2, time_limit_s=CAP
                )
            assert info.value.min_budget_bytes == smallest.budget_bytes


@pytest.mark.slow
def test_pins_raise_the_minimum_and_it_is_met():
    g = seeded_graph(3, n_ops=10)
    free = ss.min_budget(g, LINK)
    biggest = max(g.saved, key=lambda t: g.tensors[int(t)].bytes)
    pins = {g.tensors[int(biggest)].name: "keep"}
    pinned = ss.smallest_budget(g, LINK, pins=pins)
    assert pinned.method == "offload floor" and pinned.proven  # every other tensor may swap
    assert pinned.budget_bytes >= free
    plan = ss.solve(g, pinned.budget_bytes, LINK, pins=pins)
    assert ss.validate(g, plan).ok and plan.decisions[pins.popitem()[0]] == "keep"


@pytest.mark.slow
def test_a_profiled_model_on_the_cpu_gets_its_true_minimum():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(d=64, layers=2)
    x = torch.randint(0, 50, (4, 32))
    g = ss.profile(model, x, lambda out: out.float().logsumexp(-1).mean())
    smallest = ss.smallest_budget(g)  # the graph records the cpu preset: keep and recompute
    assert smallest.budget_bytes > offload_floor(g, CPU)
    plan = ss.solve(g, smallest.budget_bytes)
    assert ss.validate(g, plan).ok
    if smallest.proven:
        with pytest.raises(ss.InfeasibleBudget) as info:
            ss.solve(g, smallest.lower_bytes - 1)
        assert info.value.min_budget_bytes == smallest.budget_bytes


def test_a_coarse_byte_unit_is_no_proof():
    """Tensors of 1e12 bytes: the min-peak model counts bytes in units of about 1e6, so a plan
    a unit above its bound is not proven minimal (the fuzzer found plans a thousand bytes below
    such 'proven' minimums); where proven, none fits a byte less."""
    for seed in (2, 6, 7):
        small = seeded_graph(seed, n_ops=10)
        data = small.to_dict()
        for t in data["tensors"]:
            t["bytes"] = int(t["bytes"]) * 10**9 + 1000 * (len(t["name"]) % 3)
        g = ss.load_graph(data)
        smallest = ss.smallest_budget(g, CPU)
        assert ss.validate(g, ss.solve(g, smallest.budget_bytes, CPU)).ok
        if smallest.proven:
            assert smallest.budget_bytes == smallest.lower_bytes
            with pytest.raises(ss.InfeasibleBudget):
                ss.solve(g, smallest.budget_bytes - 1, CPU, work_s=2, time_limit_s=CAP)


def _fits_below(g, hw, mask, minimum: int, planner: str, fractions) -> list[tuple[float, int]]:
    """Plans ``planner`` finds at budgets below ``minimum`` whose step-model peak fits them."""
    from slackswap.core.stepmodel import expand
    from slackswap.planners.base import Problem, get_planner

    found = []
    for fraction in fractions:
        budget = int(minimum * fraction)
        options = {"time_limit_s": CAP, "work_s": 2.0} if planner == "cpsat" else {}
        sol = get_planner(planner).solve(Problem(g, hw, budget, mask), **options)
        peak = int(expand(g, sol.codes, sol.schedule, hw, budget_bytes=budget).memory().max())
        if peak <= budget:
            found.append((fraction, peak))
    return found


BELOW = (0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999)
# on the large graphs (a heuristic solve with its local search takes seconds there), the tries
# nearest the minimum, where a plan the search missed would show first
BELOW_LARGE = (0.9, 0.98, 0.995, 0.999)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["vgg16", "segnet", "unet", "resnet50", "bert-large", "gpt2-xl", "llama-7b"]
)
def test_no_planner_beats_the_smallest_budget_on_cnns_and_reference_models(name):
    """Keep and recompute only (where the minimum is a search, not the closed form): the full
    heuristic (its polish and local search) finds no plan at a budget below the reported
    minimum. Before the descent below the bisection's answer, SegNet's minimum was 2.30 GB and
    the heuristic fit 2.07 GB; Llama-7B's 4.66 GB against 3.89 GB (now 2.49 GB)."""
    from slackswap.solve_options import restriction_mask

    hw = ss.hardware("a100-80gb-pcie4")
    g = ss.cnn_graph(name, hw) if name in ss.CNN_SHAPES else ss.workload(name, hw)
    allowed = ("keep", "recompute")
    smallest = ss.smallest_budget(g, hw, allowed=allowed)
    mask = restriction_mask(g, hw, allowed, None)
    assert _fits_below(g, hw, mask, smallest.budget_bytes, "heuristic", BELOW_LARGE) == []
    assert smallest.lower_bytes <= smallest.budget_bytes


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_no_planner_beats_the_smallest_budget_on_seeded_graphs(seed):
    """The heuristic and the exact planner (CP-SAT) at budgets below the reported minimum find
    no plan that fits, keep and recompute only and with every decision."""
    from slackswap.solve_options import restriction_mask

    g = seeded_graph(seed, n_ops=10)
    for allowed in (("keep", "recompute"), None):
        smallest = ss.smallest_budget(g, LINK, allowed=allowed)
        mask = restriction_mask(g, LINK, allowed, None)
        for planner in ("heuristic", "cpsat"):
            assert _fits_below(g, LINK, mask, smallest.budget_bytes, planner, BELOW) == [], (
                planner,
                allowed,
            )


@pytest.mark.slow
def test_the_exact_planner_beats_no_smallest_budget_on_unet():
    """UNet, keep and recompute only: the exact planner at solve()'s own work (the time limit's
    60 s of the reference machine, deterministic) fits no budget below the reported minimum. The
    minimum model's search goes where its hint leads it: from the descent whose local search
    exchanges tensors alone it stopped at 3.15 GB, and solve() then fit 2.94 GB; the second
    start (single moves) leads it to 2.89 GB, below what solve() fits."""
    hw = ss.hardware("a100-80gb-pcie4")
    g = ss.cnn_graph("unet", hw)
    allowed = ("keep", "recompute")
    smallest = ss.min_budget(g, hw, allowed=allowed)
    for fraction in (0.95, 0.98, 0.99):
        try:
            plan = ss.solve(
                g, int(smallest * fraction), hw, solver="cpsat", allowed=allowed, time_limit_s=60
            )
        except ss.InfeasibleBudget:
            continue
        assert ss.simulate(g, plan).peak_bytes >= smallest, fraction


def test_a_search_cut_by_its_deadline_still_names_a_budget_a_plan_fits():
    """A deadline already past leaves the bisection's first plan (the heuristic at keep-all):
    seed 31's minimum is 1814 bytes, the cut search names 3395, a plan fits it, and it says
    that the clock stopped it."""
    from slackswap.core.stepmodel import expand
    from slackswap.planners.minpeak import min_peak
    from slackswap.solve_options import restriction_mask

    g = seeded_graph(31, n_ops=12)
    mask = restriction_mask(g, CPU, ("keep", "recompute"), None)
    full = min_peak(g, CPU, mask)
    cut = min_peak(g, CPU, mask, deadline=0.0)
    assert not full.clock_stopped and full.proven
    assert cut.clock_stopped and not cut.proven
    assert cut.lower_bytes <= full.budget_bytes < cut.budget_bytes
    peak = expand(g, cut.codes, cut.schedule, CPU, budget_bytes=cut.budget_bytes).memory().max()
    assert peak <= cut.budget_bytes


def test_solve_names_the_smallest_budget_within_its_time_limit_and_keeps_no_cut_search():
    """Below the floor solve() refuses at once; with no time left its smallest-budget search
    stops after one heuristic plan, and says so. min_budget() afterwards searches in full (the
    cut answer was not kept): seed 32's proven 2118 bytes, not the cut 3212."""
    g = seeded_graph(32, n_ops=12)
    with pytest.raises(ss.InfeasibleBudget) as info:
        ss.solve(g, 100, CPU, time_limit_s=0)
    assert "stopped at solve()'s time limit" in str(info.value)
    assert info.value.min_budget_bytes > ss.min_budget(g, CPU)
    smallest = ss.smallest_budget(g, CPU)
    assert smallest.proven and not smallest.clock_stopped
    with pytest.raises(ss.InfeasibleBudget) as again:
        ss.solve(g, 100, CPU, time_limit_s=0)
    assert again.value.min_budget_bytes == smallest.budget_bytes  # now known: no search


def test_a_smallest_budget_plan_says_whether_that_budget_is_proven():
    """budget="smallest": the plan's info says whether its budget is the proven minimum, and
    whether solve()'s time limit cut the search (a limit of 0 s: the bisection's first plan,
    3370 bytes on seed 33 against its proven 2028)."""
    g = seeded_graph(33, n_ops=12)
    cut = ss.solve(g, "smallest", CPU, solver="heuristic", time_limit_s=0)
    assert cut.extra["smallest_budget"] == {"proven": False, "clock_stopped": True}
    assert ss.validate(g, cut).ok
    full = ss.solve(g, "smallest", CPU, solver="heuristic", time_limit_s=CAP)
    assert full.extra["smallest_budget"] == {"proven": True, "clock_stopped": False}
    assert full.budget_bytes == ss.min_budget(g, CPU) < cut.budget_bytes
