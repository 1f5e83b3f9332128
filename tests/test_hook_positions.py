"""Hook positions (formulations/step-model.md, "Hook positions"): a schedule acts only where an
executor of hooks alone gets control; the default schedule, the planners, the smallest budget and
the checker keep to them, and a graph whose saver runs no hook is refused."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from helpers import CAP, graph, op, random_graphs, tensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slackswap as ss
from slackswap.core.errors import GraphError, PlanError

FAST = ss.Hardware(
    name="fast-link",
    d2h_bytes_per_s=1e12,
    h2d_bytes_per_s=1e12,
    latency_s=0.0,
    duplex=True,
    peak_flops=1e12,
    hbm_bytes_per_s=1e12,
)


def chain(hooks_after=(True, False, False, True), hooks_backward=(False, True, False, False)):
    """a -> x -> b (saves x) -> y -> c -> z -> d -> w; x 100 bytes, y 50, z 70, w 10."""
    names = "abcd"
    ops = [
        op("a", 1.0, 1.0, [], ["x"]),
        op("b", 1.0, 1.0, ["x"], ["y"]),
        op("c", 1.0, 1.0, ["y"], ["z"]),
        op("d", 1.0, 1.0, ["z"], ["w"]),
    ]
    for o, after, backward in zip(ops, hooks_after, hooks_backward):
        o["hook_after"] = after
        o["hook_backward"] = backward
    assert [o["name"] for o in ops] == list(names)
    return graph(
        ops,
        [tensor("x", 100, ["b"]), tensor("y", 50), tensor("z", 70), tensor("w", 10)],
        name="chain",
    )


def test_hand_worked_hook_positions_and_the_smallest_budget():
    g = chain()
    # starts: 0 (forward hook), 1 (after a), n = 4 (backward call), 6 (backward of b, a saver);
    # not 2, 3 (no save after b or c), 5 (backward of c), 7 (backward of a)
    assert g.hook_positions.tolist() == [True, True, False, False, True, False, True, False]
    # swap x: it may leave after positions 0, 3 or 5 (a hook at 1, 4, 6); its last forward
    # reader is b (position 1), so the first is 3, the end of the forward
    p = ss.complete(ss.Plan(g.name, g.digest, 10**6, {"x": "swap"}), g, FAST)
    assert p.schedule.d2h_free == {"x": 3}
    # its prefetch must start before position 6 does (the copy takes 1e-10 s): the latest hook
    # position before 6 is 4 (5, the backward of c, has none)
    assert p.schedule.h2d_issue == {"x": 4}
    assert ss.validate(g, p).ok
    # memory: point 0: x = 100; 1: x + y = 150; 2: x + y + z = 220 (x is still on the device:
    # no hook runs before c); 3: x + z + w = 180; backward: 4, 5, 6: x = 100
    assert ss.min_budget(g, FAST) == 220
    # with every position a hook position, x leaves after b: 2: y + z = 120, the peak 150 at b
    everywhere = chain((True,) * 4, (True,) * 4)
    assert ss.min_budget(everywhere, FAST) == 150
    sim = ss.simulate(g, p)
    assert sim.peak_bytes == 220


def test_a_schedule_off_the_hook_positions_is_refused_by_the_model_and_the_checker():
    g = chain()
    given_plan = ss.Plan(
        g.name,
        g.digest,
        10**6,
        {"x": "swap"},
        schedule=ss.Schedule(d2h_free={"x": 1}, h2d_issue={"x": 6}),
        hardware=FAST,
    )
    with pytest.raises(PlanError, match="cannot leave the device after position 1"):
        ss.complete(replace(given_plan, hardware=None), g, FAST)
    verdict = ss.validate(g, given_plan)
    assert not verdict.ok
    assert "no hook runs after position 1" in str(verdict.violations[0])
    # an issue at a position where no hook runs (5: the backward of c)
    late = replace(given_plan, schedule=ss.Schedule(d2h_free={"x": 3}, h2d_issue={"x": 5}))
    verdict = ss.validate(g, late)
    assert not verdict.ok and "no hook runs at position 5" in str(verdict.violations[0])
    fine = replace(given_plan, schedule=ss.Schedule(d2h_free={"x": 3}, h2d_issue={"x": 6}))
    assert ss.validate(g, fine).ok


def test_a_saver_without_a_backward_hook_is_refused_by_name():
    with pytest.raises(GraphError, match="saved_for names op 'b', whose hook_backward is false"):
        chain(hooks_backward=(False, False, False, False))


def test_the_flags_go_through_the_file_and_the_digest():
    g = chain()
    again = ss.load_graph(g.to_json())
    assert again.hook_positions.tolist() == g.hook_positions.tolist()
    assert again.digest == g.digest
    everywhere = chain((True,) * 4, (True,) * 4)
    assert everywhere.digest != g.digest
    # an analytic graph writes no flag: its file and digest are what they were
    assert "hook_after" not in everywhere.to_json()


@st.composite
def hooked_graphs(draw):
    """A random graph whose ops run hooks at random places (every saver unpacks in backward)."""
    g = draw(random_graphs())
    savers = {o for t in g.tensors for o in t.saved_for}
    ops = tuple(
        replace(
            o,
            hook_after=draw(st.booleans()),
            hook_backward=o.name in savers or draw(st.booleans()),
        )
        for o in g.ops
    )
    return replace(g, ops=ops)


def hook_faults(g, plan) -> list[str]:
    at = g.hook_positions
    s = plan.schedule
    out = [f"free {n}={k}" for n, k in s.d2h_free.items() if k + 1 < len(at) and not at[k + 1]]
    out += [f"issue {n}={k}" for n, k in s.h2d_issue.items() if not at[k]]
    out += [f"rebuild {n}={k}" for n, k in s.recompute_at.items() if not at[k]]
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(hooked_graphs(), st.floats(0.3, 1.0))
def test_every_fast_planner_acts_at_hook_positions_only(g, fraction):
    from helpers import LINK

    smallest = ss.smallest_budget(g, LINK)
    assert not hook_faults(g, smallest_plan(g, smallest))
    budget = max(smallest.budget_bytes, int(ss.keep_all_peak(g, LINK) * fraction))
    for solver in ("heuristic", "swap-all"):
        try:
            p = ss.solve(g, budget, LINK, solver=solver)
        except ss.InfeasibleBudget:
            continue
        assert not hook_faults(g, p), solver
        assert ss.validate(g, p).ok, (solver, ss.validate(g, p).violations[:1])


def smallest_plan(g, smallest):
    from helpers import LINK

    codes = smallest.codes
    decisions = {g.tensors[t].name: ("keep", "swap", "recompute")[int(codes[t])] for t in g.saved}
    open_plan = ss.Plan(g.name, g.digest, smallest.budget_bytes, decisions, smallest.schedule)
    return ss.complete(open_plan, g, LINK)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(hooked_graphs(), st.floats(0.4, 1.0))
def test_the_exact_planner_acts_at_hook_positions_only(g, fraction):
    from helpers import LINK

    budget = max(ss.min_budget(g, LINK), int(ss.keep_all_peak(g, LINK) * fraction))
    p = ss.solve(g, budget, LINK, solver="cpsat", work_s=5, time_limit_s=CAP)
    assert not hook_faults(g, p)
    assert ss.validate(g, p).ok


def test_the_profiler_records_where_the_step_runs_hooks():
    """A profiled step: a hook runs after every op that a save follows, and the backward of
    every saver; the first backward use of each saved tensor is a hook position."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4), torch.nn.Tanh()
    )
    g = ss.profile(model, torch.randn(2, 8), lambda out: out.sum(), overhead=False, calibrate=False)
    at = g.hook_positions
    n = g.n_ops
    assert at[0] and at[n]
    for t in g.saved:
        first = g.bwd_position(int(g.first_backward_use[t]))
        assert at[first]
    # not every position: the sum's backward saves nothing
    assert not at.all()
    assert np.flatnonzero(~at).size > 0
