"""Hardware.min_swap_bytes: tensors under it are never swapped, by any planner or baseline; the
checker refuses a plan that swaps one; the smallest budget accounts for it."""

import pytest
from helpers import CAP, LINK, graph, op, plan, seeded_graph, tensor

import slackswap as ss

SMALL_LINK = LINK.with_link(name="test-min-swap", min_swap_bytes=100)


def two_sizes():
    # x (50 B, under the 100 B minimum) is saved for op1's backward, y (400 B) for op2's; op3
    # makes w (300 B) from z (10 B). Keep-all peak, at op3's forward: x + y + z + w = 760 B. At
    # 720 B something must leave: x alone would do (710 B) but may not be swapped, and op0 (its
    # producer) is not recomputable, so y goes (swapped or recomputed).
    return graph(
        [
            op("op0", 1.0, 1.0, [], ["x"], recomputable=False),
            op("op1", 4.0, 1.0, ["x"], ["y"]),
            op("op2", 9.0, 9.0, ["y"], ["z"]),
            op("op3", 9.0, 9.0, ["z"], ["w"]),
        ],
        [tensor("x", 50, ["op1"]), tensor("y", 400, ["op2"]), tensor("z", 10), tensor("w", 300)],
    )


def test_presets_name_their_source():
    hw = ss.hardware("a100-80gb-pcie4")
    assert hw.min_swap_bytes == 1024 and "min_offload_size" in hw.sources["min_swap_bytes"]
    assert ss.hardware("cpu-emulated-link").min_swap_bytes == 0
    with pytest.raises(ValueError, match="min_swap_bytes"):
        LINK.with_link(min_swap_bytes=-1)
    with pytest.raises(ValueError, match="min_swap_bytes"):
        LINK.with_link(min_swap_bytes=1.5)
    assert ss.Hardware.from_dict(SMALL_LINK.to_dict()) == SMALL_LINK


@pytest.mark.parametrize("solver", ["heuristic", "cpsat", "cbc", "highs", "scip"])
def test_no_planner_swaps_under_the_minimum(solver):
    g = two_sizes()
    assert ss.keep_all_peak(g, SMALL_LINK) == 760
    p = ss.solve(g, 720, SMALL_LINK, solver=solver, work_s=5, time_limit_s=CAP)
    assert p.decisions["x"] == "keep" and p.decisions["y"] in ("swap", "recompute")
    assert ss.validate(g, p).ok
    # on a link without the minimum, x (50 B, hidden behind op1-op3) is the one to swap
    free = ss.solve(g, 720, LINK, solver=solver, work_s=5, time_limit_s=CAP)
    assert free.decisions == {"x": "swap", "y": "keep"} and ss.validate(g, free).ok


def test_the_checker_refuses_a_swap_under_the_minimum():
    g = two_sizes()
    p = plan(g, {"x": "swap", "y": "keep"}, 760, hw=SMALL_LINK)
    check = ss.validate(g, p)
    assert not check.ok
    assert any(
        "'x' (50 bytes) is 'swap'" in str(v) and "min_swap_bytes" in str(v)
        for v in check.violations
    )
    assert ss.validate(g, plan(g, {"x": "keep", "y": "swap"}, 760, hw=SMALL_LINK)).ok


def test_a_pin_to_swap_under_the_minimum_is_refused_by_name():
    g = two_sizes()
    with pytest.raises(ss.PlanError, match=r"'x' \(50 bytes\) is pinned to swap.*100 bytes"):
        ss.solve(g, 720, SMALL_LINK, solver="heuristic", pins={"x": "swap"})


def test_the_smallest_budget_keeps_what_cannot_leave():
    g = two_sizes()
    # x may not leave (under the minimum, its producer not recomputable): a plan exists at the
    # smallest budget reported, and it keeps x
    small = ss.smallest_budget(g, SMALL_LINK)
    p = ss.solve(g, small.budget_bytes, SMALL_LINK, solver="cpsat", work_s=5, time_limit_s=CAP)
    assert p.decisions["x"] == "keep" and ss.validate(g, p).ok
    assert small.budget_bytes >= ss.min_budget(g, LINK)


def test_swap_all_keeps_what_the_hardware_does_not_swap():
    g = two_sizes()
    p = ss.solve(g, 1.0, SMALL_LINK, solver="swap-all", strict=False)
    assert p.decisions == {"x": "keep", "y": "swap"}


@pytest.mark.slow
def test_seeded_graphs_never_swap_small_tensors():
    hw = LINK.with_link(name="test-min-swap-250", min_swap_bytes=250)
    for seed in range(5):
        g = seeded_graph(seed)
        budget = max(ss.min_budget(g, hw), int(0.7 * ss.keep_all_peak(g, hw)))
        for solver in ("heuristic", "cpsat"):
            p = ss.solve(g, budget, hw, solver=solver, work_s=5, time_limit_s=CAP)
            sizes = {t.name: t.bytes for t in g.tensors}
            assert all(sizes[n] >= 250 for n, d in p.decisions.items() if d == "swap")
            assert ss.validate(g, p).ok
