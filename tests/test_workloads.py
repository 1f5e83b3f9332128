"""The analytic workloads follow the saved-activation inventory (Korthikanti et al. 2022)."""

import pytest

import slackswap as ss

HW = "a100-80gb-pcie4"


def layer_saved_bytes(g, layer):
    prefix = f"L{layer}."
    total = 0
    for t in g.saved:
        name = g.tensors[t].name
        if (
            name.startswith(prefix)
            or (layer > 0 and name == f"L{layer - 1}.out")
            or (layer == 0 and name == "embed.out")
        ):
            # the block input x is saved by this block's first norm
            if name.endswith(".out") and not name.startswith(prefix):
                total += g.tensors[t].bytes
            elif name.startswith(prefix) and name != f"L{layer}.out":
                total += g.tensors[t].bytes
    return total


@pytest.mark.parametrize("name", ["bert-large", "gpt2-xl"])
def test_gelu_flash_dropout_layers_save_34sbh_plus_lse(name):
    c = ss.WORKLOADS[name]
    g = ss.workload(name, HW)
    s, b, h, a = c.seq_len, c.micro_batch, c.hidden, c.heads
    # 34sbh with f = 4h: x 2, norm1 2, q k v 6, O 2, mask 1, h1 2, norm2 2, fc1 2f/h, gelu 2f/h,
    # mask 1 -> 18sbh + 4sbf; plus the FlashAttention log-sum-exp row 4asb
    expected = 18 * s * b * h + 4 * s * b * c.ffn + 4 * a * s * b
    assert c.ffn == 4 * h
    assert expected - 4 * a * s * b == 34 * s * b * h
    for layer in (0, 1, c.layers - 1):
        assert layer_saved_bytes(g, layer) == expected


def test_llama_swiglu_rope_layer():
    c = ss.WORKLOADS["llama-7b"]
    g = ss.workload("llama-7b", HW)
    s, b, h, f, a = c.seq_len, c.micro_batch, c.hidden, c.ffn, c.heads
    # no dropout masks; x 2, norm1 2, q k (after RoPE) 4, v 2, O 2, h1 2, norm2 2 = 16sbh;
    # gate, up, silu(gate)*up: 6sbf; lse 4asb
    expected = 16 * s * b * h + 6 * s * b * f + 4 * a * s * b
    for layer in (0, 5, c.layers - 1):
        assert layer_saved_bytes(g, layer) == expected
    assert g.tensors[g.tensor_index["L0.q_raw"]].saved_for == ()  # only the rotated q is saved


def test_eager_attention_adds_5as2b():
    base = ss.TransformerConfig(layers=2, hidden=256, heads=4, ffn=1024, seq_len=128, micro_batch=2)
    flash = ss.transformer_graph(base, HW)
    from dataclasses import replace

    eager = ss.transformer_graph(replace(base, attention="eager"), HW)
    s, b, h, a = 128, 2, 256, 4
    diff = layer_saved_bytes(eager, 0) - layer_saved_bytes(flash, 0)
    # eager stores softmax output 2as^2b, its dropout mask as^2b and dropout output 2as^2b,
    # and no log-sum-exp row
    assert diff == 5 * a * s * s * b - 4 * a * s * b
    assert s * b * h  # shapes are positive


def test_gqa_shrinks_k_and_v():
    cfg = ss.TransformerConfig(
        layers=1,
        hidden=512,
        heads=8,
        kv_heads=2,
        ffn=1024,
        seq_len=64,
        micro_batch=1,
        mlp="swiglu",
        norm="rmsnorm",
        rope=True,
        dropout=0.0,
    )
    g = ss.transformer_graph(cfg, HW)
    assert g.tensors[g.tensor_index["L0.k"]].bytes == 2 * 64 * 512 // 4


def test_roofline_times_and_ideal_step():
    g = ss.workload("gpt2-xl", HW)
    hw = ss.hardware(HW)
    qkv = g.ops[g.op_index["L0.qkv"]]
    tokens, h = 1024 * 8, 1600
    flops = 2 * tokens * 3 * h * h
    assert qkv.forward_s == pytest.approx(flops / (0.7 * 312e12))
    assert qkv.backward_s == pytest.approx(2 * qkv.forward_s)
    norm = g.ops[g.op_index["L0.norm1"]]
    assert norm.forward_s == pytest.approx(2 * 2 * tokens * h / (0.8 * hw.hbm_bytes_per_s))
    assert g.ideal_step_time_s == pytest.approx(g.forward_s.sum() + g.backward_s.sum())


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="hidden 100 is not divisible by heads 3"):
        ss.TransformerConfig(layers=1, hidden=100, heads=3, ffn=4, seq_len=4, micro_batch=1)
    with pytest.raises(ValueError, match="mlp"):
        ss.TransformerConfig(
            layers=1, hidden=8, heads=2, ffn=4, seq_len=4, micro_batch=1, mlp="relu"
        )
    with pytest.raises(ValueError, match="unknown workload"):
        ss.workload("gpt-5")


def test_hardware_presets():
    for name in ("a100-80gb-pcie4", "a100-40gb-pcie4", "h100-sxm-pcie5", "h200-sxm-pcie5"):
        hw = ss.hardware(name)
        assert hw.sources
        assert hw.h2d_time(24e9) > 0
    with pytest.raises(ValueError, match="unknown hardware"):
        ss.hardware("tpu")


@pytest.mark.parametrize("name", ["bert-large", "gpt2-xl", "llama-7b"])
def test_workloads_round_trip(name):
    g = ss.workload(name, HW)
    again = ss.load_graph(g.to_json())
    assert again.digest == g.digest
