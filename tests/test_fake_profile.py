"""profile(fake=True): the real step's structure without its memory; the cost model; fit()."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from helpers import CAP

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import slackswap as ss  # noqa: E402
from slackswap.runtime.costmodel import LAUNCH_S, CostModel  # noqa: E402
from slackswap.runtime.profiler import ProfileError  # noqa: E402

HW = "a100-80gb-pcie4"


def _hf(family: str, dropout: bool):
    """Small configs of the three families, dropout on or off (every probability of the config)."""
    p = 0.1 if dropout else 0.0
    if family == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=2,
            n_positions=64,
            vocab_size=500,
            resid_pdrop=p,
            embd_pdrop=p,
            attn_pdrop=p,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = transformers.GPT2LMHeadModel(config)
    elif family == "bert":
        config = transformers.BertConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=2,
            intermediate_size=256,
            vocab_size=500,
            max_position_embeddings=64,
            hidden_dropout_prob=p,
            attention_probs_dropout_prob=p,
        )
        model = transformers.BertForMaskedLM(config)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=172,
            vocab_size=500,
            max_position_embeddings=64,
            attention_dropout=p,
        )
        model = transformers.LlamaForCausalLM(config)
    torch.manual_seed(0)
    ids = torch.randint(0, 500, (2, 64))
    return model.train(), {"input_ids": ids}, (lambda o: o.logits.float().logsumexp(-1).mean())


def _without_times(graph: ss.ActivationGraph) -> dict:
    d = graph.to_dict()
    for op in d["ops"]:
        op.pop("forward_s")
        op.pop("backward_s")
    return {"ops": d["ops"], "tensors": d["tensors"]}


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [True, False])
@pytest.mark.parametrize("family", ["gpt2", "bert", "llama"])
def test_a_fake_profile_is_the_real_step_without_its_times(family, dropout):
    model, inputs, loss_fn = _hf(family, dropout)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # faked for the CPU: its step as the CPU runs it (attention's kernel choice included)
    fake = ss.profile(model, inputs, loss_fn, fake=True, hardware="cpu")
    real = ss.profile(model, inputs, loss_fn, warmup=0, repeat=1, overhead=False)
    assert fake.structure_digest == real.structure_digest
    assert _without_times(fake) == _without_times(real)
    assert fake.digest != real.digest  # the times are the cost model's, not the clock's
    assert any(op.extra.get("random") for op in real.ops) == dropout
    assert fake.extra["fake"] is True and fake.extra["times"]["hardware"] == "cpu"
    assert all(op.forward_s > 0 for op in fake.ops if op.extra["aten"].startswith("aten.mm"))
    # the user's model comes out as it went in: its own parameters, unchanged, no gradients
    for name, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter and torch.equal(p.detach(), before[name]), name
        assert p.grad is None, name


TRAINING_FAMILIES = ["gpt2", "bert", "llama", "mistral", "qwen2", "phi3", "gemma2", "gpt_neox"]


def _training_path(family: str, width: int = 64):
    """A small model of ``family`` on the path training runs: no KV cache, the model's own loss
    through ``labels=``, token ids the real step reads (a causal mask it may skip)."""
    from slackswap.runtime.hf_models import hf_config, model_class

    fields = {
        "num_hidden_layers": 2,
        "hidden_size": width,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 2 * width,
        "vocab_size": 500,
        "max_position_embeddings": 64,
        "use_cache": False,
        "pad_token_id": 0,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    if family == "gpt2":
        fields = {"n_layer": 2, "n_embd": width, "n_head": 2, "n_positions": 64, "vocab_size": 500}
        fields.update(use_cache=False, bos_token_id=0, eos_token_id=0)
    if family in ("bert", "gpt_neox"):
        fields.pop("num_key_value_heads")
    if family == "gemma2":
        fields["head_dim"] = 32
    config = hf_config(family, fields)
    cls = model_class(config)
    config._attn_implementation = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    torch.manual_seed(0)
    return cls(config).train()


def _fake_and_real(family: str, mask: bool):
    model = _training_path(family)
    ids = torch.randint(0, 500, (2, 64), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    if mask:  # an all-ones attention mask: the real step reads it and skips the causal mask
        inputs["attention_mask"] = torch.ones_like(ids)
    fake = ss.profile(model, inputs, lambda o: o.loss, fake=True, hardware="cpu")
    real = ss.profile(model, inputs, lambda o: o.loss, warmup=0, repeat=1, overhead=False)
    return fake, real


def test_a_fake_step_reads_the_values_a_real_step_reads():
    # Llama's mask code reads the positions (packed sequences?) and the attention mask (all
    # ones: the causal mask is skipped for SDPA's is_causal); a fake step that cannot read them
    # builds a mask the real step never makes (213 ops against 174 before)
    fake, real = _fake_and_real("llama", mask=True)
    assert [o.extra["aten"] for o in fake.ops] == [o.extra["aten"] for o in real.ops]
    assert fake.structure_digest == real.structure_digest


@pytest.mark.slow
@pytest.mark.parametrize("mask", [False, True], ids=["no-mask", "all-ones-mask"])
@pytest.mark.parametrize("family", TRAINING_FAMILIES)
def test_fake_equals_real_on_the_path_training_runs(family, mask):
    fake, real = _fake_and_real(family, mask)
    assert fake.structure_digest == real.structure_digest, (len(fake.ops), len(real.ops))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_a_fake_keep_all_peak_is_within_3_percent_of_a_measured_profiles(family):
    """The real profile's workspaces include what the metered plain steps hold beside the
    graph's tensors (runtime/overhead.py: on the CPU, autograd's records, about 120 KB here);
    the fake step's are the ops' own. A model of a few MB would put that fixed 120 KB above 3%
    (it did at width 64: 3.1%); at width 256 the peak is about 40 MB."""
    model = _training_path(family, width=256)
    ids = torch.randint(0, 500, (8, 64), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    fake = ss.profile(model, inputs, lambda o: o.loss, fake=True, hardware="cpu")
    real = ss.profile(model, inputs, lambda o: o.loss, warmup=1, repeat=1)
    assert ss.keep_all_peak(fake, "cpu") == pytest.approx(ss.keep_all_peak(real, "cpu"), rel=0.03)


@pytest.mark.slow
def test_faked_for_a_gpu_attention_is_the_fused_kernel_even_with_dropout():
    """BERT with attention dropout 0.1: the CPU's SDPA falls back to the unfused math (scores and
    probabilities of 2 x 2 heads x 64 x 64 saved per layer); a GPU's flash kernel takes dropout
    and saves its output and a log-sum-exp row. Faked for the A100, no saved tensor is s x s."""
    model, inputs, loss_fn = _hf("bert", True)
    cpu = ss.profile(model, inputs, loss_fn, fake=True, hardware="cpu")
    gpu = ss.profile(model, inputs, loss_fn, fake=True, hardware=HW)

    def square(g):
        return [t.name for t in g.tensors if t.saved_for and t.extra["shape"] == [2, 2, 64, 64]]

    assert square(cpu) and not square(gpu)
    assert gpu.extra["attention"] == "fused"
    assert any("flash_attention" in op.extra["aten"] for op in gpu.ops)
    assert int(gpu.tensor_bytes[gpu.saved].sum()) < int(cpu.tensor_bytes[cpu.saved].sum())


@pytest.mark.slow
def test_a_meta_model_profiles_and_stays_on_meta():
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=172,
        vocab_size=500,
        max_position_embeddings=64,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).train()
    ids = torch.zeros((2, 64), dtype=torch.long)
    g = ss.profile(
        model, {"input_ids": ids, "labels": ids}, lambda o: o.loss, fake=True, hardware="cpu"
    )
    real_model = transformers.LlamaForCausalLM(config).train()
    real = ss.profile(
        real_model,
        {"input_ids": ids, "labels": ids},
        lambda o: o.loss,
        warmup=0,
        repeat=1,
        overhead=False,  # what a fake step cannot measure
    )
    assert g.structure_digest == real.structure_digest
    assert all(p.is_meta for p in model.parameters())
    state = g.extra["model_state"]
    params = sum(p.numel() * 4 for p in real_model.parameters())  # float32, tied weights once
    assert state["parameter_bytes"] == state["gradient_bytes"] == params
    assert state["optimizer_state_bytes"] == 2 * params  # AdamW: two fp32 moments per element


def test_fake_needs_hardware_and_a_known_optimizer():
    model, inputs, loss_fn = _hf("gpt2", False)
    with pytest.raises(ProfileError, match="hardware"):
        ss.profile(model, inputs, loss_fn, fake=True)
    with pytest.raises(ProfileError, match="optimizer"):
        ss.profile(model, inputs, loss_fn, fake=True, hardware=HW, optimizer="lion")


@pytest.mark.slow
def test_a_fake_profile_allocates_no_tensor_memory():
    """A Llama whose real step would save several GiB (8 layers of width 1024 at 4 x 2048 tokens,
    float32: 7.4 GiB of saved tensors), built on meta and profiled fake, in a fresh process: its
    peak resident memory grows by less than 300 MB."""
    script = textwrap.dedent("""
        import json, resource, sys, torch, transformers
        import slackswap as ss
        config = transformers.LlamaConfig(num_hidden_layers=8, hidden_size=1024,
            num_attention_heads=8, intermediate_size=2816, vocab_size=32000,
            max_position_embeddings=2048)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config).train()
        ids = torch.zeros((4, 2048), dtype=torch.long)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        g = ss.profile(model, {"input_ids": ids, "labels": ids}, lambda o: o.loss, fake=True,
                       hardware="a100-80gb-pcie4")
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        saved = int(g.tensor_bytes[g.saved].sum())
        print(json.dumps({"grown": (after - before) * 1024, "saved": saved}))
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=CAP
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["saved"] > 6 * 2**30
    assert figures["grown"] < 300 * 2**20, figures


# ---------------------------------------------------------------- the cost model

# round figures: 100 TFLOP/s at GEMM efficiency 0.5, 1 TB/s at memory efficiency 0.5
ROUND = ss.Hardware(
    name="round",
    d2h_bytes_per_s=1e10,
    h2d_bytes_per_s=1e10,
    latency_s=0.0,
    duplex=True,
    peak_flops=1e14,
    hbm_bytes_per_s=1e12,
    gemm_efficiency=0.5,
    attention_efficiency=0.25,
    memory_efficiency=0.5,
)


def _fake(*shape):
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        return torch.empty(*shape)


def test_a_matmul_costs_2mnk_over_the_gemm_rate():
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = CostModel(ROUND, launch_s=0.0)
    with FakeTensorMode():
        a, b = torch.empty(1024, 2048), torch.empty(2048, 512)
        out = torch.mm(a, b)
    cost = model.cost(torch.ops.aten.mm.default, (a, b), {}, out)
    # 2 * 1024 * 512 * 2048 = 2.147e9 FLOPs at 1e14 * 0.5 = 5e13 FLOP/s: 42.9 us; its bytes,
    # (1024*2048 + 2048*512 + 1024*512) * 4 = 14.7 MB at 5e11 B/s, 29.4 us: compute-bound
    assert cost.flops == 2 * 1024 * 512 * 2048
    assert cost.bytes == (1024 * 2048 + 2048 * 512 + 1024 * 512) * 4
    assert cost.time_s == pytest.approx(2 * 1024 * 512 * 2048 / 5e13)
    assert cost.kind == "gemm"


def test_a_matmul_is_charged_at_the_rate_of_its_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = CostModel(ss.hardware("a100-80gb-pcie4"), launch_s=0.0)
    flops = 2 * 1024 * 1024 * 1024  # 2.147e9
    gemm = 0.70 * 1.0  # the A100 preset's GEMM efficiency

    def cost(dtype):
        with FakeTensorMode():
            a, b = torch.empty(1024, 1024, dtype=dtype), torch.empty(1024, 1024, dtype=dtype)
            out = torch.mm(a, b)
        return model.cost(torch.ops.aten.mm.default, (a, b), {}, out)

    # float32 at the datasheet's 19.5 TFLOP/s: 2.147e9 / (19.5e12 * 0.7) = 157.3 us (its 12.6 MB
    # at 2.039e12 * 0.8 B/s take 7.7 us: compute-bound)
    assert cost(torch.float32).time_s == pytest.approx(flops / (19.5e12 * gemm))
    # bf16 at 312 TFLOP/s: 9.83 us (6.3 MB of bytes: 3.9 us)
    assert cost(torch.bfloat16).time_s == pytest.approx(flops / (312e12 * gemm))
    # float32 with TF32 enabled for matmuls: 156 TFLOP/s, 19.7 us
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert cost(torch.float32).time_s == pytest.approx(flops / (156e12 * gemm))
    finally:
        torch.set_float32_matmul_precision(before)


def test_presets_hold_what_torch_can_allocate():
    # an 80 GB card: torch reports 79.14 GiB total capacity; less a 400 MiB CUDA context
    assert ss.hardware("a100-80gb-pcie4").memory_bytes == round(79.14 * 2**30) - 400 * 2**20
    assert ss.hardware("h200-sxm-pcie5").memory_bytes == round(139.72 * 2**30) - 400 * 2**20
    for name in ss.hardware_names():
        hw = ss.hardware(name)
        assert not hw.memory_bytes or "memory_bytes" in hw.sources, name


def test_an_elementwise_op_costs_its_bytes_over_the_bandwidth_plus_a_launch():
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = CostModel(ROUND, launch_s=4e-6)
    with FakeTensorMode():
        x = torch.empty(1 << 20)
        y = torch.relu(x)
    cost = model.cost(torch.ops.aten.relu.default, (x,), {}, y)
    # reads 4 MiB, writes 4 MiB: 8,388,608 bytes at 5e11 B/s = 16.8 us, plus the 4 us launch
    assert cost.flops == 0 and cost.kind == "memory"
    assert cost.time_s == pytest.approx(8 * 2**20 / 5e11 + 4e-6)
    # views move nothing and launch nothing
    assert (
        model.cost(torch.ops.aten.view.default, (x, [1024, 1024]), {}, x.view(1024, 1024)).time_s
        == 0
    )


def test_a_fake_profile_of_a_matmul_chain_is_timed_by_hand():
    """Linear(256, 512) then Linear(512, 128), no bias, on 64 rows: forward mm times 2*64*512*256
    and 2*64*128*512 FLOPs over 5e13, each plus the launch (both compute-bound here)."""
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512, bias=False), torch.nn.Linear(512, 128, bias=False)
    )
    x = torch.randn(64, 256)
    g = ss.profile(model, x, lambda out: out.sum(), fake=True, hardware=ROUND)
    mms = [op for op in g.ops if op.extra["aten"] == "aten.mm.default"]
    assert len(mms) == 2
    for op, (m, n, k) in zip(mms, [(64, 512, 256), (64, 128, 512)]):
        flops_s = 2 * m * n * k / 5e13
        bytes_s = (m * k + k * n + m * n) * 4 / 5e11
        assert op.forward_s == pytest.approx(max(flops_s, bytes_s) + LAUNCH_S)
    # backward of each: two matmuls of the same FLOPs (grad input, grad weight; the first
    # layer's input needs none) and what moves beside them
    assert mms[1].backward_s >= 2 * 2 * 64 * 128 * 512 / 5e13


# ---------------------------------------------------------------- fit


@pytest.mark.slow
def test_fit_leaves_the_model_state_aside_and_plans_the_rest():
    model, inputs, loss_fn = _hf("gpt2", True)
    g = ss.profile(
        model, inputs, loss_fn, fake=True, hardware=HW, optimizer="adamw", gradients="held"
    )
    state = g.extra["model_state"]
    keep_all = ss.keep_all_peak(g, HW)
    smallest = ss.smallest_budget(g, HW).budget_bytes
    assert smallest < keep_all
    roomy = ss.fit(g, HW, memory_bytes=state["total_bytes"] + keep_all)
    assert roomy.activation_memory_bytes == keep_all  # held gradients sit beside activations
    assert roomy.fits and roomy.plan.count("keep") == len(g.saved) and roomy.retention == 1.0
    middle = state["total_bytes"] + (keep_all + smallest) // 2
    tight = ss.fit(g, HW, memory_bytes=middle, time_limit_s=CAP, work_s=5)
    assert tight.fits and tight.plan.budget_bytes == (keep_all + smallest) // 2
    assert ss.validate(g, tight.plan).ok and 0 < tight.retention <= 1
    short = ss.fit(g, HW, memory_bytes=state["total_bytes"] + smallest - 1)
    assert not short.fits and "does not fit" in short.verdict
    assert "memory left for activations" in tight.table()


@pytest.mark.slow
def test_fit_counts_gradients_made_in_backward_once():
    model, inputs, loss_fn = _hf("llama", False)
    made = ss.profile(model, inputs, loss_fn, fake=True, hardware=HW, gradients="made")
    state = made.extra["model_state"]
    report = ss.fit(made, HW, memory_bytes=10**9)
    # parameters and optimizer state beside; the gradients are in the backward workspaces
    assert (
        report.activation_memory_bytes
        == 10**9 - state["parameter_bytes"] - state["optimizer_state_bytes"]
    )


@pytest.mark.slow
def test_the_command_line_fits_a_config(tmp_path, capsys):
    from slackswap.cli import main

    graph, plan = tmp_path / "g.json", tmp_path / "p.json"
    config = json.dumps(
        {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 128, "vocab_size": 1000}
    )
    rc = main(
        [
            "fit",
            "gpt2",
            "--hf-config",
            config,
            "--seq",
            "128",
            "--batch",
            "2",
            "--hardware",
            HW,
            "--memory",
            "1GB",
            "--time-limit",
            "20",
            "--out",
            str(graph),
            "--plan",
            str(plan),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "memory left for activations" in out and "fits" in out
    g = ss.load_graph(str(graph))
    assert g.extra["fake"] is True
    assert ss.validate(g, ss.load_plan(str(plan), graph=g)).ok
    assert main(["fit", "gpt2", "--hf-config", '{"n_layers": 2}', "--seq", "16"]) == 2
    assert "has no field 'n_layers'" in capsys.readouterr().err
    assert main(["fit", "gpt2", "--seq", "4096"]) == 2  # GPT-2 has 1024 positions
    assert "longer than the config's 1024 positions" in capsys.readouterr().err


def test_a_fake_profile_leaves_the_users_inputs_as_they_were():
    """The fake step runs input-only ops on the values too; an in-place write there (token ids
    clamped in place) lands on a copy, never on the user's tensor."""

    class Clamping(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 8)

        def forward(self, ids):
            ids.masked_fill_(ids >= 50, 0)  # in place, on what the caller passed
            return self.emb(ids)

    ids = torch.arange(100).reshape(2, 50)
    before = ids.clone()
    ss.profile(Clamping(), ids, lambda o: o.sum(), fake=True, hardware="cpu")
    assert torch.equal(ids, before)
