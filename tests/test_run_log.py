"""The executor's log: on CPU (the cpu-emulated-link preset) every step records where it
released, prefetched and rebuilt each tensor, and that schedule is the plan's own, position for
position; replayed through the simulator it is the plan's step."""

import gc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from models import profiled  # noqa: E402

import slackswap as ss  # noqa: E402

HF = pytest.mark.skipif(
    __import__("importlib").util.find_spec("transformers") is None, reason="transformers"
)
MODELS = [
    "gpt",
    "cnn",
    pytest.param("hf-gpt2", marks=HF),
    pytest.param("hf-bert", marks=HF),
    pytest.param("hf-llama", marks=HF),
]
setup = profiled  # one profile per model for the whole process


def random_plan(graph, choices):
    """A valid plan from one choice per saved tensor: recompute only where the graph can
    rebuild, an RNG group recomputed all together or not at all."""
    decisions = {}
    for t, c in zip(graph.saved, choices):
        if c == "recompute" and not graph.can_recompute[t]:
            c = "swap"
        decisions[graph.tensors[t].name] = c
    for members in graph.rng_groups.values():
        names = [graph.tensors[m].name for m in members]
        if any(decisions[n] == "recompute" for n in names) and not all(
            decisions[n] == "recompute" for n in names
        ):
            for n in names:
                if decisions[n] == "recompute":
                    decisions[n] = "swap"
    return ss.complete(
        ss.Plan(graph.name, graph.digest, 10**12, decisions), graph, "cpu-emulated-link"
    )


def call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def dead_positions(graph):
    """Backward positions whose node never ran when profiled (off the loss's path, a pooler
    whose output the loss does not read): the executor cannot act there."""
    n = graph.n_ops
    return {
        2 * n - 1 - i for i, o in enumerate(graph.ops) if o.extra.get("backward_ran", True) is False
    }


def unread(graph, plan, decision):
    """Tensors of ``decision`` no backward node reads: never rebuilt nor waited for."""
    index = {o.name: o for o in graph.ops}
    return {
        name
        for name, d in plan.decisions.items()
        if d == decision
        and all(
            index[r].extra.get("backward_ran", True) is False
            for r in graph.tensors[graph.tensor_index[name]].saved_for
        )
    }


def assert_same_positions(logged, planned, dead):
    """Equal, except that an event the plan puts at a dead position happens at the first live
    position after it (nothing runs in between)."""
    assert set(logged) == set(planned)
    for name, q in planned.items():
        if q in dead:
            assert logged[name] >= q and all(p in dead for p in range(q, logged[name])), name
        else:
            assert logged[name] == q, (name, logged[name], q)


@pytest.mark.parametrize("name", MODELS)
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_logged_schedule_is_the_plans(name, data):
    model, inputs, loss_fn, graph = setup(name)
    choices = data.draw(
        st.lists(
            st.sampled_from(["keep", "swap", "recompute"]),
            min_size=len(graph.saved),
            max_size=len(graph.saved),
        )
    )
    plan = random_plan(graph, choices)
    torch.manual_seed(3)
    model.zero_grad(set_to_none=True)
    loss_fn(call(model, inputs)).backward()
    reference = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    torch.manual_seed(3)
    model.zero_grad(set_to_none=True)
    with ss.apply(plan, model, graph=graph) as run:
        loss_fn(call(model, inputs)).backward()
    for a, p in zip(reference, model.parameters()):
        assert (a is None and p.grad is None) or torch.equal(a, p.grad)
    logged, planned = run.log.schedule, plan.schedule
    dead = dead_positions(graph)
    assert_same_positions(dict(logged.d2h_free), dict(planned.d2h_free), dead)
    assert_same_positions(dict(logged.h2d_issue), dict(planned.h2d_issue), dead)
    skipped = unread(graph, plan, "recompute")
    assert_same_positions(
        dict(logged.recompute_at),
        {k: v for k, v in planned.recompute_at.items() if k not in skipped},
        dead,
    )
    # every swap: offloaded in forward, released, prefetched, then waited on, in that order
    events = run.log.events
    never_read = unread(graph, plan, "swap")
    for name in plan.tensors("swap"):
        kinds = [k for k, t, _ in events if t == name]
        expected = ["offload", "release", "prefetch"] + ([] if name in never_read else ["wait"])
        assert kinds == expected, (name, kinds)
        where = {k: p for k, t, p in events if t == name}
        assert where["offload"] <= where["release"] < where["prefetch"] <= where.get("wait", 1e9)
    if not skipped and not dead:
        replayed = run.log.replay(graph, plan)
        simulated = ss.simulate(graph, plan)
        assert replayed.step_time_s == simulated.step_time_s
        assert replayed.peak_bytes == simulated.peak_bytes
        np.testing.assert_array_equal(replayed.compute_intervals, simulated.compute_intervals)
        np.testing.assert_array_equal(replayed.h2d_intervals, simulated.h2d_intervals)


def test_a_solved_plan_runs_on_its_schedule():
    model, inputs, loss_fn, graph = setup("gpt")
    plan = ss.solve(graph, 0.5, "cpu-emulated-link", solver="heuristic")
    assert plan.count("swap") + plan.count("recompute") > 0
    with ss.apply(plan, model, graph=graph) as run:
        loss_fn(call(model, inputs)).backward()
    model.zero_grad(set_to_none=True)
    assert dict(run.log.schedule.d2h_free) == dict(plan.schedule.d2h_free)
    assert dict(run.log.schedule.h2d_issue) == dict(plan.schedule.h2d_issue)
    assert dict(run.log.schedule.recompute_at) == dict(plan.schedule.recompute_at)
    assert set(run.log.to_dict()) == {"events", "schedule"}


@pytest.mark.slow
def test_a_context_per_step_allocates_no_host_memory_after_the_first():
    model, inputs, loss_fn, graph = setup("gpt")
    plan = random_plan(graph, ["swap", "recompute", "keep"] * len(graph.saved))
    collecting = gc.isenabled()
    gc.disable()  # no cyclic collector: what a step holds must go when its graph goes
    try:
        pools = []
        for _ in range(200):
            model.zero_grad(set_to_none=True)
            with ss.apply(plan, model, graph=graph) as run:
                loss_fn(call(model, inputs)).backward()
            pools.append(run.stats.host_pool_bytes)
    finally:
        if collecting:
            gc.enable()
    assert pools[0] > 0 and len(set(pools)) == 1


def test_plans_for_one_graph_share_one_host_pool():
    """The loop runs the heuristic's plan, then a refined one: the second allocates host memory
    only for tensors the first did not swap, and alternating them afterwards allocates none."""
    model, inputs, loss_fn, graph = setup("gpt")
    first = random_plan(graph, ["swap", "keep", "keep"] * len(graph.saved))
    second = random_plan(graph, ["keep", "swap", "swap"] * len(graph.saved))
    sizes = {n: graph.tensors[graph.tensor_index[n]].bytes for n in graph.tensor_index}
    union = sum(sizes[n] for n in set(first.tensors("swap")) | set(second.tensors("swap")))
    from slackswap.runtime import pool

    pool.POOLS.clear()
    totals = []
    for plan in (first, second, first, second, first):
        model.zero_grad(set_to_none=True)
        with ss.apply(plan, model, graph=graph) as run:
            loss_fn(call(model, inputs)).backward()
        totals.append(run.stats.host_pool_bytes)
    assert totals[0] == sum(sizes[n] for n in first.tensors("swap"))
    assert totals[1:] == [union] * 4


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mix", [("swap", "keep"), ("recompute", "keep", "swap")])
def test_later_steps_of_a_context_are_skimmed_on_the_same_schedule(name, mix):
    """The first step of a context is traced and checked; the next ones (same input shapes)
    count positions, name saved tensors by the first's order of saves and, where the plan
    rebuilds, record each recipe op's arguments by the first's names for them; they still act
    at the plan's positions, rebuild with the same RNG draws and give the plain step's
    gradients."""
    model, inputs, loss_fn, graph = setup(name)
    plan = random_plan(graph, list(mix) * len(graph.saved))
    assert plan.count("swap") > 0
    assert (plan.count("recompute") > 0) == ("recompute" in mix)
    skipped = unread(graph, plan, "recompute")
    torch.manual_seed(5)
    model.zero_grad(set_to_none=True)
    loss_fn(call(model, inputs)).backward()
    reference = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    dead = dead_positions(graph)
    with ss.apply(plan, model, graph=graph) as run:
        for step in range(3):
            torch.manual_seed(5)
            model.zero_grad(set_to_none=True)
            loss_fn(call(model, inputs)).backward()
            for a, p in zip(reference, model.parameters()):
                assert (a is None and p.grad is None) or torch.equal(a, p.grad), step
            logged, planned = run.log.schedule, plan.schedule
            assert_same_positions(dict(logged.d2h_free), dict(planned.d2h_free), dead)
            assert_same_positions(dict(logged.h2d_issue), dict(planned.h2d_issue), dead)
            assert_same_positions(
                dict(logged.recompute_at),
                {k: v for k, v in planned.recompute_at.items() if k not in skipped},
                dead,
            )
    assert run.stats.skimmed_steps == 2
    model.zero_grad(set_to_none=True)


def test_a_skimmed_step_that_leaves_the_checked_one_is_refused_by_name():
    """A forward that depends on its data (here: one more op on odd calls) cannot be named by
    the checked step's order of saves: refused, never run on wrong names."""

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            h = torch.tanh(self.a(x))
            if self.calls % 2 == 0:
                h = h * 2
            return torch.sigmoid(self.b(h))

    model, x = Branchy(), torch.randn(32, 64)
    graph = ss.profile(model, x, lambda y: y.sum(), warmup=0, repeat=1, calibrate=False)
    model.calls = 0  # the next call is odd, as the profiled one was
    plan = ss.complete(
        ss.Plan(
            graph.name, graph.digest, 10**12, {graph.tensors[t].name: "swap" for t in graph.saved}
        ),
        graph,
        "cpu-emulated-link",
    )
    with ss.apply(plan, model, graph=graph):
        model(x).sum().backward()  # call 1 (odd, as profiled): traced, checked
        with pytest.raises(ss.PlanError, match="depends on its data"):
            model(x).sum().backward()


def test_a_step_of_hooks_alone_runs_from_its_checked_steps_tables():
    """A later step of a plan that rebuilds nothing runs from tables laid out once per checked
    step (runtime/hooked_step.py): save k is a plain position where the plan does not act on it
    (autograd holds the tensor itself) and the save's name, decision and d2h_free where it does;
    the prefetches in the plan's order. Two steps run from the same tables, each saving exactly
    the checked step's saves, on the plan's schedule, with plain training's gradients."""
    model, inputs, loss_fn, graph = setup("gpt")
    plan = random_plan(graph, ["swap", "keep"] * len(graph.saved))
    torch.manual_seed(3)
    model.zero_grad(set_to_none=True)
    loss_fn(call(model, inputs)).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    programs = []
    with ss.apply(plan, model, graph=graph) as run:
        for _ in range(3):
            torch.manual_seed(3)
            model.zero_grad(set_to_none=True)
            loss_fn(call(model, inputs)).backward()
            step = run.current_step
            assert all(torch.equal(a, p.grad) for a, p in zip(reference, model.parameters()))
            if step.kind == "hooked":
                programs.append(step.program)
                assert step.pack_index == len(step.program.entries)
                assert dict(run.log.schedule.d2h_free) == dict(plan.schedule.d2h_free)
                assert dict(run.log.schedule.h2d_issue) == dict(plan.schedule.h2d_issue)
    assert len(programs) == 2 and programs[0] is programs[1]
    program, swapped = programs[0], set(plan.tensors("swap"))
    acted = [e for e in program.entries if not isinstance(e, int)]
    # every swapped tensor's save is acted on (a kept one only where its unpack is the only
    # hook at a position where the plan acts)
    assert {e[1] for e in acted if e[4] == "swap"} == swapped
    for position, name, _, _, decision, free, _ in acted:
        assert 0 <= position < graph.n_ops and decision == plan.decisions[name]
        assert free == (plan.schedule.d2h_free[name] if decision == "swap" else None)
    issued = [q for q, _ in program.issues]
    assert issued == sorted(issued)
    assert {n for _, names in program.issues for n in names} == set(plan.schedule.h2d_issue)
    model.zero_grad(set_to_none=True)
