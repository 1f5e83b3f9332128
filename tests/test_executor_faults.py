"""The executor under faults: inputs changed in place, exceptions in the user's forward, no
garbage collector, a plan for another shape, and ops that update state (BatchNorm)."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from models import SkipCNN, build  # noqa: E402
from torch import nn  # noqa: E402

import slackswap as ss  # noqa: E402

CPU = ss.hardware("cpu-emulated-link")


def _plan(graph, decision, budget=None):
    """Every tensor that may take ``decision`` takes it (the others are kept), closed on cpu."""
    decisions = {}
    for t in graph.saved:
        d = decision if decision != "recompute" or graph.can_recompute[t] else "keep"
        decisions[graph.tensors[t].name] = d
    for members in graph.rng_groups.values():
        if len({decisions[graph.tensors[m].name] for m in members}) > 1:
            for m in members:
                decisions[graph.tensors[m].name] = "keep"
    plan = ss.Plan(graph.name, graph.digest, budget or 10**12, decisions)
    return ss.complete(plan, graph, CPU)


def _grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def test_an_input_modified_in_place_before_backward_raises_when_a_rerun_reads_it():
    model, x, loss_fn = build("mlp")
    graph = ss.profile(model, x, loss_fn, warmup=0, repeat=1)
    plan = _plan(graph, "recompute")
    assert plan.count("recompute") > 0
    batch = x.clone()
    with ss.apply(plan, model, graph=graph):
        loss = loss_fn(model(batch))
        batch.mul_(2.0)  # the batch a recomputed op reads changes under it
        with pytest.raises(RuntimeError, match="modified in place"):
            loss.backward()
    # untouched, the same plan trains with plain gradients
    model.zero_grad()
    loss_fn(model(x)).backward()
    plain = _grads(model)
    model.zero_grad()
    with ss.apply(plan, model, graph=graph):
        loss_fn(model(x)).backward()
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(model)))


class WritesSaved(nn.Module):
    """A model that, when told to, writes in place (outside autograd) a kept activation and a
    buffer after autograd saved them: the step's ops and saves stay the same, so the executor
    sees the step it checked, and plain training refuses the backward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8))
        self.write_activation = False
        self.write_buffer = False

    def forward(self, x):
        h = self.a(x)
        y = h.sin() * self.scale  # saves h (sin) and the buffer (mul)
        with torch.no_grad():
            if self.write_activation:
                h.mul_(2.0)
            if self.write_buffer:
                self.scale.add_(1.0)
        return self.b(y) + h


@pytest.mark.parametrize("written", ["write_activation", "write_buffer"])
def test_a_saved_tensor_the_plan_does_not_act_on_written_in_place_is_refused_like_plain(written):
    torch.manual_seed(0)
    model, x = WritesSaved(), torch.randn(4, 8)

    def loss_fn(out):
        return out.pow(2).sum()

    setattr(model, written, True)
    with pytest.raises(RuntimeError, match="modified in place after it was saved"):
        ss.profile(model, x, loss_fn, warmup=0, repeat=1)  # a profile of it is refused too
    setattr(model, written, False)
    model.scale.fill_(1.0)
    graph = ss.profile(model, x, loss_fn, warmup=0, repeat=1)
    decisions = {graph.tensors[t].name: "keep" for t in graph.saved}
    # one tensor swapped (b's input, read by b's backward): later steps run on hooks alone, and
    # the activation h (read by the sine's backward) and the buffer are saves the plan does not
    # act on
    (moved,) = [
        graph.tensors[t].name for t in graph.saved if "b/addmm#1" in graph.tensors[t].saved_for
    ]
    decisions[moved] = "swap"
    assert decisions["a#0"] == "keep"
    plan = ss.complete(ss.Plan(graph.name, graph.digest, 10**12, decisions), graph, CPU)
    setattr(model, written, True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss_fn(model(x)).backward()  # plain training refuses it
    setattr(model, written, False)
    model.scale.fill_(1.0)
    for first in (True, False):  # the checked first step, then a step of hooks alone
        with ss.apply(plan, model, graph=graph) as run:
            if not first:
                for _ in range(2):
                    model.zero_grad()
                    loss_fn(model(x)).backward()
                assert run.stats.hooked_steps >= 1
            setattr(model, written, True)
            loss = loss_fn(model(x))
            setattr(model, written, False)
            with pytest.raises(RuntimeError, match="modified in place after it was saved"):
                loss.backward()
        model.scale.fill_(1.0)


class Flaky(nn.Module):
    """A model whose inner block raises when told to."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 2)
        self.fail = False

    def forward(self, x):
        h = self.inner(x)
        if self.fail:
            raise ValueError("user's own error")
        return self.head(h)


@pytest.mark.parametrize("with_graph", [False, True])
@pytest.mark.slow
def test_the_users_exception_surfaces_unchanged_and_training_goes_on(with_graph):
    torch.manual_seed(0)
    model, x = Flaky(), torch.randn(4, 8)

    def loss_fn(out):
        return out.pow(2).mean()

    graph = ss.profile(model, x, loss_fn, warmup=0, repeat=1)
    plan = _plan(graph, "recompute")
    model.zero_grad()
    loss_fn(model(x)).backward()
    plain = _grads(model)
    run = ss.apply(plan, model, graph=graph if with_graph else None)
    with pytest.raises(ValueError, match="user's own error") as caught:
        with run:
            model.fail = True
            model(x)
    assert type(caught.value) is ValueError
    model.fail = False
    with run:  # the same context trains on, inside and across `with` blocks
        model.fail = True
        with pytest.raises(ValueError, match="user's own error"):
            model(x)
        model.fail = False
        model.zero_grad()
        loss_fn(model(x)).backward()
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(model)))


def test_host_pool_stays_flat_over_200_steps_without_the_garbage_collector():
    model, x, loss_fn = build("mlp")
    graph = ss.profile(model, x, loss_fn, warmup=0, repeat=1)
    plan = _plan(graph, "swap")
    enabled = gc.isenabled()
    gc.disable()
    try:
        with ss.apply(plan, model, graph=graph) as run:
            sizes = []
            for _ in range(200):
                model.zero_grad(set_to_none=True)
                loss_fn(model(x)).backward()
                sizes.append(run.pool.nbytes)
        assert sizes[-1] == sizes[0] > 0
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("with_graph", [False, True])
@pytest.mark.slow
def test_a_plan_for_another_batch_size_is_refused_naming_what_differs(with_graph):
    model, x, loss_fn = build("mlp")
    graph = ss.profile(model, x, loss_fn, warmup=0, repeat=1)
    plan = ss.load_plan(_plan(graph, "keep").to_json())  # the bytes travel with the plan
    bigger = torch.randn(2 * x.shape[0], x.shape[1])
    with pytest.raises(ss.PlanError, match=r"bytes here but the plan was made for \d+ bytes"):
        with ss.apply(plan, model, graph=graph if with_graph else None):
            loss_fn(model(bigger)).backward()


def test_batchnorm_state_is_updated_once_per_step():
    """The op that updates BatchNorm's running statistics is never run twice: the profiler
    marks it not recomputable, and buffers and gradients match plain training over 3 steps."""
    torch.manual_seed(0)
    model, x = SkipCNN().train(), torch.randn(2, 3, 8, 8)

    def loss_fn(out):
        return out.pow(2).mean()

    graph = ss.profile(model, x, loss_fn, warmup=0, repeat=1)
    stateful = [op for op in graph.ops if "batch_norm" in str(op.extra.get("aten", ""))]
    assert stateful and not any(op.recomputable for op in stateful)
    plan = _plan(graph, "recompute")
    assert plan.count("recompute") > 0
    twin = SkipCNN().train()
    twin.load_state_dict(model.state_dict())
    for _ in range(3):
        twin.zero_grad()
        loss_fn(twin(x)).backward()
        model.zero_grad()
        with ss.apply(plan, model, graph=graph):
            loss_fn(model(x)).backward()
        for (name, a), b in zip(model.named_buffers(), twin.buffers()):
            assert torch.equal(a, b), name
        assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(twin)))


def test_recompute_time_counts_each_second_once():
    """Rebuild chains rebuild nested tensors first: the time is counted once, so it stays below
    the steps' own time."""
    import time

    model, x, loss_fn = build("mlp")
    graph = ss.profile(model, x, loss_fn, warmup=0, repeat=1)
    plan = _plan(graph, "recompute")
    assert plan.count("recompute") >= 2
    backward = 0.0  # rebuilds run inside backward: their time is part of it, counted once
    with ss.apply(plan, model, graph=graph) as run:
        for _ in range(5):
            model.zero_grad()
            loss = loss_fn(model(x))
            start = time.perf_counter()
            loss.backward()
            backward += time.perf_counter() - start
    assert 0 < run.stats.recompute_s < backward
