"""State the model owns is written once per step, whatever a plan recomputes: an op that writes
a buffer or an argument (batch norm's running statistics, a counter, a moving average the loss
keeps) is never rerun, however the module tree is laid out."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slackswap as ss

HW = "cpu-emulated-link"


class FunctionalBN(nn.Module):
    """Batch norm called through torch.nn.functional on buffers the module registers itself."""

    def __init__(self, c=8):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.weight = nn.Parameter(torch.ones(c))
        self.bias = nn.Parameter(torch.zeros(c))
        self.register_buffer("mean", torch.zeros(c))
        self.register_buffer("var", torch.ones(c))
        self.head = nn.Linear(c * 8 * 8, 4)

    def forward(self, x):
        y = torch.nn.functional.batch_norm(
            self.conv(x), self.mean, self.var, self.weight, self.bias, training=True, momentum=0.3
        )
        return self.head(torch.relu(y).flatten(1))


class Counter(nn.Module):
    """A buffer written in place by the model's own code, between two recomputable ops."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("seen", torch.zeros(16))

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        self.seen.mul_(0.9).add_(h.detach().mean(0))
        return torch.sin(h * self.seen)


def sequential_bn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8, momentum=None),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 4),
    ), torch.randn(4, 3, 8, 8)


def nested_bn():
    def block():
        return nn.ModuleDict({"conv": nn.Conv2d(8, 8, 3, padding=1), "norm": nn.BatchNorm2d(8)})

    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, padding=1)
            self.blocks = nn.ModuleList(block() for _ in range(2))
            self.head = nn.Linear(8 * 8 * 8, 4)

        def forward(self, x):
            x = self.stem(x)
            for b in self.blocks:
                x = x + torch.relu(b["norm"](b["conv"](x)))
            return self.head(x.flatten(1))

    return Nested(), torch.randn(4, 3, 8, 8)


LAYOUTS = {
    "sequential batch norm": sequential_bn,
    "nested blocks": nested_bn,
    "functional batch norm": lambda: (FunctionalBN(), torch.randn(4, 3, 8, 8)),
    "in-place counter": lambda: (Counter(), torch.randn(8, 16)),
}


def recompute_everything(graph):
    """Every saved tensor the graph lets be recomputed is: the plan most likely to rerun state."""
    decisions = {
        graph.tensors[int(t)].name: "recompute" if graph.can_recompute[t] else "keep"
        for t in graph.saved
    }
    return ss.complete(ss.Plan(graph.name, graph.digest, 10**12, decisions), graph, HW)


def state_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.slow
def test_a_plan_that_recomputes_all_it_may_leaves_state_as_plain_training(layout):
    torch.manual_seed(0)
    model, x = LAYOUTS[layout]()
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    graph = ss.profile(model, x, loss_fn)
    plain = copy.deepcopy(model)
    writers = [op for op in graph.ops if not op.recomputable]
    assert writers, "the ops that write state are found"
    plan = recompute_everything(graph)
    assert plan.count("recompute") > 0
    for step in range(2):
        loss_fn(plain(x)).backward()
        with ss.apply(plan, model, graph=graph):
            loss_fn(model(x)).backward()
        for k, v in state_of(plain).items():
            assert torch.equal(state_of(model)[k], v), (layout, step, k)
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad), (layout, step, name)


def test_a_buffer_the_schema_does_not_mark_is_found_by_its_values():
    """``native_batch_norm`` updates running_mean and running_var without an ``(a!)`` in its
    schema and without bumping their version counters: the profile marks it by comparing them
    before and after the op."""
    model, x = sequential_bn()
    graph = ss.profile(model, x, lambda out: out.square().mean())
    norms = [op for op in graph.ops if "native_batch_norm" in op.name]
    assert len(norms) == 2 and not any(op.recomputable for op in norms)
    convs = [op for op in graph.ops if "convolution" in op.name]
    assert all(op.recomputable for op in convs)
