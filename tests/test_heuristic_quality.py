"""The heuristic never collapses: on random CNN- and transformer-shaped graphs its overhead is
within twice the exact planner's proven optimum plus 1% of the step (the plan ss.planned runs
first on every new shape is the heuristic's). Budgets from 10% of the way from the smallest to
the keep-all peak: at the smallest itself the exact planner's proof of a swap plan takes tens of
seconds on these graphs."""

from __future__ import annotations

import pytest
from helpers import CAP, LINK, graph, op, tensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slackswap as ss


@st.composite
def cnn_graphs(draw):
    """A chain of conv + relu layers: activations shrink with depth while each conv's time stays
    about the same, so early tensors are cheap per byte to rerun and late ones dear; a pooling
    op (nothing saved) every other layer."""
    layers = draw(st.integers(3, 6))
    first = draw(st.integers(400, 2000))
    shrink = draw(st.floats(0.3, 1.0))
    ops, tensors = [], []
    x = "batch"
    for i in range(layers):
        size = max(1, int(first * shrink**i))
        conv_s = draw(st.floats(0.2, 2.0))
        ops.append(op(f"conv{i}", conv_s, 2 * conv_s, [x], [f"c{i}"]))
        ops.append(op(f"relu{i}", conv_s / 50, conv_s / 25, [f"c{i}"], [f"r{i}"]))
        tensors.append(tensor(f"c{i}", size))
        tensors.append(tensor(f"r{i}", size, saved_for=[f"relu{i}"]))
        if x != "batch":
            next(t for t in tensors if t["name"] == x)["saved_for"].append(f"conv{i}")
        x = f"r{i}"
        if i % 2 and i < layers - 1:
            ops.append(op(f"pool{i}", conv_s / 20, conv_s / 20, [x], [f"p{i}"]))
            tensors.append(tensor(f"p{i}", max(1, size // 4)))
            x = f"p{i}"
    ops.append(op("loss", 0.01, 0.01, [x], ["out"]))
    tensors.append(tensor("out", 1))
    next(t for t in tensors if t["name"] == x)["saved_for"].append("loss")
    return graph(ops, tensors, name="cnn")


@st.composite
def transformer_graphs(draw):
    """Blocks of norm, qkv, attention scores (large, cheap to rerun), softmax, projection and a
    feed-forward pair around an activation (the largest tensors): the saves of a GPT block."""
    blocks = draw(st.integers(2, 3))
    h = draw(st.integers(20, 80))
    scores = draw(st.integers(40, 400))
    flop = draw(st.floats(0.005, 0.03))
    ops, tensors = [], []
    x = "batch"

    def add(name, seconds, inputs, out, size, saves):
        ops.append(op(name, seconds, 2 * seconds, inputs, [out]))
        tensors.append(tensor(out, size))
        for t in saves:
            if t != "batch":
                next(e for e in tensors if e["name"] == t)["saved_for"].append(name)

    for b in range(blocks):
        add(f"ln{b}", flop * h / 10, [x], f"n{b}", h, [x])
        add(f"qkv{b}", flop * 3 * h, [f"n{b}"], f"q{b}", 3 * h, [f"n{b}"])
        add(f"score{b}", flop * scores, [f"q{b}"], f"s{b}", scores, [f"q{b}"])
        add(f"soft{b}", flop * scores / 20, [f"s{b}"], f"a{b}", scores, [])
        tensors[-1]["saved_for"].append(f"soft{b}")
        add(f"proj{b}", flop * h, [f"a{b}"], f"o{b}", h, [f"a{b}"])
        add(f"up{b}", flop * 4 * h, [f"o{b}"], f"u{b}", 4 * h, [f"o{b}"])
        add(f"act{b}", flop * h / 5, [f"u{b}"], f"g{b}", 4 * h, [f"u{b}"])
        add(f"down{b}", flop * 4 * h, [f"g{b}"], f"d{b}", h, [f"g{b}"])
        x = f"d{b}"
    add("loss", 0.001, [x], "out", 1, [x])
    return graph(ops, tensors, name="transformer")


def _check(g, fraction: float, allowed) -> None:
    low = ss.min_budget(g, LINK, allowed=allowed)
    high = ss.keep_all_peak(g, LINK)
    budget = int(low + fraction * (high - low))
    exact = ss.solve(g, budget, LINK, solver="cpsat", allowed=allowed, time_limit_s=CAP)
    if exact.info.status != "optimal":
        return  # no proven optimum to measure against
    heuristic = ss.solve(g, budget, LINK, solver="heuristic", allowed=allowed)
    ideal = g.ideal_step_time_s
    h_over = heuristic.info.predicted_step_time_s - ideal
    e_over = exact.info.predicted_step_time_s - ideal
    assert h_over <= 2 * e_over + 0.01 * ideal + 1e-12, (
        f"heuristic overhead {h_over:.4g} s against the optimum's {e_over:.4g} s "
        f"(ideal {ideal:.4g} s) at budget {budget}, allowed={allowed}"
    )


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cnn_graphs(), st.floats(0.1, 0.9), st.sampled_from([None, ("keep", "recompute")]))
def test_the_heuristic_is_near_the_optimum_on_cnn_shaped_graphs(g, fraction, allowed):
    _check(g, fraction, allowed)


def _within_bound(name: str, budget: int) -> None:
    from pathlib import Path

    g = ss.load_graph(Path(__file__).parent / "data" / name)
    exact = ss.solve(g, budget, LINK, solver="cpsat", time_limit_s=CAP)
    assert exact.info.status == "optimal"
    heuristic = ss.solve(g, budget, LINK, solver="heuristic")
    ideal = g.ideal_step_time_s
    h_over = heuristic.info.predicted_step_time_s - ideal
    assert h_over <= 2 * (exact.info.predicted_step_time_s - ideal) + 0.01 * ideal


@pytest.mark.slow
def test_the_heuristic_is_near_the_optimum_on_the_recorded_transformer_case():
    """The case the property below found (tests/data/heuristic_collapse_transformer.json, budget
    280 bytes on the test link, every decision): the optimum's overhead is 0.035 s of a 10.13 s
    step (n1 and g0 rerun: 0.0117 + 0.0234 s). The rules rerun q1 (0.35 s): keeping it alone
    tops the budget, so only an exchange (q1 kept, n1 recomputed) reaches a plan within
    2 x 0.035 + 0.101 s (formulations/local-search.md, "Exchanges"); the heuristic's is 0.092 s."""
    _within_bound("heuristic_collapse_transformer.json", 280)


@pytest.mark.slow
def test_the_heuristic_is_near_the_optimum_on_the_recorded_wide_transformer_case():
    """Found by the property below at 100 examples (tests/data/
    heuristic_collapse_transformer_wide.json, budget 380 bytes, every decision): the optimum's
    overhead is 0.07 s of an 11.16 s step (it copies q1 and keeps u0, rerunning n1, g0 and g1);
    the rules copy u0 and rerun q1 (0.3 s): 0.32 s against the 0.25 s allowed, and no move of up
    to three tensors improves that. A lane trade (q1 takes u0's copy, and the cover recomputes
    g1 and n1 for the 80 bytes u0 adds back) reaches the optimum (formulations/local-search.md,
    "Lane trades")."""
    _within_bound("heuristic_collapse_transformer_wide.json", 380)


@pytest.mark.slow
def test_the_heuristic_is_near_the_optimum_where_a_small_copy_gives_way():
    """Found by the property below at 100 draws (tests/data/
    heuristic_collapse_transformer_lanes.json, budget 208 bytes, every decision): the optimum
    reruns g0 alone, 0.0369 s of a 15.93 s step, so 2 x 0.0369 + 0.1593 = 0.233 s is allowed.
    The rules rerun a1 (0.387 s): 0.424 s. The lane trade a1 -> swap with o1 (20 bytes, smaller
    than a1's 40) kept is 13 bytes over the budget; the cover then swaps d0 (20 bytes, the
    smallest kept tensor that covers 13) rather than rerun u1 (0.74 s), and that is the optimum.
    It takes 131 plans simulated: the polish's work on a graph of 14 saved tensors is 148."""
    _within_bound("heuristic_collapse_transformer_lanes.json", 208)


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    transformer_graphs(),
    st.floats(0.1, 0.9),
    st.sampled_from([None, ("keep", "recompute")]),
)
def test_the_heuristic_is_near_the_optimum_on_transformer_shaped_graphs(g, fraction, allowed):
    _check(g, fraction, allowed)
