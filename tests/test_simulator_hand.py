"""Hand-worked steps: every time, stall and peak below is computed in the comments."""

import dataclasses

import pytest
from helpers import HALF_DUPLEX, LINK, graph, op, open_plan, plan, tensor

import slackswap as ss

# Link: 100 bytes/s each way, no latency, so a 100-byte copy takes 1 s.


def chain_graph():
    # A -> a (100 B, saved for B); B reads a -> b (10 B, read by C only); C reads b -> c (10 B).
    return graph(
        [
            op("A", 1.0, 1.0, ["batch"], ["a"]),
            op("B", 1.0, 1.0, ["a"], ["b"]),
            op("C", 3.0, 3.0, ["b"], ["c"]),
        ],
        [tensor("a", 100, ["B"]), tensor("b", 10), tensor("c", 10)],
    )


def test_keep_all_peak_follows_rules():
    g = chain_graph()
    # forward A: a=100; B: a+b=110; C: a+b+c=120, then b and c are freed -> 100
    # backward C: 100; backward B: 100, then a is freed; backward A: 0
    assert ss.keep_all_peak(g, LINK) == 120
    sim = ss.simulate(g, ss.solve(g, 1.0, LINK, solver="keep-all"), LINK)
    assert sim.retention == 1.0
    assert sim.step_time_s == pytest.approx(10.0)
    assert list(sim.memory_bytes) == [100, 110, 120, 100, 100, 0]


def test_swap_hidden_behind_compute():
    g = chain_graph()
    sim = ss.simulate(g, plan(g, {"a": "swap"}, 120), LINK)
    # D2H of a: issued when A ends (t=1), done t=2 = end of B (its last forward reader): freed
    # after B, so C runs with b+c = 20 bytes. Backward: C runs 5..8, B needs a at t=8; the
    # prefetch (1 s) is issued at the start of backward C (t=5) and lands at t=6. No stall.
    assert sim.stall_s == pytest.approx(0.0)
    assert sim.step_time_s == pytest.approx(10.0)
    assert sim.peak_bytes == 110  # forward B: a + b
    assert list(sim.memory_bytes) == [100, 110, 20, 100, 100, 0]
    assert sim.d2h_intervals[0, :2].tolist() == pytest.approx([1.0, 2.0])
    assert sim.h2d_intervals[0, :2].tolist() == pytest.approx([5.0, 6.0])


def test_swap_that_cannot_be_hidden_and_prefetch_stall():
    g = graph(
        [
            op("A", 1.0, 1.0, ["batch"], ["a"]),
            op("B", 1.0, 1.0, ["a"], ["b"]),
            op("C", 0.5, 0.5, ["b"], ["c"]),
        ],
        [tensor("a", 300, ["B"]), tensor("b", 10), tensor("c", 10)],
    )
    sim = ss.simulate(g, plan(g, {"a": "swap"}, 1000), LINK)
    # D2H of a takes 3 s: t=1..4. The forward ends at 2.5, backward C runs 2.5..3.0.
    # Backward B needs a: wait for the D2H to finish (t=4), then the prefetch runs 4..7.
    # Stall 3.0 + 1.0 = 4.0 s at backward B; step = 7 + 1 + 1 = 9 s; ideal = 5 s.
    assert sim.stall_s == pytest.approx(4.0)
    assert sim.step_time_s == pytest.approx(9.0)
    assert sim.retention == pytest.approx(5.0 / 9.0)


def test_recompute_chain():
    # A -> a (100, saved for B); B reads a -> b (50, saved for C); C reads b -> c (10, saved by C)
    g = graph(
        [
            op("A", 1.0, 1.0, ["batch"], ["a"]),
            op("B", 2.0, 1.0, ["a"], ["b"]),
            op("C", 1.0, 1.0, ["b"], ["c"]),
        ],
        [tensor("a", 100, ["B"]), tensor("b", 50, ["C"]), tensor("c", 10, ["C"])],
    )
    p = plan(g, {"a": "recompute", "b": "recompute", "c": "keep"}, 1000)
    sim = ss.simulate(g, p, LINK)
    # backward C needs b; rebuilding b reruns B, which reads a, itself recomputed: A reruns too.
    # time: forward 4 + reruns 1 + 2 + backward 3 = 10; ideal 7
    assert sim.recompute_s == pytest.approx(3.0)
    assert sim.step_time_s == pytest.approx(10.0)
    # memory: fwd A 100, B 150, C: b + c = 60 (a left after B, its last forward reader);
    # rerun A: c + a = 110; rerun B: c + a + b = 160; backward C: 160; backward B: a = 100; A: 0
    assert list(sim.memory_bytes) == [100, 150, 60, 110, 160, 160, 100, 0]
    assert sim.expansion.reruns[3] == (0, 1)
    assert ss.validate(g, p, LINK).ok


def test_memory_pressure_stall():
    g = graph(
        [
            op("A", 1.0, 1.0, ["batch"], ["a"]),
            op("B", 0.5, 1.0, ["a"], ["b"]),
            op("C", 3.0, 1.0, ["b"], ["c"]),
        ],
        [tensor("a", 100, ["B"]), tensor("b", 10), tensor("c", 10)],
    )
    # D2H of a runs 1..2; B ends at 1.5. Left alone, a would stay through C (120 bytes there).
    # Under a 110-byte budget a must leave right after B, so C waits for the copy: stall 0.5 s.
    sim = ss.simulate(g, plan(g, {"a": "swap"}, 110), LINK)
    assert sim.fits
    assert sim.peak_bytes == 110
    assert sim.stall_s == pytest.approx(0.5)
    # backward: C 5..6, the prefetch of a runs 5..6, B 6..7, A 7..8
    assert sim.step_time_s == pytest.approx(8.0)
    roomy = ss.simulate(g, plan(g, {"a": "swap"}, 120), LINK)
    assert roomy.stall_s == pytest.approx(0.0) and roomy.peak_bytes == 120


def test_half_duplex_link_serialises_copies():
    g = graph(
        [
            op("A", 1.0, 1.0, ["batch"], ["a"]),
            op("B", 1.0, 1.0, ["batch"], ["b"]),
            op("C", 1.0, 1.0, ["batch"], ["c"]),
        ],
        [tensor("a", 100, ["A"]), tensor("b", 100, ["B"]), tensor("c", 1)],
    )
    sched = {"d2h_free": {"a": 1, "b": 2}, "h2d_issue": {"a": 2, "b": 3}}
    p = plan(g, {"a": "swap", "b": "swap"}, 1000, sched)
    # duplex: D2H a 1..2, D2H b 2..3, H2D a 2..3 (issued at C's start), H2D b 3..4 (issued at
    # backward C's start, t=3); backward B starts at 4: no stall. Step 6 s.
    full = ss.simulate(g, p, LINK)
    assert full.stall_s == pytest.approx(0.0) and full.step_time_s == pytest.approx(6.0)
    # one shared link: D2H b 2..3, then H2D a 3..4, then H2D b 4..5: backward B waits 4 -> 5.
    half = ss.simulate(g, p, HALF_DUPLEX)
    assert half.stall_s == pytest.approx(1.0) and half.step_time_s == pytest.approx(7.0)


def test_plan_over_budget_is_reported_where():
    g = chain_graph()
    sim = ss.simulate(g, plan(g, {"a": "keep"}, 105), LINK)
    assert not sim.fits
    assert "forward of op 'B'" in sim.violations[0] and "5 bytes over" in sim.violations[0]
    v = ss.validate(g, plan(g, {"a": "keep"}, 105), LINK)
    assert not v.ok and v.violations[0].op == "B" and v.violations[0].bytes_over == 5
    assert v.violations[0].tensor == "a"


def test_schedule_errors_are_named():
    g = chain_graph()
    # completing a partial schedule that breaks a rule names the rule
    with pytest.raises(ss.PlanError, match=r"d2h_free\['a'\].*before its last forward reader"):
        plan(g, {"a": "swap"}, 1000, {"d2h_free": {"a": 0}})
    # a complete schedule that breaks a rule: the simulator refuses, the checker names it
    bad = dataclasses.replace(
        open_plan(g, {"a": "swap"}, 1000, {"d2h_free": {"a": 0}, "h2d_issue": {"a": 3}}),
        hardware=LINK,
    )
    with pytest.raises(ss.PlanError, match=r"d2h_free\['a'\].*before its last forward reader"):
        ss.simulate(g, bad)
    assert "before its last forward reader" in ss.validate(g, bad).report()
    late = dataclasses.replace(
        open_plan(g, {"a": "swap"}, 1000, {"d2h_free": {"a": 1}, "h2d_issue": {"a": 5}}),
        hardware=LINK,
    )
    with pytest.raises(ss.PlanError, match=r"h2d_issue\['a'\].*after its first use"):
        ss.simulate(g, late)
    assert "after its first use" in ss.validate(g, late).report()


def test_a_rebuild_holds_the_gradients_waiting_for_its_position():
    """Op C's backward begins with 40 bytes of gradients waiting (rerun_workspace_bytes): a
    rebuild at its position runs while they are alive, so each rerun point counts them; the
    backward op's own point counts its backward workspace instead. The recompute chain above,
    with C's rerun workspace 40: rerun A 110 + 40 = 150, rerun B 160 + 40 = 200; the checker
    finds the same peak, and at a budget of 199 the plan is over it at rerun B."""
    g = graph(
        [
            op("A", 1.0, 1.0, ["batch"], ["a"]),
            op("B", 2.0, 1.0, ["a"], ["b"]),
            op("C", 1.0, 1.0, ["b"], ["c"], rerun_workspace_bytes=40),
        ],
        [tensor("a", 100, ["B"]), tensor("b", 50, ["C"]), tensor("c", 10, ["C"])],
    )
    p = plan(g, {"a": "recompute", "b": "recompute", "c": "keep"}, 1000)
    sim = ss.simulate(g, p, LINK)
    assert list(sim.memory_bytes) == [100, 150, 60, 150, 200, 160, 100, 0]
    report = ss.validate(g, p, LINK)
    assert report.ok and report.peak_bytes == 200
    tight = plan(g, {"a": "recompute", "b": "recompute", "c": "keep"}, 199)
    assert not ss.validate(g, tight, LINK).ok and not ss.simulate(g, tight, LINK).fits
    # the exact planner sees it too: at 199 it keeps what the rebuild would need
    solved = ss.solve(g, 199, LINK, solver="cpsat", gap=0.0)
    assert ss.simulate(g, solved, LINK).peak_bytes <= 199
    assert (
        ss.load_graph(g.to_json()).digest
        == g.digest
        != graph(
            [
                op("A", 1.0, 1.0, ["batch"], ["a"]),
                op("B", 2.0, 1.0, ["a"], ["b"]),
                op("C", 1.0, 1.0, ["b"], ["c"]),
            ],
            [tensor("a", 100, ["B"]), tensor("b", 50, ["C"]), tensor("c", 10, ["C"])],
        ).digest
    )


def test_an_op_that_reruns_with_another_brings_it_into_every_rebuild():
    """torch's checkpoint reruns a region's ops it does not cache whatever is rebuilt: B reruns
    with D (rerun_with), so rebuilding b reruns B and D, whose output d (30 B) is alive at
    D's rerun point. Forward (a kept, b's first life to D, its last reader): A 100, B a + b
    150, C + c 160, D + d 190. Backward D: a + c 110; C: rerun B a + c + b 160, rerun D + d
    190 (d read by nothing: gone after), C itself 160; B: a 100; A: 0. Without D in the
    rebuild, C's position would peak at 160."""
    g = graph(
        [
            op("A", 1.0, 1.0, ["batch"], ["a"]),
            op("B", 2.0, 1.0, ["a"], ["b"], rerun_with=["D"]),
            op("C", 1.0, 1.0, ["b"], ["c"]),
            op("D", 0.5, 0.5, ["b"], ["d"]),
        ],
        [tensor("a", 100, ["B"]), tensor("b", 50, ["C"]), tensor("c", 10, ["C"]), tensor("d", 30)],
    )
    b = g.tensor_index["b"]
    assert [g.ops[q].name for q in g.rerun_ops[b]] == ["B", "D"]
    p = plan(g, {"a": "keep", "b": "recompute", "c": "keep"}, 1000)
    sim = ss.simulate(g, p, LINK)
    assert list(sim.memory_bytes) == [100, 150, 160, 190, 110, 160, 190, 160, 100, 0]
    assert sim.recompute_s == pytest.approx(2.5)  # B and D again
    report = ss.validate(g, p, LINK)
    assert report.ok and report.peak_bytes == sim.peak_bytes == int(sim.memory_bytes.max())
    assert ss.load_graph(g.to_json()).digest == g.digest
    with pytest.raises(ss.GraphError, match="rerun_with 'E' is no op"):
        graph([op("A", 1.0, 1.0, ["batch"], ["a"], rerun_with=["E"])], [tensor("a", 1, ["A"])])


def test_the_default_schedule_frees_only_what_the_budget_needs():
    """Keep-all: A 60 B (a), B 100 (a, b), C 110 (a, b, c), D 120 (a, b, c, d). The D2H lane
    carries a over 0.1..0.7 and b over 0.7..1.1, so both are freed after D by default; under a
    110-byte budget D is 10 bytes over. Freeing a alone before D covers it (60 >= 10): D waits
    for a's copy from 0.3 to 0.7 (stall 0.4 s), b leaves after D, its copy long done. Freeing
    both, as the yield once did, makes D wait for b's copy until 1.1 (stall 0.8 s). Backward:
    D 5.7..10.7 (both prefetched behind it), C, B, A: the step ends at 11.0 s (11.4 s)."""
    g = graph(
        [
            op("A", 0.1, 0.1, ["batch"], ["a"]),
            op("B", 0.1, 0.1, ["a"], ["b"]),
            op("C", 0.1, 0.1, ["b"], ["c"]),
            op("D", 5.0, 5.0, ["c"], ["d"]),
        ],
        [tensor("a", 60, ["B"]), tensor("b", 40, ["C"]), tensor("c", 10), tensor("d", 10)],
    )
    assert ss.keep_all_peak(g, LINK) == 120
    yielded = plan(g, {"a": "swap", "b": "swap"}, 110)
    assert dict(yielded.schedule.d2h_free) == {"a": 2, "b": 3}
    sim = ss.simulate(g, yielded, LINK)
    assert sim.fits and sim.peak_bytes == 110
    assert sim.stall_s == pytest.approx(0.4)
    assert sim.step_time_s == pytest.approx(11.0)
    both = plan(g, {"a": "swap", "b": "swap"}, 110, schedule={"d2h_free": {"a": 2, "b": 2}})
    slower = ss.simulate(g, both, LINK)
    assert slower.fits and slower.stall_s == pytest.approx(0.8)
    assert slower.step_time_s == pytest.approx(11.4)
