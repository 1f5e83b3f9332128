"""Planning inside the training loop: plans per shape bucket, switches only between steps,
gradients bit-identical to plain training throughout."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from models import TinyGPT  # noqa: E402

import slackswap as ss  # noqa: E402
from slackswap.loop import bucket_of  # noqa: E402


def loss_fn(out):
    return out.logsumexp(-1).mean()


def batches():
    g = torch.Generator().manual_seed(3)
    # two sequence lengths in different buckets (24 -> 32, 48 -> 64), and 20 -> 32 again
    lengths = [24, 48, 24, 48, 20, 24, 48]
    return [torch.randint(0, 50, (4, n), generator=g) for n in lengths]


def train(model, data, loop=None, join_after=None):
    """SGD steps; the gradients of each step, cloned."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for i, x in enumerate(data):
        torch.manual_seed(100 + i)
        opt.zero_grad(set_to_none=True)
        if loop is None:
            loss_fn(model(x)).backward()
        else:
            loop.step(x)
            if join_after == i:
                loop.join()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


def test_bucket_rule():
    shapes = (((4, 24), "torch.int64"),)
    assert bucket_of(shapes) == (((4, 32), "torch.int64"),)
    assert bucket_of((((3, 65, 1), "f"),)) == (((4, 128, 1), "f"),)


@pytest.mark.slow
def test_the_loop_plans_per_bucket_switches_between_steps_and_keeps_gradients():
    torch.manual_seed(0)
    plain_model = TinyGPT(vocab=50, d=32, layers=3, p=0.1)
    planned_model = TinyGPT(vocab=50, d=32, layers=3, p=0.1)
    planned_model.load_state_dict(plain_model.state_dict())
    data = batches()
    plain = train(plain_model, data)
    with ss.planned(planned_model, loss_fn, 0.6, refine_time_limit_s=10) as loop:
        grads = train(planned_model, data, loop, join_after=1)
        peaks = loop.last_stats.peak_activation_bytes
    for step, (a, b) in enumerate(zip(plain, grads)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step} differs"
    # two buckets, planned by the heuristic at their first step; the 20-token batch (bucket 32,
    # dominated by 24) reuses the 24-token plan
    first = [s for s in loop.switches if s.source == "heuristic"]
    assert [s.step for s in first] == [0, 1] and len(loop._buckets) == 2
    # refinements arrive at step boundaries only: after the join at step 1, steps 2 and 3 are
    # the first steps of each bucket that can adopt them
    refined = [s for s in loop.switches if s.source != "heuristic"]
    assert refined, "the exact plans were no better than the heuristic's: nothing was switched"
    for s in refined:
        assert s.step in (2, 3) and s.source == "cpsat"
    for x in data[:2]:
        plan = loop.plan_for(x)
        assert plan.count("swap") == 0  # a CPU device: keep and recompute only
        assert plan.info.predicted_step_time_s <= next(
            s.predicted_step_time_s for s in first if s.bucket == bucket_of(((tuple(x.shape),
                                                                              str(x.dtype)),)))
    assert 0 < peaks


def test_a_larger_shape_in_a_bucket_is_planned_again():
    torch.manual_seed(0)
    model = TinyGPT(vocab=50, d=32, layers=2, p=0.0)
    with ss.planned(model, loss_fn, 0.7, refine_solver=None) as loop:
        loop.step(torch.randint(0, 50, (2, 20)))
        loop.step(torch.randint(0, 50, (2, 30)))  # same bucket (32), larger: planned again
        loop.step(torch.randint(0, 50, (2, 17)))  # dominated by 30: reused
    assert [s.step for s in loop.switches] == [0, 1]
    with pytest.raises(ValueError, match="max_plans"):
        ss.planned(model, loss_fn, 0.5, max_plans=0)


def test_profiling_a_new_bucket_leaves_batch_norm_statistics_and_gradients_alone():
    """Profiling runs real steps: the running statistics, accumulated gradients and RNG are put
    back, so a loop with gradient accumulation over two image sizes trains like plain code."""
    from models import SkipCNN

    torch.manual_seed(0)
    plain, looped = SkipCNN(), SkipCNN()
    looped.load_state_dict(plain.state_dict())
    images = [torch.randn(4, 3, 16, 16), torch.randn(4, 3, 32, 32), torch.randn(4, 3, 16, 16)]

    def ce(out):
        return out.logsumexp(-1).mean()

    for x in images:  # gradients accumulate over all three
        ce(plain(x)).backward()
    with ss.planned(looped, ce, 0.9, refine_solver=None) as loop:
        for x in images:
            loop.step(x)
    for (name, a), b in zip(plain.state_dict().items(), looped.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(plain.parameters(), looped.parameters()):
        assert torch.equal(p.grad, q.grad)
