"""profile(): a real torch step becomes an activation graph."""

from dataclasses import replace

import pytest
from helpers import CAP

torch = pytest.importorskip("torch")

from models import BUILDERS, build  # noqa: E402

import slackswap as ss  # noqa: E402
from slackswap.runtime.profiler import ProfileError  # noqa: E402

MODELS = [m for m in BUILDERS if not m.startswith("hf-")] + [
    pytest.param(
        m,
        marks=pytest.mark.skipif(
            __import__("importlib").util.find_spec("transformers") is None, reason="transformers"
        ),
    )
    for m in BUILDERS
    if m.startswith("hf-")
]


def independent_saved_count(model, inputs, loss_fn):
    """Saved activations counted with saved_tensors_hooks alone: unique storages, excluding
    parameters, buffers and the inputs."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    flat = (
        inputs.values()
        if isinstance(inputs, dict)
        else (inputs if isinstance(inputs, tuple) else (inputs,))
    )
    skip |= {t.untyped_storage().data_ptr() for t in flat}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        loss = loss_fn(out)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return len(storages), sum(storages.values())


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.slow
def test_saved_tensors_match_an_independent_count(name):
    model, inputs, loss_fn = build(name)
    g = ss.profile(model, inputs, loss_fn, warmup=1, repeat=2)
    count, nbytes = independent_saved_count(model, inputs, loss_fn)
    assert len(g.saved) == count
    assert int(g.tensor_bytes[g.saved].sum()) == nbytes
    # the graph round-trips, and the planners and simulator run on it unchanged
    again = ss.load_graph(g.to_json())
    assert again.digest == g.digest
    hw = ss.hardware("cpu-emulated-link")
    lo, hi = ss.min_budget(again, hw), ss.keep_all_peak(again, hw)
    for solver in ("heuristic", "cpsat"):
        plan = ss.solve(again, lo + (hi - lo) // 2, hw, solver=solver, work_s=10, time_limit_s=CAP)
        assert ss.validate(again, plan, hw).ok
        assert ss.simulate(again, plan, hw).fits


@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_keep_all_memory_matches_the_real_step(name):
    """At the forward/backward boundary a real step holds exactly its saved activations (and the
    loss); the simulator's keep-all memory there must be the same bytes. Its peak may exceed that
    only by one op's transient outputs and workspace (tolerance: the largest such op)."""
    model, inputs, loss_fn = build(name)
    g = ss.profile(model, inputs, loss_fn, warmup=0, repeat=1, overhead=False)
    _, saved_bytes = independent_saved_count(model, inputs, loss_fn)
    sim = ss.simulate(g, ss.solve(g, 1.0, "cpu", solver="keep-all"), "cpu")
    boundary = sim.memory_bytes[g.n_ops - 1]
    # while the last op (the loss's reduction) runs, the real step also holds what it reads and
    # writes; nothing else that is not saved is alive then
    last = g.n_ops - 1
    in_flight = {t for t in g.op_inputs[last] + g.op_outputs[last] if not g.is_saved[t]}
    assert boundary == saved_bytes + sum(g.tensors[t].bytes for t in in_flight)
    largest_op = max(
        sum(g.tensors[t].bytes for t in outs) + ws for outs, ws in zip(g.op_outputs, g.forward_ws)
    )
    assert sim.peak_bytes <= boundary + largest_op + sum(
        g.tensors[t].bytes for t in range(len(g.tensors)) if not g.is_saved[t]
    ) + int(g.backward_ws.max())  # the activation gradients alive in backward


def test_keep_all_peak_counts_the_activation_gradients_of_backward():
    """Backward adds gradients to the saved activations: a residual CNN's keep-all step peaks at
    18.0 MiB, of which 6 MiB are gradients of its 8 x 16 x 64 x 64 float activations (2 MiB
    each): a convolution's incoming and outgoing gradient, and the block input's, waiting at the
    skip connection for the branch. The profile records them as each op's backward workspace, so
    the simulated keep-all peak is the measured one (parameter gradients, allocated before, are
    not activation memory). Without them it would read 12 MiB."""
    from torch import nn

    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c1, self.bn = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
            self.c2 = nn.Conv2d(c, c, 3, padding=1)

        def forward(self, x):
            return torch.relu(x + self.c2(torch.relu(self.bn(self.c1(x)))))

    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        Block(16),
        Block(16),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))

    def loss_fn(out):
        return nn.functional.cross_entropy(out, y)

    # the tensors alone: the arithmetic below is theirs (overhead=True adds the heap's own)
    g = ss.profile(model, x, loss_fn, warmup=0, repeat=1, gradients="held", overhead=False)
    grad = 8 * 16 * 64 * 64 * 4
    assert 3 * grad <= int(g.backward_ws.max()) < 3 * grad + 2**16  # + batch-norm statistics
    sim = ss.simulate(g, ss.solve(g, 1.0, "cpu", solver="keep-all"), "cpu")
    loss_fn(model(x)).backward()  # parameter gradients exist before: accumulated in place
    model.zero_grad(set_to_none=False)
    for _ in range(2):  # the first measured step also pays the heap's first-use buffers
        with ss.StepMeter(sample="ops") as meter:
            loss_fn(model(x)).backward()
    assert sim.peak_bytes == pytest.approx(meter.peak_bytes, rel=0.05), (
        sim.peak_bytes,
        meter.peak_bytes,
        int(g.backward_ws.max()),
    )
    assert sim.peak_bytes - int(g.backward_ws.max()) < 0.8 * meter.peak_bytes


def test_the_step_meter_is_not_lowered_by_earlier_garbage():
    """16 MB held by a reference cycle from before the window: freed inside it (a collection an
    allocation count triggers), it would lower the figure below the 4 MB the step allocates."""
    import gc

    class Holder:
        pass

    with ss.StepMeter(sample="ops"):  # its first use in a process sets up the dispatch mode
        torch.ones(1)
    collecting = gc.isenabled()
    gc.disable()
    try:
        holder = Holder()
        holder.cycle, holder.big = holder, torch.ones(4_000_000)  # 16 MB
        del holder
        with ss.StepMeter(sample="ops") as meter:
            gc.collect()
            kept = torch.ones(1_000_000)  # 4 MB
        assert kept.numel() * 4 <= meter.peak_bytes < 2 * kept.numel() * 4
        assert gc.isenabled() is False  # the meter restores the collector as it found it
    finally:
        if collecting:
            gc.enable()


def test_dropout_is_marked_and_in_place_writes_are_rebuilt_with_their_writers():
    model, inputs, loss_fn = build("gpt")
    g = ss.profile(model, inputs, loss_fn, warmup=0, repeat=1)
    random_ops = [op for op in g.ops if op.extra.get("random")]
    assert random_ops, "dropout must show up as random ops"
    # on CPU dropout draws its mask in place (empty_like, then bernoulli_): the draw lists the
    # mask in its writes, and rebuilding the mask reruns the producer and then the draw
    index = {op.name: i for i, op in enumerate(g.ops)}
    drawn = 0
    for op in random_ops:
        for name in op.writes:
            t = g.tensor_index[name]
            producer = g.ops[g.producer[t]]
            assert "empty" in producer.extra["aten"] and producer.recomputable
            assert index[op.name] in g.rerun_ops[t] and g.writers[t][0] == index[op.name]
            drawn += 1
    assert drawn > 0


@pytest.mark.slow
def test_stable_names_across_steps():
    model, inputs, loss_fn = build("encoder")
    a = ss.profile(model, inputs, loss_fn, warmup=0, repeat=1)
    b = ss.profile(model, inputs, loss_fn, warmup=1, repeat=1)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    assert all("shape" in t.extra and t.extra["dtype"] for t in a.tensors)
    assert any(t.name.startswith("layers.0.") for t in a.tensors)


def test_clear_errors():
    model, inputs, loss_fn = build("mlp")
    with pytest.raises(ProfileError, match="failed to run"):
        ss.profile(model, torch.randn(3, 5), loss_fn)
    with pytest.raises(ProfileError, match="scalar"):
        ss.profile(model, inputs, lambda out: out)
    frozen, _, _ = build("mlp")
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ProfileError, match="does not require grad"):
        ss.profile(frozen, inputs, loss_fn)
    with pytest.raises(ProfileError, match="inputs must be"):
        ss.profile(model, [inputs], loss_fn)
    with pytest.raises(ProfileError, match="nn.Module"):
        ss.profile(lambda x: x, inputs, loss_fn)


def test_calibrate_link_keeps_its_promise_on_this_machine():
    """A CPU device has no link to measure: the documented preset, on any machine. A CUDA device,
    where there is one, gets measured figures under a "measured:" name."""
    import math

    assert ss.calibrate_link("cpu") == ss.hardware("cpu")
    hw = ss.calibrate_link()
    if torch.cuda.is_available():
        assert hw.name.startswith("measured:")
        for figure in (hw.d2h_bytes_per_s, hw.h2d_bytes_per_s, hw.latency_s):
            assert math.isfinite(figure) and figure > 0
    else:
        assert hw == ss.hardware("cpu")


@pytest.mark.parametrize(
    "name",
    ["gpt", "hf-llama"] if __import__("importlib").util.find_spec("transformers") else ["gpt"],
)
@pytest.mark.slow
def test_grouped_by_module(name):
    """One op per module call: fewer ops, the same saved tensors and bytes, same ideal time, and
    its plans run in the executor with exact gradients."""
    model, inputs, loss_fn = build(name)
    fine = ss.profile(model, inputs, loss_fn, warmup=0, repeat=1)
    coarse = ss.profile(model, inputs, loss_fn, warmup=0, repeat=1, group_by_module=True)
    assert coarse.n_ops < fine.n_ops
    assert [coarse.tensors[t].name for t in coarse.saved] == [
        fine.tensors[t].name for t in fine.saved
    ]
    assert int(coarse.tensor_bytes[coarse.saved].sum()) == int(fine.tensor_bytes[fine.saved].sum())
    hw = ss.hardware("cpu-emulated-link")
    lo, hi = ss.min_budget(coarse, hw), ss.keep_all_peak(coarse, hw)
    plan = ss.solve(coarse, lo + (hi - lo) // 2, hw, solver="heuristic")
    assert ss.simulate(coarse, plan, hw).fits
    call = (lambda: model(**inputs)) if isinstance(inputs, dict) else (lambda: model(inputs))
    torch.manual_seed(5)
    model.zero_grad(set_to_none=True)
    loss_fn(call()).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    torch.manual_seed(5)
    model.zero_grad(set_to_none=True)
    with ss.apply(plan, model):
        loss_fn(call()).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(reference, model.parameters()))


class _HoldsItsInput(torch.nn.Module):
    """``a`` is read by relu only, but the local variable keeps it alive to the end of
    forward (unless ``drop`` deletes it right after its reader)."""

    def __init__(self, drop: bool):
        super().__init__()
        self.l1 = torch.nn.Linear(16, 64)
        self.l2 = torch.nn.Linear(64, 64)
        self.drop = drop

    def forward(self, x):
        a = self.l1(x)
        b = torch.relu(a)
        if self.drop:
            del a
        c = self.l2(b)
        return torch.tanh(c)


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.slow
def test_profile_observes_tensors_the_model_holds_past_their_last_reader(drop):
    torch.manual_seed(0)
    model = _HoldsItsInput(drop)
    g = ss.profile(model, torch.randn(8, 16), lambda y: y.sum(), warmup=0, repeat=1)
    a = g.tensors[g.tensor_index["l1#0"]]
    relu = next(i for i, o in enumerate(g.ops) if o.extra["aten"].startswith("aten.relu"))
    tanh = next(i for i, o in enumerate(g.ops) if o.extra["aten"].startswith("aten.tanh"))
    if drop:
        assert a.alive_until is None
        assert g.last_forward_use[g.tensor_index["l1#0"]] == relu
    else:
        assert a.alive_until == g.ops[tanh].name
        assert g.last_forward_use[g.tensor_index["l1#0"]] == tanh
    # a plan that recomputes a: the executor's tracked peak is the simulator's either way
    cpu = ss.hardware("cpu")
    plan = ss.Plan(
        g.name,
        g.digest,
        ss.keep_all_peak(g, cpu),
        {
            g.tensors[t].name: ("recompute" if g.tensors[t].name == "l1#0" else "keep")
            for t in g.saved
        },
    )
    plan = ss.complete(plan, g, cpu)
    with ss.apply(plan, model, graph=g) as run:
        model(torch.randn(8, 16)).sum().backward()
    assert run.stats.peak_activation_bytes == ss.simulate(g, plan, cpu).tensor_peak_bytes


def test_a_profiled_graph_records_its_hardware_and_solve_uses_it():

    model, inputs, loss_fn = build("mlp")
    graph = ss.profile(model, inputs, loss_fn, warmup=0, repeat=1)
    assert graph.extra["hardware"]["name"] == "cpu"  # the CPU device, no CUDA link to measure
    again = ss.load_graph(graph.to_json())  # it travels with the graph file
    plan = ss.solve(again, 1.0, solver="heuristic")
    assert plan.hardware.name == "cpu" and plan.info.extra["hardware_from"] == "graph"


@pytest.mark.slow
def test_plans_for_a_profiled_cpu_graph_never_swap():
    """Profiled on CPU, the graph records the cpu preset: no host to swap to. At the budget where
    the emulated link swaps, the default plan keeps and recomputes only."""
    model, inputs, loss_fn = build("gpt")
    # tiny: the tensors alone (its autograd records would outweigh its activations)
    graph = ss.profile(model, inputs, loss_fn, warmup=0, repeat=1, overhead=False, gradients="held")
    emulated = ss.solve(graph, 0.6, "cpu-emulated-link", solver="heuristic")
    assert emulated.count("swap") > 0
    for solver in ("heuristic", "cpsat"):
        plan = ss.solve(graph, 0.6, solver=solver, work_s=10, time_limit_s=CAP)
        assert plan.hardware.host_is_device and plan.count("swap") == 0
        assert ss.validate(graph, plan).ok


@pytest.mark.slow
def test_op_times_sum_to_the_plain_step_of_each_phase():
    # the tracer's relative times, the plain step's totals: each phase's op times sum to the
    # median plain time the profile measured for it, and their ratios are the traced ones
    model, inputs, loss_fn = build("mlp")
    g = ss.profile(model, inputs, loss_fn, warmup=1, repeat=2)
    timing = g.extra["timing"]
    assert timing["scaled_to_plain"] is True
    assert sum(o.forward_s for o in g.ops) == pytest.approx(timing["forward_plain_s"], rel=1e-9)
    assert sum(o.backward_s for o in g.ops) == pytest.approx(timing["backward_plain_s"], rel=1e-9)
    assert g.ideal_step_time_s == pytest.approx(
        timing["forward_plain_s"] + timing["backward_plain_s"], rel=1e-9
    )
    with pytest.raises(ProfileError, match="calibrate"):
        ss.profile(model, inputs, loss_fn, calibrate="no")
    with pytest.raises(ProfileError, match="gradients"):
        ss.profile(model, inputs, loss_fn, gradients="some")
    raw = ss.profile(model, inputs, loss_fn, warmup=1, repeat=2, calibrate=False)
    assert "timing" not in raw.extra
    assert [o.name for o in raw.ops] == [o.name for o in g.ops]


def test_calibration_leaves_gradients_and_state_as_they_were():
    # the plain steps add gradients and write batch norm's statistics: all put back
    model, inputs, loss_fn = build("cnn")  # batch norm inside
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    ss.profile(model, inputs, loss_fn, warmup=1, repeat=2)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for p, gr in zip(model.parameters(), grads):
        assert (p.grad is None and gr is None) or torch.equal(p.grad, gr)


def test_link_figures_from_timings_hand_worked():
    from slackswap.runtime.link import LinkTimings, link_figures

    # a 1 GB copy: 40 ms D2H, 50 ms H2D alone; together 55 ms (well under 0.8 x 90 ms: duplex),
    # so each direction kept at least 1 GB / 55 ms = 18.18 GB/s while the other ran. Batches:
    # D2H 64 KiB in 12 us, 4 MiB in 177 us per copy: slope (177 - 12) us / (4 MiB - 64 KiB) =
    # 4e-11 s/B (25 GB/s), intercept 12 us - 65,536 B x 4e-11 s/B = 9.38 us. H2D: 10 us and
    # 10 + 4,128,768 x 5e-11 s/B (20 GB/s) us: intercept 10 - 3.28 = 6.72 us. The larger is kept.
    small, medium = 64 * 2**10, 4 * 2**20
    slope = (177e-6 - 12e-6) / (medium - small)
    t = LinkTimings(
        nbytes=10**9,
        d2h_s=0.040,
        h2d_s=0.050,
        both_s=0.055,
        small_bytes=small,
        medium_bytes=medium,
        d2h_small_s=12e-6,
        d2h_medium_s=177e-6,
        h2d_small_s=10e-6,
        h2d_medium_s=10e-6 + (medium - small) * 5e-11,
    )
    f = link_figures(t)
    assert f["duplex"] is True
    assert f["d2h_bytes_per_s"] == pytest.approx(1e9 / 0.055)
    assert f["h2d_bytes_per_s"] == pytest.approx(1e9 / 0.055)
    assert f["latency_s"] == pytest.approx(12e-6 - small * slope)
    assert f["latency_s"] == pytest.approx(9.38e-6, rel=1e-3)
    # half duplex: together 88 ms, as long as one after the other: one link, solo bandwidths
    half = link_figures(replace(t, both_s=0.088))
    assert half["duplex"] is False
    assert half["d2h_bytes_per_s"] == pytest.approx(1e9 / 0.040)
    assert half["h2d_bytes_per_s"] == pytest.approx(1e9 / 0.050)
    ss.hardware("a100-80gb-pcie4").with_link(**half)  # a valid Hardware
    with pytest.raises(ValueError, match="both_s"):
        link_figures(replace(t, both_s=float("nan")))


@pytest.mark.slow
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("transformers") is None, reason="transformers"
)
def test_the_device_check_runs_on_its_cpu_fallback(tmp_path):
    """benchmarks/gpu_check.py is one call on a GPU; its CPU fallback runs the same rows on tiny
    configs, so the script is known to work before device time is spent on it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "check.json"
    subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "gpu_check.py"),
            "--cpu",
            "--out",
            str(out),
            "--rounds",
            "1",
            "--time-limit",
            "5",
            "--solvers",
            "heuristic",
        ],
        check=True,
        cwd=root,
        capture_output=True,
        timeout=CAP,
    )
    summary = json.loads(out.read_text())
    assert summary["ok"] and [m["model"] for m in summary["models"]] == ["gpt2-tiny", "llama-tiny"]
    for entry in summary["models"]:
        plans = [r for r in entry["rows"] if "solver" in r]
        assert [r["budget"] for r in plans] == [1.0, 0.7, 0.5, 0.3]
        for r in plans:
            assert "error" not in r, r
            if "infeasible" in r:
                # the loss's backward temporaries and the gradients the step makes put half of a
                # tiny model's keep-all peak out of reach
                assert r["budget"] <= 0.5 and r["smallest_budget_bytes"] > 0, r
                continue
            assert r["checker_ok"] and r["gradients_bit_identical"] and r["log_matches_plan"]
        assert plans[0]["counts"]["swap"] == plans[0]["counts"]["recompute"] == 0
        variants = {r["variant"]: r for r in entry["rows"] if "variant" in r}
        compiled = variants.pop("torch.compile + ss.checkpointed at 50% (swaps by torch's pass)")
        assert set(variants) == {
            "per-block checkpointing",
            "selective checkpointing (save matmuls)",
            "save_on_cpu",
        }
        # swaps run by torch's offloading pass, each said as offloaded, saved or recomputed
        assert "error" not in compiled, compiled
        assert sum(compiled["swaps_ran"].values()) == compiled["counts"]["swap"] > 0
        assert compiled["swaps_ran"]["not compiled"] == 0
        assert (
            sum(g["offloads"] for g in compiled["compiled_graphs"])
            == compiled["swaps_ran"]["offloaded"]
        )
        fake = entry["fake_vs_measured"]
        assert fake["same_structure"] and fake["preset"] == "cpu", fake
        assert fake["forward_ratio"] > 0 and fake["backward_ratio"] > 0


def _sized(name):
    """HF configs of 4 layers, width 256, batch 4 x 128 (tens of MiB of activations: the heap's
    own overheads, a few hundred KiB, stay small beside them)."""
    import transformers

    torch.manual_seed(0)
    ids = {"input_ids": torch.randint(0, 1000, (4, 128))}
    if name == "hf-gpt2":
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_layer=4,
                n_embd=256,
                n_head=4,
                n_positions=128,
                vocab_size=1000,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    elif name == "hf-bert":
        model = transformers.BertForMaskedLM(
            transformers.BertConfig(
                num_hidden_layers=4,
                hidden_size=256,
                num_attention_heads=4,
                intermediate_size=1024,
                vocab_size=1000,
                max_position_embeddings=128,
            )
        )
    else:
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                num_hidden_layers=4,
                hidden_size=256,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=688,
                vocab_size=1000,
                max_position_embeddings=128,
            )
        )
    return model.train(), ids, (lambda o: o.logits.float().logsumexp(-1).mean())


@pytest.mark.slow
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("transformers") is None, reason="transformers"
)
@pytest.mark.parametrize("name", ["hf-gpt2", "hf-bert", "hf-llama"])
def test_the_keep_all_peak_counts_the_gradients_the_step_makes(name):
    """Training as torch's zero_grad() leaves it (gradients set to None, made in the step,
    gradients="made"): each backward op holds the parameter gradients made before it, all of
    them by the last one. The simulated keep-all peak is within 3% of StepMeter's measured peak
    (0.998 of it when written): both are at the loss's backward, where logsumexp's formula holds
    two temporaries of the logits' size beside its result (backward_trace.BackwardTransients)."""
    model, inputs, loss_fn = _sized(name)
    # the step model's own count (overhead=False): with the overhead measured against this very
    # meter, the comparison below would hold by construction
    g = ss.profile(model, inputs, loss_fn, warmup=1, repeat=1, gradients="made", overhead=False)
    held = ss.profile(model, inputs, loss_fn, warmup=1, repeat=1, gradients="held", overhead=False)
    assert g.extra["parameter_gradients"] == "made"
    peak = ss.simulate(g, ss.solve(g, 1.0, "cpu", solver="keep-all"), "cpu").peak_bytes
    without = ss.simulate(held, ss.solve(held, 1.0, "cpu", solver="keep-all"), "cpu").peak_bytes
    for _ in range(3):  # the first steps also pay the heap's first-use buffers
        model.zero_grad(set_to_none=True)
        with ss.StepMeter(sample="ops") as meter:
            loss_fn(model(**inputs)).backward()
    model.zero_grad(set_to_none=True)
    made = sum(int(o.extra.get("param_grad_bytes", 0)) for o in g.ops)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert made >= params  # every parameter's gradient (tied weights' once per use)
    assert g.ops[0].backward_workspace_bytes >= made > held.ops[0].backward_workspace_bytes
    assert peak >= without
    assert peak == pytest.approx(meter.peak_bytes, rel=0.03), (peak, meter.peak_bytes)


def test_a_tied_weights_gradient_waits_for_its_other_reader_and_is_counted_there():
    """An embedding shared with the LM head (GPT-2's tied weights): the head's backward makes
    the weight's gradient first, 4000 x 64 x 4 = 1,024,000 bytes, and autograd holds it in the
    weight's AccumulateGrad buffer until the embedding's backward has made the other part. With
    gradients held (accumulated in place) that buffer is memory beside ``.grad`` through the
    whole backward: every op's backward from the head to the embedding counts it
    (``param_grad_waiting_bytes``), and the simulated memory while the first layer's backward
    runs is what the heap holds there. Made in the step, the buffer becomes ``.grad``, which
    "made" counts already: not counted twice."""
    from torch import nn

    from slackswap.runtime.meter import _heap_in_use

    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(4000, 64)
            self.l1, self.l2 = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, ids):
            h = torch.relu(self.l2(torch.relu(self.l1(self.emb(ids)))))
            return nn.functional.linear(h, self.emb.weight)

    model, ids = Tied(), torch.randint(0, 4000, (2, 8))

    def loss_fn(out):
        return out.logsumexp(-1).mean()

    held = ss.profile(model, ids, loss_fn, warmup=0, repeat=1, gradients="held", overhead=False)
    made = ss.profile(model, ids, loss_fn, warmup=0, repeat=1, gradients="made", overhead=False)
    grad = 4000 * 64 * 4
    head = held.op_index["model/t#2"]  # the head's transpose of the weight: made there
    waiting = [int(o.extra.get("param_grad_waiting_bytes", 0)) for o in held.ops]
    assert waiting[:head] == [grad] * head and not any(waiting[head:])
    for h, m in zip(held.ops, made.ops):
        # "made" holds the gradients made so far; the waiting one is among them, once
        assert m.backward_workspace_bytes >= h.backward_workspace_bytes - int(
            h.extra.get("param_grad_waiting_bytes", 0)
        )
    l1 = held.op_index["l1/addmm#2"]
    sim = ss.simulate(held, ss.solve(held, 1.0, "cpu", solver="keep-all"), "cpu")
    q = 2 * held.n_ops - 1 - l1
    simulated = int(sim.memory_bytes[sim.expansion.position_first_point[q]])
    loss_fn(model(ids)).backward()  # gradients held before the measured steps
    seen = []
    hook = model.l1.register_full_backward_pre_hook(
        lambda module, grad_out: seen.append(_heap_in_use())
    )
    try:
        for _ in range(2):  # the first step also pays the heap's first-use buffers
            model.zero_grad(set_to_none=False)
            seen.clear()
            with ss.StepMeter(sample="ops") as meter:
                loss_fn(model(ids)).backward()
    finally:
        hook.remove()
    measured = seen[0] - meter._base
    assert measured == pytest.approx(simulated, rel=0.1), (measured, simulated)
    assert simulated - grad < 0.5 * measured  # without the waiting gradient: half of it
