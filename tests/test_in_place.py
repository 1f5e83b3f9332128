"""Tensors written in place after they were made (Op.writes): rebuilt by their producer and then
their writers, in forward order, priced and held that way by the step model, the checker and the
executor alike."""

import pytest
from helpers import CAP, LINK, graph, op, plan, tensor

import slackswap as ss


def masked():
    # op0 makes x (100 B, 1 s); op1 writes x in place (a dropout mask's bernoulli_: 2 s); op2
    # reads x and saves it for its backward; op3 makes the output. Rebuilding x reruns op0 then
    # op1: 1 + 2 = 3 s of forward work, against the 2 s of op0 alone a rerun of its producer
    # would count.
    return graph(
        [
            op("op0", 1.0, 1.0, [], ["x"]),
            op("op1", 2.0, 0.0, ["x"], [], writes=["x"]),
            op("op2", 4.0, 4.0, ["x"], ["y"]),
            op("op3", 1.0, 1.0, ["y"], ["z"]),
        ],
        [tensor("x", 100, ["op2"]), tensor("y", 50, ["op3"]), tensor("z", 10)],
    )


def test_a_rebuild_reruns_the_writers_and_costs_their_time():
    g = masked()
    x = g.tensor_index["x"]
    assert g.rerun_ops[x] == (0, 1) and g.writers[x] == (1,)
    p = plan(g, {"x": "recompute", "y": "keep"}, 10**6)
    sim = ss.simulate(g, p, LINK)
    assert sim.recompute_s == pytest.approx(3.0)
    assert sim.step_time_s == pytest.approx(g.ideal_step_time_s + 3.0)
    check = ss.validate(g, p, LINK)
    assert check.ok and check.step_time_s == pytest.approx(sim.step_time_s)


def test_a_writer_that_may_not_run_again_blocks_the_rebuild():
    g = graph(
        [
            op("op0", 1.0, 1.0, [], ["x"]),
            op("op1", 2.0, 0.0, ["x"], [], writes=["x"], recomputable=False),
            op("op2", 4.0, 4.0, ["x"], ["y"]),
        ],
        [tensor("x", 100, ["op2"]), tensor("y", 50)],
    )
    assert not g.can_recompute[g.tensor_index["x"]]
    assert "op1" in g.recompute_blocker(g.tensor_index["x"])
    with pytest.raises(ss.PlanError, match="op1"):
        ss.solve(g, 1.0, LINK, solver="heuristic", pins={"x": "recompute"})


def test_writes_travel_in_json_and_the_digest_and_are_checked():
    g = masked()
    again = ss.load_graph(g.to_json())
    assert again.ops[1].writes == ("x",) and again.digest == g.digest
    data = g.to_dict()
    del data["ops"][1]["writes"]
    assert ss.load_graph(data).digest != g.digest
    data["ops"][1]["writes"] = ["y"]  # op1 does not read y
    with pytest.raises(ss.GraphError, match="writes 'y' in place but does not read it"):
        ss.load_graph(data)


def test_the_planner_prices_the_writers():
    # at a budget that needs x gone after op2: swapping it is slow (100 B at 100 B/s = 1 s each
    # way, hidden only partly), rebuilding it costs op0 + op1 = 3 s; the exact planner's plan is
    # what the checker and the simulator say it is
    g = masked()
    budget = ss.keep_all_peak(g, LINK) - 10
    p = ss.solve(g, budget, LINK, solver="cpsat", work_s=5, time_limit_s=CAP, gap=0.0)
    check = ss.validate(g, p)
    assert check.ok and p.info.status == "optimal"
    assert check.step_time_s == pytest.approx(ss.simulate(g, p).step_time_s)


def _profiled_stale():
    """sigmoid reads y, then y is written in place (y * 2), then both are read: sigmoid run
    again in backward would read the doubled y."""
    torch = pytest.importorskip("torch")

    class ReadThenWritten(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            z = torch.sigmoid(y)
            y.mul_(2)
            return (z * y).sum()

    torch.manual_seed(0)
    model, x = ReadThenWritten(), torch.randn(4, 8)
    return model, x, ss.profile(model, x, lambda out: out, warmup=0, repeat=1)


def test_an_op_that_read_a_tensor_written_later_may_not_run_again():
    model, x, g = _profiled_stale()
    sig = next(i for i, o in enumerate(g.ops) if "sigmoid" in o.extra["aten"])
    assert not g.ops[sig].recomputable
    z = g.op_outputs[sig][0]
    assert g.is_saved[z] and not g.can_recompute[z]
    assert "sigmoid" in g.recompute_blocker(z)


def test_the_executor_refuses_a_rebuild_that_would_read_a_later_version():
    # the graph edited to let sigmoid run again (as a hand-written graph could): the executor
    # refuses the rebuild by name rather than give gradients from the doubled y
    from dataclasses import replace

    model, x, g = _profiled_stale()
    sig = next(i for i, o in enumerate(g.ops) if "sigmoid" in o.extra["aten"])
    ops = list(g.ops)
    ops[sig] = replace(ops[sig], recomputable=True)
    edited = replace(g, ops=tuple(ops))
    z = edited.tensors[edited.op_outputs[sig][0]].name
    decisions = {edited.tensors[t].name: "keep" for t in edited.saved}
    decisions[z] = "recompute"
    p = ss.complete(ss.Plan(edited.name, edited.digest, 10**9, decisions), edited, "cpu")
    with pytest.raises(RuntimeError, match="before it was written in place"):
        with ss.apply(p, model, graph=edited):
            model(x).backward()
