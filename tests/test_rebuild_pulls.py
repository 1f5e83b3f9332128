"""The integral relaxation's rebuild-pull rows (planners/rebuild_pulls.py, lp-bound.md "Rebuilds pull
others along"): a rebuild reads its frontier, so the recomputed tensors it reads or makes are
rebuilt with it, recursively. The rows only add memory every plan holds: never beaten."""

import numpy as np
import pytest
from helpers import CAP, LINK, seeded_graph

import slackswap as ss
import slackswap.planners.lpbuilder as lpbuilder
from slackswap.check.simulate import simulate_decisions
from slackswap.core.codes import keep_all_codes
from slackswap.core.plan import KEEP, RECOMPUTE, SWAP


def _without_pulls(monkeypatch):
    monkeypatch.setattr(lpbuilder, "rebuild_pulls", lambda *args, **kwargs: None)


@pytest.mark.slow
def test_the_pull_rows_reach_the_exact_optimum_where_the_relaxation_fell_short(monkeypatch):
    """A 16-op seeded graph at 2,997 bytes: the exact planner's proven optimum is 45.00872 s;
    the integral relaxation said 45.00524 s without the rows (it let a rebuild read a frontier
    tensor that its own rebuild, later, would bring back), and is that optimum with them."""
    g = seeded_graph(14, n_ops=16)
    exact = ss.solve(g, 2997, LINK, solver="cpsat", gap=0.0, work_s=240.0, time_limit_s=CAP)
    assert exact.info.status == "optimal"
    optimum = ss.simulate(g, exact, LINK).step_time_s
    assert optimum == pytest.approx(45.00871778851087, rel=1e-9)
    pulled = ss.lp_bound(g, 2997, LINK, integral=True, max_nodes=5000, time_limit_s=300.0)
    assert pulled.status == "optimal"
    assert pulled.step_time_s == pytest.approx(optimum, rel=1e-9)
    _without_pulls(monkeypatch)
    before = ss.lp_bound(g, 2997, LINK, integral=True, max_nodes=5000, time_limit_s=300.0)
    assert before.step_time_s == pytest.approx(45.00524281478433, rel=1e-9)


def _random_codes(g, rng, recompute_share: float, swap_share: float) -> np.ndarray:
    codes = keep_all_codes(g).copy()
    for t in g.saved:
        r = rng.random()
        if r < recompute_share and g.can_recompute[t]:
            codes[t] = RECOMPUTE
        elif r < recompute_share + swap_share:
            codes[t] = SWAP
    for group in g.rng_groups.values():  # a random group is rebuilt whole or not at all
        members = [int(m) for m in group]
        if any(codes[m] == RECOMPUTE for m in members) and not all(
            codes[m] == RECOMPUTE for m in members
        ):
            for m in members:
                codes[m] = KEEP if codes[m] == RECOMPUTE else codes[m]
    return codes


@pytest.mark.slow
def test_no_plan_beats_the_integral_relaxation_with_pulls(monkeypatch):
    """Recompute-heavy random decisions on 30 seeded graphs, each at the budget its plan needs
    (so the memory rows are tight): the relaxation never beats the plan's simulated step, and
    on some the rows raise it (they are not void)."""
    rng = np.random.default_rng(2)
    cases = []
    for seed in range(30):
        g = seeded_graph(seed, n_ops=int(rng.integers(6, 18)))
        for _ in range(6):
            codes = _random_codes(g, rng, rng.choice([0.3, 0.6, 0.9]), rng.choice([0.0, 0.2]))
            budget = int(
                simulate_decisions(g, codes, LINK, 10**18).peak_bytes * rng.choice([1.0, 1.05])
            )
            sim = simulate_decisions(g, codes, LINK, budget)
            if sim.fits:
                cases.append((g, budget, sim.step_time_s))
    bounds = [
        ss.lp_bound(g, budget, LINK, integral=True, max_nodes=5000, time_limit_s=300.0)
        for g, budget, _ in cases
    ]
    for (g, budget, step), bound in zip(cases, bounds):
        assert bound.status in ("optimal", "timeout"), (g.name, budget)
        assert bound.step_time_s <= step * (1 + 1e-9), (g.name, budget)
    _without_pulls(monkeypatch)
    raised = sum(
        bound.step_time_s
        > ss.lp_bound(
            g, budget, LINK, integral=True, max_nodes=5000, time_limit_s=300.0
        ).step_time_s
        * (1 + 1e-9)
        for (g, budget, _), bound in zip(cases, bounds)
    )
    assert raised >= 2
