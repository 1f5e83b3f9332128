"""Property tests on random DAGs: the simulator, the validator and the rules agree."""

import numpy as np
from helpers import LINK, random_graphs, random_plans
from hypothesis import HealthCheck, given, settings

import slackswap as ss

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def naive_keep_all_memory(g):
    """Rules 1-3 written out directly, op by op, as an independent reference."""
    n = g.n_ops
    live = {}
    readers = {t.name: [] for t in g.tensors}
    for i, o in enumerate(g.ops):
        for name in o.inputs:
            if name in readers:
                readers[name].append(i)
    order = g.op_index
    points = []
    for i, o in enumerate(g.ops):
        for out in o.outputs:
            live[out] = g.tensors[g.tensor_index[out]].bytes
        points.append(sum(live.values()) + o.forward_workspace_bytes)
        for name in list(live):
            t = g.tensors[g.tensor_index[name]]
            last = max(readers[name] + [order[g.ops[g.producer[g.tensor_index[name]]].name]])
            if not t.saved_for and last <= i:
                del live[name]
    for i in reversed(range(n)):
        o = g.ops[i]
        points.append(sum(live.values()) + o.backward_workspace_bytes)
        for name in list(live):
            t = g.tensors[g.tensor_index[name]]
            if t.saved_for and min(order[s] for s in t.saved_for) == i:
                del live[name]
    assert not live  # memory is back to zero after the step
    return points


@SETTINGS
@given(random_graphs())
def test_keep_all_retention_is_one_and_peak_follows_rules(g):
    p = ss.solve(g, 1.0, LINK, solver="keep-all")
    sim = ss.simulate(g, p, LINK)
    assert sim.retention == 1.0
    assert sim.stall_s == 0.0
    reference = naive_keep_all_memory(g)
    assert list(sim.memory_bytes) == reference
    assert sim.peak_bytes == max(reference) == ss.keep_all_peak(g, LINK)


@SETTINGS
@given(random_plans())
def test_simulator_and_validator_agree(case):
    g, p = case
    sim = ss.simulate(g, p, LINK)
    check = ss.validate(g, p, LINK)
    assert sim.fits == check.ok
    assert sim.peak_bytes == check.peak_bytes
    assert sim.fits == (sim.peak_bytes <= p.budget_bytes)
    assert sim.step_time_s >= sim.ideal_step_time_s - 1e-9
    assert 0 < sim.retention <= 1.0 + 1e-12
    # the timeline ends where the step time says (stalls and reruns are the only extra time)
    end = sim.compute_intervals[:, 1].max() + g.optimizer_s
    assert np.isclose(sim.step_time_s, end)


@SETTINGS
@given(random_plans())
def test_memory_is_back_to_zero_and_lifetimes_are_ordered(case):
    g, p = case
    exp = ss.simulate(g, p, LINK).expansion
    assert (exp.iv_start <= exp.iv_end).all()
    assert (exp.iv_end < exp.n_points).all()
    last = exp.n_points - 1
    # at the last point (backward of the first op) only what that backward reads, or what its
    # producer's rerun left, is still resident; after it nothing is.
    at_last = exp.iv_tensor[(exp.iv_start <= last) & (exp.iv_end >= last)]
    allowed = set(g.saved_by_op[0]) | set(g.op_outputs[0])
    assert set(at_last.tolist()) <= allowed


@SETTINGS
@given(random_plans())
def test_plans_round_trip_through_json(case):
    g, p = case
    again = ss.load_plan(p.to_json())
    assert again.decisions == p.decisions
    assert ss.simulate(g, again, LINK).step_time_s == ss.simulate(g, p, LINK).step_time_s
