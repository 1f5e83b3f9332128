"""Host memory as a limit: the executor's pool holds every swapped tensor through the step, so a
plan needs the sum of its swapped tensors' bytes on the host, and no planner, the checker, the
simulator or the pool lets that exceed ``Hardware.host_memory_bytes``."""

from dataclasses import replace

import pytest
from helpers import CAP, LINK, graph, op, plan, tensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slackswap as ss


def _chain():
    """Four ops, three saved tensors of 40, 30 and 20 bytes, each read by the next op's
    backward; a link of 100 B/s hides each copy behind the 1 s ops."""
    ops = [
        op("A", 1.0, 1.0, [], ["a"]),
        op("B", 1.0, 1.0, ["a"], ["b"]),
        op("C", 1.0, 1.0, ["b"], ["c"]),
        op("D", 1.0, 1.0, ["c"], ["d"]),
    ]
    tensors = [
        tensor("a", 40, ["B"]),
        tensor("b", 30, ["C"]),
        tensor("c", 20, ["D"]),
        tensor("d", 1, []),
    ]
    return graph(ops, tensors)


def test_the_checker_counts_every_swapped_tensor_against_the_host():
    g = _chain()
    host = replace(LINK, name="test-host", host_memory_bytes=60)
    # swapping a and c holds 40 + 20 = 60 bytes on the host: exactly the limit
    ok = plan(g, {"a": "swap", "b": "keep", "c": "swap"}, 200, hw=host)
    assert not [v for v in ss.validate(g, ok, host).violations if v.kind == "host_memory"]
    # a, b and c: 90 bytes, 30 over
    over = plan(g, {"a": "swap", "b": "swap", "c": "swap"}, 200, hw=host)
    found = [v for v in ss.validate(g, over, host).violations if v.kind == "host_memory"]
    assert len(found) == 1 and found[0].bytes_over == 30 and "90 bytes" in found[0].message
    sim = ss.simulate(g, over, host)
    assert sim.swapped_bytes == 90 and not sim.fits
    assert any("host memory" in v for v in sim.violations)
    # without a limit (0) the same plan is checked as before
    assert not [v for v in ss.validate(g, over, LINK).violations if v.kind == "host_memory"]


@pytest.mark.parametrize(
    "solver",
    ["heuristic", pytest.param("cpsat", marks=pytest.mark.slow)],  # BERT-Large: 12 s
)
def test_every_planner_keeps_its_swaps_within_the_host(solver):
    g = ss.workload("bert-large")
    hw = ss.hardware("a100-80gb-pcie4")
    free = ss.solve(g, 0.5, hw.with_link(host_memory_bytes=0), solver="heuristic")
    needed = ss.simulate(g, free, hw).swapped_bytes
    assert needed > 0
    tight = hw.with_link(name="a100-tight-host", host_memory_bytes=needed // 4)
    p = ss.solve(g, 0.5, tight, solver=solver, time_limit_s=CAP, work_s=5)
    assert ss.simulate(g, p, tight).swapped_bytes <= needed // 4
    assert ss.validate(g, p).ok


@pytest.mark.parametrize("solver", ["cpsat", "highs"])
def test_a_budget_that_needs_more_host_is_refused_with_the_figures(solver):
    if not ss.is_available(solver):
        pytest.skip(f"{solver} is not installed")
    g = _chain()
    # keep-all peaks at 91 bytes (a 40 + b 30 + c 20 + d 1 alive together at D's backward); with
    # keep and swap alone, 70 bytes needs a offloaded: 40 bytes on the host
    assert ss.keep_all_peak(g, LINK) == 91
    roomy = replace(LINK, name="test-roomy", host_memory_bytes=40)
    p = ss.solve(g, 70, roomy, solver=solver, allowed=("keep", "swap"), time_limit_s=CAP)
    assert p.decisions["a"] == "swap" and ss.validate(g, p).ok
    # with 30 bytes of host memory no plan meets 70: refused, naming both memories
    host = replace(LINK, name="test-host", host_memory_bytes=30)
    with pytest.raises(ss.InfeasibleBudget, match=r"70 bytes of device memory and 30 of host"):
        ss.solve(g, 70, host, solver=solver, allowed=("keep", "swap"), time_limit_s=CAP)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(limit=st.integers(0, 100))
def test_the_heuristic_never_holds_more_on_the_host_than_allowed(limit):
    g = _chain()
    host = replace(LINK, name="test-host", host_memory_bytes=limit)
    try:
        p = ss.solve(g, 0.5, host, solver="heuristic")
    except ss.InfeasibleBudget as exc:
        assert any(why in str(exc) for why in ("host memory", "cannot fit", "no plan found"))
        return
    held = ss.simulate(g, p, host).swapped_bytes
    assert limit == 0 or held <= limit


torch = pytest.importorskip("torch")


def test_the_pool_never_allocates_past_the_host_memory():
    from models import TinyGPT, clock_free

    from slackswap.runtime.pool import POOLS

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, p=0.0)
    x = torch.randint(0, 64, (2, 16))

    def loss_fn(out):
        return out.float().pow(2).mean()

    g = clock_free(ss.profile(model, x, loss_fn, overhead=False))
    link = ss.hardware("cpu-emulated-link")
    first = ss.solve(g, 0.85, link, solver="heuristic")
    swapped = ss.simulate(g, first, link).swapped_bytes
    assert swapped > 0
    limit = swapped // 2 + 1
    host = link.with_link(name="emulated-half-host", host_memory_bytes=limit)
    plans = [ss.solve(g, budget, host, solver="heuristic") for budget in (0.9, 0.95)]
    assert any(p.count("swap") for p in plans)
    POOLS.clear()
    for p in plans:  # two plans of one graph share a pool: it still holds no more than the limit
        assert ss.simulate(g, p, host).swapped_bytes <= limit
        for _ in range(2):  # a context per step: the pool is reused, never grown past the limit
            with ss.apply(p, model, graph=g):
                loss_fn(model(x)).backward()
        assert POOLS and all(pool.nbytes <= limit for pool in POOLS.values())
    # a plan that swaps more than the pool may hold is refused before any step
    bad = replace(first, hardware=host)
    with pytest.raises(ss.PlanError, match="host memory"):
        with ss.apply(bad, model, graph=g):
            loss_fn(model(x)).backward()


def test_a_step_of_hooks_alone_takes_and_gives_back_its_buffers_as_one_kit():
    from slackswap.runtime.pool import HostPool

    pool = HostPool(pinned=False, limit=300)
    sizes = {"a": 40, "b": 30, "c": 20}
    key = tuple(sizes.items())
    pool.reserve_missing(sizes)
    assert pool.nbytes == 90  # one slab: 40 + 30 + 20
    kit = pool.take_kit(key, sizes)
    assert {n: kit[n].nbytes() for n in kit} == sizes and not any(pool.free.values())
    extra = pool.get("c", 20)  # a buffer taken one by one (the kit's "c" in use elsewhere)
    assert pool.nbytes == 110
    pool.give_back_kit(key, kit, [("c", extra)])
    assert pool.kits[key] == [kit] and pool.free["c"] == [extra]  # "c" was in the kit already
    assert pool.take_kit(key, sizes) is kit  # the next step of the same tensors: the same kit
    pool.give_back_kit(key, kit, [])
    # a step that takes buffers one by one (traced again for new shapes) finds the idle kit's:
    # nothing more is allocated
    one = pool.get("a", 40)
    assert pool.nbytes == 110 and not pool.kits
    pool.give_back([("a", one)])
    pool.give_back_kit(key, pool.take_kit(key, sizes), [])  # (a step of hooks alone again)
    assert len(pool.kits[key]) == 1
    # another plan's step (other tensors) finds the kit's buffers free, not held in the kit:
    # nothing more is allocated for it
    other = {"a": 40, "b": 30}
    taken = pool.take_kit(tuple(other.items()), other)
    assert set(taken) == {"a", "b"} and pool.nbytes == 110 and not pool.kits
    # a kit that lacks a tensor's buffer goes back buffer by buffer, never whole
    pool.give_back_kit(tuple(sizes.items()), taken, [])
    assert not pool.kits and len(pool.free["a"]) == 1 and len(pool.free["b"]) == 1
