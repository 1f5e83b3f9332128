"""What ``optimizer.step()`` allocates beside parameters, gradients and state, as torch's
optimizers allocate it (runtime/model_state.py), against the step measured after every op; fit
refuses a device the optimizer step does not fit."""

import pytest

torch = pytest.importorskip("torch")

import slackswap as ss  # noqa: E402
from slackswap.runtime.model_state import model_state  # noqa: E402


def model(dtype=torch.float32):
    """Parameters of 1 MiB (the largest), 256 KiB and small biases, float32: 1,575,936 bytes."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.Tanh(),
        torch.nn.Linear(1024, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 1024),
    ).to(dtype)


def optimizer_for(name, params, foreach):
    if name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        return cls(params, lr=1e-3, foreach=foreach)
    return torch.optim.SGD(
        params, lr=0.1, momentum=0.9 if name == "sgd-momentum" else 0.0, foreach=foreach
    )


def measured_step(net, opt):
    """The second step's peak (the first makes the state), sampled after every op."""
    x = torch.randn(8, 256, dtype=next(net.parameters()).dtype)
    for step in range(2):
        opt.zero_grad(set_to_none=False)
        net(x).float().square().mean().backward()
        if step == 0:
            opt.step()
    with ss.StepMeter(sample="ops") as meter:
        opt.step()
    return meter.peak_bytes


@pytest.mark.parametrize(
    "name, foreach",
    [
        ("adamw", True),
        ("adamw", False),
        ("adam", True),
        ("adam", False),
        ("sgd-momentum", True),
        ("sgd", False),
    ],
)
def test_the_optimizer_steps_temporaries_are_what_torch_allocates(name, foreach):
    net = model()
    state = model_state(net, name, foreach)
    params = 4 * sum(p.numel() for p in net.parameters())
    largest = 4 * 1024 * 256
    # foreach Adam: a sqrt of every exp_avg_sq at once; one at a time: sqrt and its division
    # of the largest parameter; SGD in place
    expected = {True: params, False: 2 * largest}[foreach] if name.startswith("adam") else 0
    assert state["optimizer_step_bytes"] == expected
    assert (
        state["optimizer_state_bytes"]
        == {"adamw": 2, "adam": 2, "sgd-momentum": 1}.get(name, 0) * params
    )
    measured = measured_step(net, optimizer_for(name, net.parameters(), foreach))
    # the heap's own bookkeeping and the small per-op scalars on top: within 2% and 16 KiB
    assert expected <= measured <= 1.02 * expected + 16 * 2**10, (measured, expected)


def test_bf16_parameters_get_bf16_moments():
    net = model(torch.bfloat16)
    params = 2 * sum(p.numel() for p in net.parameters())
    state = model_state(net, "adamw", True)
    assert state["optimizer_state_bytes"] == 2 * params  # exp_avg, exp_avg_sq: zeros_like
    opt = torch.optim.AdamW(net.parameters(), foreach=True)
    measured_step(net, opt)
    moments = sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for k, t in s.items()
        if k != "step"
    )
    assert moments == state["optimizer_state_bytes"]


def test_fit_refuses_a_device_the_optimizer_step_does_not_fit():
    """One sample: the activations are a few KiB, the foreach step's temporaries 1.5 MiB."""
    net = model()
    graph = ss.profile(
        net,
        torch.randn(1, 256),
        lambda y: y.square().mean(),
        warmup=0,
        repeat=1,
        optimizer="adamw",
        foreach=True,
        overhead=False,
    )
    state = graph.extra["model_state"]
    needs = state["total_bytes"] + state["optimizer_step_bytes"]
    report = ss.fit(graph, "cpu", memory_bytes=needs - 1, solver="heuristic")
    assert report.activation_memory_bytes >= report.keep_all_peak_bytes  # the step itself fits
    assert not report.fits and "the optimizer step needs" in report.verdict
    assert "optimizer step's temporaries (foreach)" in report.table()
    assert ss.fit(graph, "cpu", memory_bytes=needs, solver="heuristic").fits
