"""A plan's swaps under torch.compile: ``ss.checkpointed`` exports them as MUST_CPU_OFFLOAD and
torch's own activation-offloading pass runs them (runtime/compiled_offload.py). On the CPU the
offload is a device_put to the same device, so what is tested is the graphs: offload and reload
nodes for exactly the planned swaps, what the pass would not offload said, gradients exact."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from models import TinyGPT  # noqa: E402

import slackswap as ss  # noqa: E402
from slackswap.runtime.checkpoint import checkpointed  # noqa: E402

LINK = "cpu-emulated-link"


def loss_fn(out):
    return out.logsumexp(-1).mean()


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = TinyGPT(vocab=300, d=64, layers=2, p=0.1)
    x = torch.randint(0, 300, (2, 32))
    graph = ss.profile(model, x, loss_fn, warmup=1, repeat=1)
    return model, x, graph


def plan_swapping(graph, chosen) -> ss.Plan:
    """Keep-all but ``chosen`` (saved tensor names) swapped, on the emulated link's schedule."""
    decisions = {graph.tensors[t].name: "keep" for t in graph.saved}
    decisions.update({name: "swap" for name in chosen})
    return ss.complete(ss.Plan(graph.name, graph.digest, 10**12, decisions), graph, LINK)


def saved_by(graph, aten: str, module_prefix: str = "blocks.") -> list[str]:
    """The saved outputs of the ops named ``aten`` inside the blocks."""
    return [
        graph.tensors[t].name
        for t in graph.saved
        if graph.ops[int(graph.producer[t])].extra.get("aten") == aten
        and graph.ops[int(graph.producer[t])].extra.get("module", "").startswith(module_prefix)
    ]


def compiled_step(model, x, capture: dict):
    """One step of ``model`` compiled with aot_eager whose forward and backward graphs are kept
    in ``capture``; gradients returned."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def keep(kind):
        def compiler(gm, example_inputs):
            capture.setdefault(kind, []).append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(
        fw_compiler=keep("forward"),
        bw_compiler=keep("backward"),
        partition_fn=min_cut_rematerialization_partition,
    )
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    loss_fn(compiled(x)).backward()
    torch._dynamo.reset()
    return [p.grad.clone() for p in model.parameters()]


def inductor_step(model, x) -> list:
    """One step of ``model`` compiled afresh with inductor (dropout masks from seed 7): its
    gradients."""
    torch._dynamo.reset()
    try:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        loss_fn(torch.compile(model, backend="inductor")(x)).backward()
        return [p.grad.clone() for p in model.parameters()]
    finally:
        torch._dynamo.reset()


def setup_one_block():
    torch.manual_seed(0)
    model = TinyGPT(vocab=300, d=64, layers=1, p=0.1)
    x = torch.randint(0, 300, (2, 32))
    return model, x, ss.profile(model, x, loss_fn, warmup=1, repeat=1)


def nodes(graphs, prefix: str) -> list[str]:
    return [n.name for g in graphs for n in g.graph.nodes if n.name.startswith(prefix)]


@pytest.mark.slow
def test_compiled_swaps_are_offloaded_and_reloaded_exactly_as_planned(setup):
    model, x, graph = setup
    # the fc1 outputs (GELU's inputs): single-output, contiguous tensors torch's pass offloads
    chosen = saved_by(graph, "aten.addmm.default")
    assert len(chosen) == 2  # one per block
    plan = plan_swapping(graph, chosen)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    loss_fn(model(x)).backward()
    eager = [p.grad.clone() for p in model.parameters()]
    capture: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing saved instead, nothing said
        with checkpointed(model, plan, graph) as ctx:
            grads = compiled_step(model, x, capture)
    info = ctx.info
    assert info["swaps"] == {name: "offloaded" for name in chosen}
    # one offload node in the forward per swap, its reload in the backward, nothing else
    offloads = nodes(capture["forward"], "cpu_offload_")
    reloads = nodes(capture["backward"], "gpu_reload_")
    assert len(offloads) == len(chosen) == len(reloads)
    assert sum(g["offloads"] for g in info["compiled_graphs"]) == len(chosen)
    assert "torch's" in info["schedule"]
    # dropout on: masks are saved under compile, so the gradients are eager's
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(eager, grads))
    # without the context, the same compile offloads nothing
    capture = {}
    compiled_step(model, x, capture)
    assert not nodes(capture["forward"], "cpu_offload_")


@pytest.mark.slow
def test_a_swap_torchs_pass_will_not_offload_is_said_and_saved(setup):
    """A layer norm's saved mean is a getitem of a multi-output op: torch's pass refuses it.
    The step runs with it saved on the device, a RuntimeWarning names it, and the context's
    info says "saved"; the addmm swap beside it is offloaded."""
    model, x, graph = setup
    mean = next(
        graph.tensors[t].name
        for t in graph.saved
        if graph.ops[int(graph.producer[t])].extra.get("aten") == "aten.native_layer_norm.default"
        and graph.ops[int(graph.producer[t])].extra.get("module", "").startswith("blocks.")
        and graph.tensors[t].extra.get("shape", [0])[-1] == 1
    )
    fc1 = saved_by(graph, "aten.addmm.default")[0]
    plan = plan_swapping(graph, [mean, fc1])
    capture: dict = {}
    with pytest.warns(RuntimeWarning, match="would not offload 1 of the plan's swaps"):
        with checkpointed(model, plan, graph) as ctx:
            compiled_step(model, x, capture)
    assert ctx.info["swaps"] == {mean: "saved", fc1: "offloaded"}
    assert len(nodes(capture["forward"], "cpu_offload_")) == 1


@pytest.mark.slow
def test_eager_swaps_under_torchs_checkpoint_are_saved_and_said(setup):
    """Eager selective checkpointing has no offload (a model not compiled, or a region
    torch.compile runs eagerly after a graph break): the swaps are saved, a RuntimeWarning says
    so once, and the context's info names each as "saved"; gradients are plain's."""
    model, x, graph = setup
    chosen = saved_by(graph, "aten.addmm.default")
    plan = plan_swapping(graph, chosen)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    loss_fn(model(x)).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="ran eagerly") as caught:
        with checkpointed(model, plan, graph) as ctx:
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                torch.manual_seed(7)
                loss_fn(model(x)).backward()
    assert len([w for w in caught if "ran eagerly" in str(w.message)]) == 1
    assert ctx.info["swaps"] == {name: "saved" for name in chosen}
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters()))


def test_a_tensor_computed_from_a_swap_alone_stands_in_for_it_where_the_swap_is_not_saved():
    """Forward graph: a = mm(x, w) is swapped but not saved; the forward saves b = relu(a) and
    c = a + x (from a alone, besides placeholders): each stands in for a. d = a * sin(x) is
    computed from sin(x) too, k = tanh(a) is a tensor the plan keeps (MUST_SAVE), g = a[0] a
    getitem: none of them stands in."""
    import operator

    from torch import fx
    from torch.utils.checkpoint import CheckpointPolicy

    from slackswap.runtime.compiled_offload import mark_stand_ins

    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    a = graph.call_function(torch.mm, (x, w))
    a.meta["slackswap_swaps"] = ("layer.fc#0",)
    b = graph.call_function(torch.relu, (a,))
    c = graph.call_function(torch.add, (a, x))
    s = graph.call_function(torch.sin, (x,))
    d = graph.call_function(torch.mul, (a, s))
    k = graph.call_function(torch.tanh, (a,))
    k.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    g = graph.call_function(operator.getitem, (a, 0))
    graph.output((b, c, d, k, g, x))
    module = fx.GraphModule(torch.nn.Module(), graph)
    assert mark_stand_ins(module) == {"layer.fc#0": ["relu", "add"]}
    assert [n.name for n in graph.nodes if n.meta.get("should_offload")] == ["relu", "add"]
    # a swap the forward saves itself needs no stand-in
    graph2 = fx.Graph()
    x2 = graph2.placeholder("x")
    a2 = graph2.call_function(torch.relu, (x2,))
    a2.meta["slackswap_swaps"] = ("t#0",)
    graph2.output((graph2.call_function(torch.sin, (a2,)), a2))
    assert mark_stand_ins(fx.GraphModule(torch.nn.Module(), graph2)) == {}


@pytest.mark.slow
def test_under_inductor_every_planned_swap_is_offloaded_and_gradients_are_the_compiles(setup):
    """Inductor's partitioner saves GELU's derivative, not the fc1 output the plan swaps: the
    derivative is offloaded in its place (``stand_ins``), one offload and one reload per swap;
    the gradients are those of the same model compiled without the context (inductor's dropout
    masks in both)."""
    model, x, graph = setup
    chosen = saved_by(graph, "aten.addmm.default")
    plan = plan_swapping(graph, chosen)

    reference = inductor_step(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing saved instead, nothing said
        with checkpointed(model, plan, graph) as ctx:
            grads = inductor_step(model, x)
    info = ctx.info
    assert info["swaps"] == {name: "offloaded" for name in chosen}
    assert sorted(info["stand_ins"]) == sorted(chosen)
    assert all(len(nodes) == 1 for nodes in info["stand_ins"].values())
    assert sum(g["offloads"] for g in info["compiled_graphs"]) == len(chosen)
    assert sum(g["reloads"] for g in info["compiled_graphs"]) == len(chosen)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(reference, grads))


@pytest.mark.slow
def test_under_inductor_a_decomposed_ops_swapped_outputs_are_offloaded_and_nothing_else():
    """Inductor decomposes a layer norm into a dozen nodes, all tagged with its policy. Only the
    nodes of its swapped outputs are saved and offloaded (found by the outputs' traced proxies):
    the output and rstd, one offload node each; the mean is a getitem of var_mean, which torch's
    pass refuses: saved, and said. The normalised input and the other intermediates are left to
    the partitioner (before, every node of the op was saved and offloaded: 4 offloads, none
    named). Gradients: the plain compile's."""
    model, x, graph = setup_one_block()
    chosen = saved_by(graph, "aten.native_layer_norm.default")
    assert len(chosen) == 6  # ln1 and ln2: output, mean, rstd
    plan = plan_swapping(graph, chosen)

    reference = inductor_step(model, x)
    with pytest.warns(RuntimeWarning, match="would not offload 2 of the plan's swaps"):
        with checkpointed(model, plan, graph) as ctx:
            grads = inductor_step(model, x)
    swaps = ctx.info["swaps"]
    means = {name for name in chosen if name.endswith("#1")}
    assert swaps == {name: "saved" if name in means else "offloaded" for name in chosen}
    assert sum(g["offloads"] for g in ctx.info["compiled_graphs"]) == 4
    assert sum(g["reloads"] for g in ctx.info["compiled_graphs"]) == 4
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(reference, grads))
