"""Two rebuilds that rerun the same op: one rebuild of both (the later tensor rebuilt early, at
the earlier one's first use) runs it once; rebuilds at two positions run it twice. The exact
planner's model over every position offers the early rebuild (else its bound is no proof), and
the integral relaxation charges the second run where the early rebuild does not fit
(formulations/milp.md, "Candidates"; lp-bound.md, "Rebuilds pull others along")."""

import pytest
from helpers import CAP, LINK, graph, op, plan, tensor

import slackswap as ss

RECOMPUTE_ONLY = ("keep", "recompute")


def _shared(workspace: int = 0):
    """q (1 s) makes h (unsaved); f1 and f2 read h and make x and y (100 bytes each, saved for
    g1 and g2); big (150 bytes) keeps either from staying through the forward pass at 220-250
    bytes. Backward: loss (position 7), big (8), g2 (9: y's first use), g1 (10: x's)."""
    ops = [
        op("q", 1.0, 1.0, ["batch"], ["h"]),
        op("f1", 0.1, 0.1, ["h"], ["x"]),
        op("f2", 0.1, 0.1, ["h"], ["y"]),
        op("g1", 0.1, 0.1, ["x"], ["r1"]),
        op("g2", 0.1, 0.1, ["y"], ["r2"], backward_workspace_bytes=workspace),
        op("big", 0.5, 0.5, ["r2"], ["z"]),
        op("loss", 0.01, 0.01, ["r1", "z"], ["out"]),
    ]
    tensors = [
        tensor("h", 10),
        tensor("x", 100, saved_for=["g1"]),
        tensor("y", 100, saved_for=["g2"]),
        tensor("r1", 1),
        tensor("r2", 1),
        tensor("z", 150),
        tensor("out", 1),
    ]
    return graph(ops, tensors, name="shared-rerun")


def test_the_exact_planner_rebuilds_early_to_share_a_rerun():
    """At 250 bytes x and y are both recomputed (keeping either tops the budget at big: 150 +
    100 + 2 > 250 less h's and the gradients' room). The ideal step is 3.82 s. Rebuilt at their
    own first uses, q runs twice: 3.82 + 2 x 1.0 + 0.1 + 0.1 = 6.02 s. Rebuilt together at
    position 9, x held one position early (peak 210), q runs once: 5.02 s. The model used to
    offer x no rebuild position but its first use and call 6.02 s optimal."""
    g = _shared()
    assert g.ideal_step_time_s == pytest.approx(3.82)
    together = plan(
        g, {"x": "recompute", "y": "recompute"}, 250, {"recompute_at": {"x": 9, "y": 9}}
    )
    assert ss.validate(g, together).ok
    assert ss.simulate(g, together, LINK).step_time_s == pytest.approx(5.02)
    exact = ss.solve(
        g, 250, LINK, solver="cpsat", allowed=RECOMPUTE_ONLY, gap=0.0, time_limit_s=CAP
    )
    assert exact.info.status == "optimal"
    assert exact.info.predicted_step_time_s == pytest.approx(5.02)
    assert dict(exact.schedule.recompute_at) == {"x": 9, "y": 9}


@pytest.mark.parametrize("budget", [220, 250])
def test_the_relaxation_charges_the_second_run_where_the_early_rebuild_does_not_fit(
    monkeypatch, budget
):
    """With 60 bytes of workspace in g2's backward, x rebuilt at position 9 beside y tops the
    budget (100 + 100 + 60 + h's 10 > 250): q runs twice, 6.02 s, the exact optimum. The integral
    relaxation says so; without the rows it said 5.02 s (q once)."""
    import slackswap.planners.lpbuilder as lpbuilder

    g = _shared(workspace=60)
    exact = ss.solve(
        g, budget, LINK, solver="cpsat", allowed=RECOMPUTE_ONLY, gap=0.0, time_limit_s=CAP
    )
    assert exact.info.status == "optimal"
    assert exact.info.predicted_step_time_s == pytest.approx(6.02)
    bound = ss.lp_bound(g, budget, LINK, allowed=RECOMPUTE_ONLY, integral=True, time_limit_s=CAP)
    assert bound.step_time_s == pytest.approx(6.02)
    monkeypatch.setattr(lpbuilder, "rebuild_pulls", lambda *args, **kwargs: None)
    without = ss.lp_bound(g, budget, LINK, allowed=RECOMPUTE_ONLY, integral=True, time_limit_s=CAP)
    assert without.step_time_s == pytest.approx(5.02)
