"""The LP and departure bounds take the problem as the planners hold it (hardware, budget in
bytes, decision mask resolved once): the same bound as the public keyword calls, and the exact
planner calls nothing that parses a budget or hardware again."""

from pathlib import Path

import numpy as np
import pytest
from helpers import LINK

import slackswap as ss
from slackswap.core.restrict import decision_mask
from slackswap.planners.base import Problem
from slackswap.planners.departures import DepartureSettings, departure_bound_of
from slackswap.planners.lpbound import LPSettings, lp_bound_of


def _graph():
    return ss.load_graph(Path(__file__).parent / "data" / "heuristic_collapse_transformer.json")


@pytest.mark.parametrize("allowed", [None, ("keep", "recompute")])
def test_a_resolved_problem_gives_the_keyword_calls_bound(allowed):
    g = _graph()
    mask = None if allowed is None else decision_mask(g, allowed, None, LINK.min_swap_bytes)
    problem = Problem(g, LINK, 280, mask)
    by_keywords = ss.lp_bound(g, 280, LINK, allowed=allowed)
    by_problem = lp_bound_of(problem)
    assert by_problem.step_time_s == by_keywords.step_time_s
    assert by_problem.status == by_keywords.status
    integral = lp_bound_of(problem, LPSettings(integral=True, max_nodes=50))
    assert integral.integral and integral.step_time_s >= by_problem.step_time_s - 1e-12
    if allowed is None:
        departures = departure_bound_of(problem, DepartureSettings(deterministic_time_s=2.0))
        keyword = ss.departure_bound(g, 280, LINK, deterministic_time_s=2.0)
        assert departures.status == keyword.status
        assert departures.step_time_s == pytest.approx(keyword.step_time_s)


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="whole_departures"):
        LPSettings(whole_departures=2)  # needs integral decisions
    with pytest.raises(ValueError, match="min_gap_s"):
        DepartureSettings(min_gap_s=float("nan"))
    with pytest.raises(ValueError, match="hint"):
        departure_bound_of(Problem(_graph(), LINK, 280), hint=np.zeros(3, dtype=np.int8))


def test_the_exact_planner_calls_the_bounds_with_its_problem():
    exact = Path(__file__).parents[1] / "src" / "slackswap" / "planners" / "exact"
    for path in exact.glob("*.py"):
        text = path.read_text()
        for keyword_call in ("lp_bound(", "departure_bound("):
            assert f" {keyword_call}" not in text and f"={keyword_call}" not in text, (
                f"{path.name} calls {keyword_call}...) with keywords: the resolved problem "
                "goes to lp_bound_of / departure_bound_of"
            )


def test_a_tensor_that_may_not_swap_weighs_a_quarter_of_a_relaxation_cell():
    """The recorded transformer graph: 34 positions, 14 saved tensors. All may swap: 34 x 14 =
    476 cells. Keep and recompute only: 34 x 14 x 0.25 = 119 (no lane rows). Half of them (7)
    kept off the lanes: 34 x (7 + 7 x 0.25) = 297.5."""
    from slackswap.planners.exact.start_search import relaxation_cells
    from slackswap.planners.limits import RELAX_CELL_WEIGHT_WITHOUT_SWAP

    assert RELAX_CELL_WEIGHT_WITHOUT_SWAP == 0.25
    g = _graph()
    assert (g.n_positions, len(g.saved)) == (34, 14)
    assert relaxation_cells(Problem(g, LINK, 280)) == 476
    keep_recompute = decision_mask(g, ("keep", "recompute"), None, LINK.min_swap_bytes)
    assert relaxation_cells(Problem(g, LINK, 280, keep_recompute)) == 119
    half = decision_mask(g, None, None, LINK.min_swap_bytes)
    half[g.saved[:7], 1] = False
    assert relaxation_cells(Problem(g, LINK, 280, half)) == 297.5
