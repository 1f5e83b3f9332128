"""Profiling and planning change memory and nothing else: after ``ss.profile`` (and under
``ss.planned``, which profiles each new bucket with extra steps) every random stream a forward
draws from and every buffer or attribute it rebinds is what plain training gives; the default
treatment of parameter gradients is torch's."""

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import slackswap as ss  # noqa: E402


class Stateful(torch.nn.Module):
    """Draws from torch (dropout), numpy's global stream (a SpecAugment-style mask), Python's
    ``random`` (a layer's scale) and its own torch.Generator; rebinds a buffer (an EMA
    of its activations), counts its steps in a Python attribute and appends to a list."""

    def __init__(self, width=64):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.drop = torch.nn.Dropout(0.1)
        self.register_buffer("ema", torch.zeros(width))
        self.steps = 0
        self.seen: list[int] = []
        self.gen = torch.Generator().manual_seed(11)

    def forward(self, x):
        self.steps += 1
        self.seen.append(self.steps)
        h = torch.relu(self.a(x))
        mask = torch.from_numpy((np.random.rand(*h.shape) > 0.2).astype("float32"))
        h = h * mask
        # a draw from Python's random that scales the layer (a skip would change the route)
        h = self.drop(torch.tanh(self.b(h))) * (1.0 + 0.1 * random.random())
        noise = torch.rand(h.shape, generator=self.gen)
        h = h + 0.01 * noise
        self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        return h


def loss_fn(y):
    return y.square().mean()


def seed_everything(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def train(model, batches, step):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in batches:
        opt.zero_grad()
        step(x)
        opt.step()
    return state_of(model)


def state_of(model):
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "ema": model.ema.clone(),
        "steps": model.steps,
        "seen": list(model.seen),
        "gen": model.gen.get_state(),
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state()[1].copy(),
        "random": random.getstate(),
    }


def assert_same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert torch.equal(a["ema"], b["ema"])
    assert a["steps"] == b["steps"] and a["seen"] == b["seen"]
    assert torch.equal(a["gen"], b["gen"])
    assert torch.equal(a["torch"], b["torch"])
    assert (a["numpy"] == b["numpy"]).all()
    assert a["random"] == b["random"]


def batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(32, 64, generator=g) for _ in range(4)]


def plain_run():
    torch.manual_seed(0)
    model = Stateful()
    seed_everything(1)
    return model, train(model, batches(), lambda x: loss_fn(model(x)).backward())


def test_a_profile_puts_back_every_stream_buffer_and_attribute():
    model, expected = plain_run()
    torch.manual_seed(0)
    model = Stateful()
    ema, steps = model.ema, model.steps
    seed_everything(1)
    before = state_of(model)
    ss.profile(model, batches()[0], loss_fn, warmup=1, repeat=2)
    assert model.ema is ema and model.steps == steps and model.seen == []
    assert_same(state_of(model), before)
    assert_same(train(model, batches(), lambda x: loss_fn(model(x)).backward()), expected)


@pytest.mark.parametrize(
    "hardware", ["cpu", pytest.param("cpu-emulated-link", marks=pytest.mark.slow)]
)
def test_planned_training_is_plain_training_for_every_stream_and_attribute(hardware):
    """The loop profiles the bucket (extra forwards) and plans it; the steps that follow draw
    what plain training draws and end with its parameters, buffer and attributes."""
    model, expected = plain_run()
    torch.manual_seed(0)
    model = Stateful()
    seed_everything(1)
    with ss.planned(model, loss_fn, budget=0.95, hardware=hardware, refine_solver=None) as loop:
        got = train(model, batches(), loop.step)
        assert loop.last_plan is not None
    assert_same(got, expected)


def test_the_default_gradients_are_torchs():
    """torch's zero_grad() sets gradients to None: a profile made then counts them as made in
    the step; one made while a model holds gradients counts them as held. fit's command line
    and the API take the same default."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(8, 16)
    g = ss.profile(model, x, lambda y: y.sum(), warmup=0, repeat=1, overhead=False)
    assert g.extra["parameter_gradients"] == "made"
    model(x).sum().backward()
    g = ss.profile(model, x, lambda y: y.sum(), warmup=0, repeat=1, overhead=False)
    assert g.extra["parameter_gradients"] == "held"
    assert all(p.grad is not None for p in model.parameters())  # (left as they were)
    from slackswap.cli import build_parser

    assert (
        build_parser().parse_args(["fit", "gpt2", "--seq", "64", "--batch", "1"]).gradients
        == "auto"
    )


def test_planned_steps_with_torchs_zero_grad_stay_within_the_budget():
    """docs/training-loop.md's loop with torch's defaults (zero_grad() to None): the measured
    step is within 1% of the budget the plan states."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=256, d=128, layers=2, p=0.0)
    idx = torch.randint(0, 256, (4, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def lf(out):
        return out.logsumexp(-1).mean()

    with ss.planned(model, lf, budget=0.8, hardware="cpu", refine_solver=None) as loop:
        peaks = []
        for _ in range(3):
            opt.zero_grad()
            with ss.StepMeter(sample="ops") as meter:
                loop.step(idx)
            peaks.append(meter.peak_bytes)
            opt.step()
        budget = loop.last_plan.budget_bytes
    assert loop.last_plan.count("recompute") > 0
    assert max(peaks[1:]) <= budget * 1.01, (peaks, budget)


class FromNumpy(torch.nn.Module):
    """A tensor the model makes outside torch's ops (from numpy) right after it lets go of one
    it made with them: malloc may hand the new one both the freed storage's address and its
    object's."""

    def __init__(self, width=64):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        h = torch.relu(self.a(x))  # a's output is freed here
        mask = torch.from_numpy(np.ones(h.shape, dtype="float32"))
        return self.b(h * mask)


def test_a_tensor_made_outside_torchs_ops_never_takes_a_freed_tensors_name():
    """Every profile of one model names the same saved tensors; the mask, which no traced op
    made, is never among them (it once took the name of the Linear's freed output, and a plan
    made from one profile did not match the next step)."""
    torch.manual_seed(0)
    model, x = FromNumpy(), torch.randn(32, 64)
    names = set()
    for _ in range(8):
        graph = ss.profile(model, x, loss_fn, warmup=0, repeat=1, calibrate=False, overhead=False)
        names.add(tuple(graph.tensors[t].name for t in graph.saved))
    assert len(names) == 1, names
    assert "a#0" not in next(iter(names))


@pytest.mark.parametrize(
    "hardware", ["cpu", pytest.param("cpu-emulated-link", marks=pytest.mark.slow)]
)
def test_a_loop_under_autocast_plans_its_buckets_and_trains_as_plain(hardware):
    """Each step in its own autocast region (as HF Trainer's bf16 and Lightning's precision
    run it): the profile's forwards start without cached weight casts, as every real step
    does, so the bucket keeps its plan (no fall back to plain steps) and the gradients are
    plain training's, bit for bit."""
    from models import TinyGPT

    torch.manual_seed(0)
    plain, looped = TinyGPT(d=32, p=0.1), TinyGPT(d=32, p=0.1)
    looped.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 50, (4, 32), generator=g) for _ in range(3)]

    def loss_fn(out):
        return out.float().logsumexp(-1).mean()

    def run(step):
        torch.manual_seed(5)
        grads = []
        for x in xs:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                step(x)
            grads.append([p.grad.clone() for p in looped.parameters() if p.grad is not None])
        return grads

    def plain_step(x):
        looped.zero_grad(set_to_none=True)
        loss_fn(looped(x)).backward()

    expected = run(plain_step)
    looped.load_state_dict(plain.state_dict())
    with ss.planned(looped, loss_fn, 0.9, hardware=hardware, refine_solver=None) as loop:

        def planned_step(x):
            looped.zero_grad(set_to_none=True)
            loop.step(x)

        got = run(planned_step)
        assert [s.source for s in loop.switches] == ["heuristic"], loop.switches
        assert loop.plan_for(xs[0]) is not None
    for want, have in zip(expected, got):
        assert len(want) == len(have) and all(torch.equal(a, b) for a, b in zip(want, have))
