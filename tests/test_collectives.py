"""Collectives on the copy lanes (FSDP's all-gathers and reduce-scatters on a PCIe node without
NVLink): hand-worked step times, the checker and the simulator agreeing, the LP bound still a
bound, the planners charging the lanes, and the FSDP workload."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import CAP, LINK, graph, op, plan, random_graphs, tensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slackswap as ss
from slackswap.core.graph import Collective

SHARED = LINK.with_link(name="test-shared", collectives_on_link=True)


def two_ops(*collectives):
    """a (fwd 1 s, bwd 2 s) makes x (100 B) saved for b (fwd 1 s, bwd 2 s); link 100 B/s."""
    g = graph(
        [op("a", 1, 2, [], ["x"]), op("b", 1, 2, ["x"], ["y"])],
        [tensor("x", 100, ["b"]), tensor("y", 100)],
    )
    return dataclasses.replace(g, collectives=tuple(collectives))


def test_an_all_gather_on_the_shared_link_delays_the_prefetch_behind_it():
    # all-gather issued as b's forward is reached (t = 1): it receives 200 B on the H2D lane,
    # 1 s -> 3 s. x is offloaded after a (1 s -> 2 s) and prefetched at b's backward (position 2,
    # reached at 2 s): the H2D lane is busy until 3 s, so x lands at 4 s and b's backward waits
    # 2 s. Step = ideal 6 s + 2 s = 8 s. Without the collective on the link: x lands at 3 s,
    # a 1 s wait, 7 s.
    g = two_ops(Collective("ag", "b", "forward", d2h_bytes=0, h2d_bytes=200))
    budget = ss.keep_all_peak(g, LINK)
    shared = plan(g, {"x": "swap"}, budget, hw=SHARED)
    assert dict(shared.schedule.h2d_issue) == {"x": 2}
    sim = ss.simulate(g, shared, SHARED)
    assert sim.step_time_s == pytest.approx(8.0)
    assert sim.stall_s == pytest.approx(2.0)
    check = ss.validate(g, shared)
    assert check.ok and check.step_time_s == pytest.approx(8.0)
    nvlink = plan(g, {"x": "swap"}, budget, hw=LINK)
    assert ss.simulate(g, nvlink, LINK).step_time_s == pytest.approx(7.0)
    assert ss.validate(g, nvlink).step_time_s == pytest.approx(7.0)


def test_the_optimizer_waits_for_the_last_reduce_scatter():
    # a reduce-scatter issued as a's backward is reached (position 3, at 4 s with x kept: 2 s of
    # forward, 2 s of b's backward) sends 500 B: D2H 4 s -> 9 s. Compute ends at 6 s; the
    # optimizer waits 3 s: step 9 s (ideal 6 s).
    g = two_ops(Collective("rs", "a", "backward", d2h_bytes=500))
    keep = plan(g, {"x": "keep"}, ss.keep_all_peak(g, LINK), hw=SHARED)
    sim = ss.simulate(g, keep, SHARED)
    assert sim.step_time_s == pytest.approx(9.0) and sim.stall_s == pytest.approx(3.0)
    assert ss.validate(g, keep).step_time_s == pytest.approx(9.0)


def test_collectives_travel_in_the_graph_file_and_the_digest():
    g = two_ops(Collective("ag", "b", "forward", 10, 20))
    again = ss.load_graph(g.to_json())
    assert again.collectives == g.collectives and again.digest == g.digest
    assert g.digest != two_ops().digest
    with pytest.raises(ss.GraphError, match="collective 'bad': op 'nope'"):
        two_ops(Collective("bad", "nope", "forward", 1, 1))
    with pytest.raises(ss.GraphError, match="phase"):
        two_ops(Collective("bad", "a", "sideways", 1, 1))


@st.composite
def graphs_with_collectives(draw):
    g, p = draw(random_graphs_and_plans())
    names = [o.name for o in g.ops]
    collectives = tuple(
        Collective(
            f"c{i}",
            draw(st.sampled_from(names)),
            draw(st.sampled_from(["forward", "backward"])),
            draw(st.integers(0, 300)),
            draw(st.integers(0, 300)),
        )
        for i in range(draw(st.integers(1, 4)))
    )
    return dataclasses.replace(g, collectives=collectives), p


@st.composite
def random_graphs_and_plans(draw):
    from helpers import random_plans

    return draw(random_plans())


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=graphs_with_collectives(), duplex=st.booleans())
@pytest.mark.slow
def test_checker_and_simulator_agree_with_collectives_on_the_link(case, duplex):
    g, p = case
    hw = SHARED.with_link(duplex=duplex)
    closed = ss.complete(
        dataclasses.replace(p, graph_digest=g.digest, schedule=None, hardware=None), g, hw
    )
    sim = ss.simulate(g, closed, hw)
    check = ss.validate(g, closed)
    assert check.ok == sim.fits
    if check.ok:
        assert check.step_time_s == pytest.approx(sim.step_time_s, rel=1e-9, abs=1e-12)
        lp = ss.lp_bound(g, closed.budget_bytes, hw)
        if lp.status == "optimal":
            assert lp.step_time_s <= sim.step_time_s * (1 + 1e-6) + 1e-9


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=graphs_with_collectives())
def test_the_integral_relaxation_is_a_bound_with_collectives(case):
    """Its decisions are integral; its times are not (a bound that rounded them up would pass
    valid plans)."""
    g, p = case
    closed = ss.complete(
        dataclasses.replace(p, graph_digest=g.digest, schedule=None, hardware=None), g, SHARED
    )
    keep_all = ss.solve(g, 1.0, SHARED, solver="keep-all")
    for valid in (closed, keep_all):  # any valid plan, and one with no stall but the lanes'
        sim = ss.simulate(g, valid, SHARED)
        if not sim.fits:
            continue
        relaxed = ss.lp_bound(
            g, valid.budget_bytes, SHARED, integral=True, max_nodes=5000, time_limit_s=300.0
        )
        if relaxed.status in ("optimal", "timeout"):
            assert relaxed.step_time_s <= sim.step_time_s * (1 + 1e-6) + 1e-9


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(g=random_graphs(max_ops=6), data=st.data())
def test_exact_plans_with_collectives_are_valid_and_never_beat_the_bound(g, data):
    names = [o.name for o in g.ops]
    g = dataclasses.replace(
        g,
        collectives=(
            Collective("ag", data.draw(st.sampled_from(names)), "forward", 0, 150),
            Collective("rs", data.draw(st.sampled_from(names)), "backward", 150, 0),
        ),
    )
    budget = data.draw(st.integers(ss.min_budget(g, SHARED), ss.keep_all_peak(g, SHARED)))
    for solver in ("heuristic", "cpsat"):
        p = ss.solve(g, budget, SHARED, solver=solver, work_s=5, time_limit_s=CAP)
        check = ss.validate(g, p)
        assert check.ok, check.violations
        assert p.info.predicted_step_time_s == pytest.approx(check.step_time_s)
        if p.info.bound is not None:
            assert p.info.bound <= check.step_time_s * (1 + 1e-9)


def test_a_step_of_denormal_seconds_with_a_collective_on_the_link_is_bounded():
    """Found by the test above: an ideal step of 2.2e-313 s and a 1-byte collective (0.01 s on
    the link). In units of a thousandth of the step, the collective's time overflowed to inf and
    the LP bound (and every exact planner through it) raised scipy's ValueError."""
    g = ss.load_graph(
        {
            "format": "slackswap.graph/1",
            "name": "denormal",
            "optimizer_s": 0.0,
            "ops": [
                {"name": "a", "forward_s": 0.0, "backward_s": 0.0, "inputs": [], "outputs": ["x"]},
                {
                    "name": "b",
                    "forward_s": 0.0,
                    "backward_s": 2.2250738585e-313,
                    "inputs": [],
                    "outputs": ["y"],
                },
            ],
            "tensors": [
                {"name": "x", "bytes": 0, "saved_for": []},
                {"name": "y", "bytes": 0, "saved_for": []},
            ],
            "collectives": [
                {"name": "c", "op": "a", "phase": "forward", "d2h_bytes": 0, "h2d_bytes": 1}
            ],
        }
    )
    for duplex in (True, False):
        hw = SHARED.with_link(duplex=duplex)
        lp = ss.lp_bound(g, 1, hw)
        assert lp.status == "optimal" and np.isfinite(lp.step_time_s)
        p = ss.solve(g, 1, hw, solver="cpsat", work_s=5.0, time_limit_s=CAP)
        sim = ss.simulate(g, p, hw)
        assert ss.validate(g, p).ok and lp.step_time_s <= sim.step_time_s * (1 + 1e-6) + 1e-9
