"""Planning inside the training loop: plans per shape bucket, switches only between steps,
gradients bit-identical to plain training throughout."""

from __future__ import annotations

import time

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
            s.predicted_step_time_s
            for s in first
            if s.bucket == bucket_of(((tuple(x.shape), str(x.dtype)),))
        )
    assert 0 < peaks


@pytest.mark.slow
def test_a_larger_shape_in_a_bucket_is_planned_again():
    torch.manual_seed(0)
    model = TinyGPT(vocab=50, d=32, layers=2, p=0.0)
    with ss.planned(model, loss_fn, 0.9, refine_solver=None) as loop:
        loop.step(torch.randint(0, 50, (2, 20)))
        loop.step(torch.randint(0, 50, (2, 30)))  # same bucket (32), larger: planned again
        loop.step(torch.randint(0, 50, (2, 17)))  # dominated by 30: reused
    assert [s.step for s in loop.switches] == [0, 1]
    with pytest.raises(ValueError, match="max_plans"):
        ss.planned(model, loss_fn, 0.5, max_plans=0)


@pytest.mark.slow
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


@pytest.mark.slow
def test_parameters_the_loss_function_holds_get_plain_gradients():
    """A head and a temperature outside the model: profiling steps added their gradients in
    (3x the plain gradient after the first step) before every leaf backward reaches was put
    back."""
    torch.manual_seed(0)
    plain_model = TinyGPT(vocab=50, d=32, layers=2, p=0.0)
    looped_model = TinyGPT(vocab=50, d=32, layers=2, p=0.0)
    looped_model.load_state_dict(plain_model.state_dict())
    heads = [torch.nn.Linear(50, 7) for _ in range(2)]
    heads[1].load_state_dict(heads[0].state_dict())
    temps = [torch.nn.Parameter(torch.tensor(2.0)) for _ in range(2)]

    def loss_of(i):
        return lambda out: (heads[i](out) / temps[i]).logsumexp(-1).mean()

    data = batches()[:4]
    for x in data:
        loss_of(0)(plain_model(x)).backward()
    with ss.planned(looped_model, loss_of(1), 0.8, refine_solver=None) as loop:
        for x in data:
            loop.step(x)
    for a, b in zip(
        [*plain_model.parameters(), *heads[0].parameters(), temps[0]],
        [*looped_model.parameters(), *heads[1].parameters(), temps[1]],
    ):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.slow
def test_the_step_signature_changes_the_bucket_not_the_error():
    """train/eval, unfreezing, another dtype and a non-tensor argument each change the traced
    step: each gets its own plan instead of PlanError on every later step."""

    class Flagged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = TinyGPT(vocab=50, d=32, layers=2, p=0.1)

        def forward(self, x, scale=1.0):
            out = self.gpt(x)
            return out * scale if scale != 1.0 else out

    torch.manual_seed(0)
    model = Flagged()
    x = torch.randint(0, 50, (2, 16))
    with ss.planned(model, loss_fn, 0.8, refine_solver=None) as loop:
        loop.step((x,))
        model.eval()
        loop.step((x,))
        model.train()
        for p in model.gpt.blocks[0].parameters():
            p.requires_grad_(False)
        loop.step((x,))
        for p in model.parameters():
            p.requires_grad_(True)
        loop.step((x, 2.0))
        model.double()
        loop.step((x, 2.0))
        loop.step((x,))  # back to float... but the model is double now: its own bucket again
    assert len(loop._buckets) == 6
    assert [s.source for s in loop.switches] == ["heuristic"] * 6


class TopOne(torch.nn.Module):
    """A hand-written top-1 mixture of experts: which expert runs depends on the data."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(16, 2)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
            for _ in range(2)
        )

    def forward(self, x):
        choice = int(self.router(x).mean(0).argmax())
        return self.experts[choice](x)


@pytest.mark.slow
def test_data_dependent_routing_is_said_once_and_trains_as_plain():
    torch.manual_seed(0)
    plain, looped = TopOne(), TopOne()
    looped.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(256, 16, generator=g) + (3 if i % 2 else -3) for i in range(8)]

    def mse(out):
        return out.square().mean()

    for x in data:
        mse(plain(x)).backward()
    with pytest.warns(RuntimeWarning, match="depends on the data|differs from batch") as caught:
        with ss.planned(looped, mse, 0.8, refine_solver=None) as loop:
            for x in data:
                loop.step(x)
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert any(s.source == "plain" for s in loop.switches)
    assert all(p.grad is not None for p in plain.experts.parameters())  # both experts ran
    for p, q in zip(plain.experts.parameters(), looped.experts.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert looped.router.weight.grad is None  # argmax: no gradient, as in plain training


def test_the_users_own_exception_arrives_unchanged_on_a_profiled_step():
    model = TinyGPT(vocab=50, d=32, layers=2, p=0.0)

    class Mine(Exception):
        pass

    def failing(out):
        raise Mine("my loss failed")

    with ss.planned(model, failing, 0.8, refine_solver=None) as loop:
        with pytest.raises(Mine, match="my loss failed"):
            loop.step(torch.randint(0, 50, (2, 16)))


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="/proc")
@pytest.mark.slow
def test_refinements_end_with_the_loop_and_with_their_bucket():
    torch.manual_seed(0)
    model = TinyGPT(vocab=50, d=32, layers=2, p=0.0)
    with ss.planned(model, loss_fn, 0.9, refine_time_limit_s=120, max_plans=1) as loop:
        loop.step(torch.randint(0, 50, (2, 16)))
        first = loop._refinements.running
        assert first is not None and _alive(first.proc.pid)
        loop.step(torch.randint(0, 50, (2, 64)))  # a second bucket: the first one is dropped
        assert first.proc.poll() is not None  # its refinement was killed, not left queued
        second = loop._refinements.running
        assert second is not None and second.key != first.key
    assert second.proc.poll() is not None and not _alive(second.proc.pid)
    assert loop._refinements is None


@pytest.mark.slow
@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="/proc")
def test_a_profile_taken_while_a_refinement_runs_is_not_slowed_by_it():
    """The refinement (a CP-SAT search on GPT-2 XL's graph, with its relaxations' children) is
    stopped, its whole process tree, while the loop profiles, from before the profile to after
    it, and goes on afterwards: nothing of it runs beside the profile. (Said by the processes'
    states, not by comparing profile times, which any other load on the machine moves.)"""
    from slackswap.refinements import Refinements, process_tree

    torch.manual_seed(0)
    model = TinyGPT(vocab=512, d=256, layers=2, p=0.0)
    x = torch.randint(0, 512, (8, 128))
    hw = ss.hardware("a100-80gb-pcie4")
    g = ss.workload("gpt2-xl", hw)
    refinements = Refinements("cpsat", 300.0)

    def states(root: int) -> set[str]:
        return {
            open(f"/proc/{pid}/stat").read().rsplit(")", 1)[-1].split()[0]
            for pid in process_tree(root)
            if _alive(pid)
        }

    try:
        refinements.submit("k", g, ss.solve(g, 0.3, hw, solver="heuristic"), {"work_s": 300})
        root = refinements.running.proc.pid
        time.sleep(3)  # it is searching
        assert "T" not in states(root)
        with refinements.paused() as stopped:
            assert root in stopped and states(root) == {"T"}
            graph = ss.profile(model, x, loss_fn, warmup=1, repeat=1)
            assert states(root) == {"T"}  # still stopped when the profile ends
        assert graph.ideal_step_time_s > 0
        for _ in range(200):  # it goes on afterwards (each process continued in turn)
            if "T" not in states(root):
                break
            time.sleep(0.05)
        assert _alive(root) and "T" not in states(root)
    finally:
        refinements.close()
