"""A later step of a context saves what the checked step saved, tensor for tensor: a branch on the
data that keeps every op, position and shape but saves another tensor is refused by name (under
``ss.apply``) or profiled again (under ``ss.planned``), never run on the wrong tensor."""

import pytest

torch = pytest.importorskip("torch")

import slackswap as ss  # noqa: E402


class Chooser(torch.nn.Module):
    """``y = h * c(x)`` with ``h`` one of two tensors of one shape, chosen by the data: the ops,
    their order and shapes are the same either way, the tensor the product saves is not."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(256, 256) for _ in range(3))

    def forward(self, x):
        h1 = torch.tanh(self.a(x))
        h2 = torch.sigmoid(self.b(x))
        h = h1 if bool(x[0, 0] > 0) else h2
        return h * self.c(x)


def loss_fn(y):
    return y.square().mean()


def setup(seed=0):
    torch.manual_seed(seed)
    model = Chooser()
    x = torch.randn(512, 256)
    x[0, 0] = 1.0  # the branch the profile takes: h1
    other = x.clone()
    other[0, 0] = -1.0  # the other branch: h2, same shapes and ops
    graph = ss.profile(model, x, loss_fn, warmup=0, repeat=1, calibrate=False)
    return model, x, other, graph


def plan_of(graph, decision):
    decisions = {}
    for t in graph.saved:
        d = decision if (decision != "recompute" or graph.can_recompute[t]) else "keep"
        decisions[graph.tensors[t].name] = d
    return ss.complete(
        ss.Plan(graph.name, graph.digest, 10**12, decisions), graph, "cpu-emulated-link"
    )


def plain_grads(model, x):
    model.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("decision", ["swap", "recompute"])
def test_another_tensor_saved_at_the_same_place_is_refused_by_name(decision):
    model, x, other, graph = setup()
    plan = plan_of(graph, decision)
    assert plan.count(decision) > 0
    with ss.apply(plan, model, graph=graph) as run:
        for _ in range(2):  # checked, then a later step of the same branch
            model.zero_grad(set_to_none=True)
            loss_fn(model(x)).backward()
        kind = run.current_step.kind
        model.zero_grad(set_to_none=True)
        with pytest.raises(ss.PlanError, match="not the tensor the checked step"):
            loss_fn(model(other)).backward()
    # a plan that rebuilds nothing runs its later steps with hooks alone, one that rebuilds
    # counts positions: both check what each save is
    assert kind == ("hooked" if decision == "swap" else "skimmed")


@pytest.mark.parametrize("decision", ["swap", pytest.param("recompute", marks=pytest.mark.slow)])
def test_the_loop_profiles_the_other_branch_and_gradients_are_plain_trainings(decision):
    model, x, other, graph = setup()
    expected = [plain_grads(model, batch) for batch in (x, x, other, other, x)]
    hw = "cpu-emulated-link" if decision == "swap" else "cpu"
    with ss.planned(model, loss_fn, budget=0.92, hardware=hw, refine_solver=None) as loop:
        for batch, want in zip((x, x, other, other, x), expected):
            model.zero_grad(set_to_none=True)
            loop.step(batch)
            assert loop.last_plan.count(decision) > 0
            got = [p.grad for p in model.parameters()]
            assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(want, got))
