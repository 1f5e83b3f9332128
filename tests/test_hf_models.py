"""Models named as users name them (a model_type, a config.json, a cached model id), configs
built from their keyword arguments so derived fields follow, and the model state of each
precision regime counted as torch allocates it."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import slackswap as ss  # noqa: E402
from slackswap.cli import main  # noqa: E402
from slackswap.core.errors import ProfileError  # noqa: E402
from slackswap.runtime.hf_models import (  # noqa: E402
    ModelSpecError,
    hf_config,
    meta_model,
    training_batch,
)
from slackswap.runtime.model_state import model_state  # noqa: E402

CONFIGS = Path(__file__).parent / "data" / "configs"
GIB = 2**30


def llama_like(layers, hidden, inter, heads, kv_heads, vocab, tied, head_dim=None, bias=False):
    """Parameters of a Llama-shaped decoder counted from its config by hand: per layer q and o
    (hidden x heads*head_dim), k and v (hidden x kv_heads*head_dim), three MLP matrices, two
    norms; embeddings (and an untied head), a final norm."""
    head_dim = head_dim or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    layer = 2 * hidden * q + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden
    if bias:  # Qwen2: q, k and v carry biases
        layer += q + 2 * kv
    return layers * layer + vocab * hidden * (1 if tied else 2) + hidden


# the published configs' shapes (tests/data/configs), counted by hand
HAND_COUNTS = {
    # 32 x 218,112,000 + 2 x 525,336,576 + 4096
    "llama-3-8b": llama_like(32, 4096, 14336, 32, 8, 128256, tied=False),
    # 32 x 218,112,000 + 2 x 131,072,000 + 4096
    "mistral-7b": llama_like(32, 4096, 14336, 32, 8, 32000, tied=False),
    # 28 x 233,057,792 + 2 x 544,997,376 + 3584
    "qwen2.5-7b": llama_like(28, 3584, 18944, 28, 4, 152064, tied=False, bias=True),
    # Gemma-2: head_dim 256 (not 3584 / 16), four norms a layer, tied embeddings:
    # 42 x 198,195,200 + 917,504,000 + 3584
    "gemma-2-9b": llama_like(42, 3584, 14336, 16, 8, 256000, tied=True, head_dim=256)
    + 42 * 2 * 3584,
}


def test_the_hand_counts_are_the_published_sizes():
    assert HAND_COUNTS["llama-3-8b"] == 8_030_261_248
    assert HAND_COUNTS["mistral-7b"] == 7_241_732_096
    assert HAND_COUNTS["qwen2.5-7b"] == 7_615_616_512
    assert HAND_COUNTS["gemma-2-9b"] == 9_241_705_984


@pytest.mark.parametrize("name", sorted(HAND_COUNTS))
def test_a_config_json_builds_the_model_it_describes(name):
    model, config = meta_model(str(CONFIGS / f"{name}.json"))
    state = model_state(model, "adamw")
    # bf16 (the pure regime's default): 2 bytes a parameter, gradients the same, two moments
    assert state["parameter_bytes"] == 2 * HAND_COUNTS[name]
    assert state["gradient_bytes"] == 2 * HAND_COUNTS[name]
    assert state["optimizer_state_bytes"] == 4 * HAND_COUNTS[name]


def test_overrides_reach_the_constructor_so_derived_fields_follow():
    # a Llama-3.2-1B shape from the defaults: head_dim follows hidden_size / heads (64, not the
    # default's 128), 1,235,814,400 parameters = 2.30 GiB in bf16
    shape = {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 16,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
    }
    model, config = meta_model("llama", shape)
    assert config.head_dim == 64
    count = llama_like(16, 2048, 8192, 32, 8, 128256, tied=True)
    assert count == 1_235_814_400
    assert model_state(model, "adamw")["parameter_bytes"] == 2 * count
    # num_key_value_heads follows num_attention_heads when not given (it stayed 32 before)
    small = {
        "num_hidden_layers": 4,
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_attention_heads": 8,
        "vocab_size": 8000,
    }
    assert hf_config("llama", small).num_key_value_heads == 8
    # a config.json's legacy field goes where the constructor puts it
    assert hf_config("llama", {"rope_theta": 500000.0}).rope_parameters["rope_theta"] == 500000.0


def test_the_loud_example_profiles_fake():
    small = {
        "num_hidden_layers": 2,
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_attention_heads": 8,
        "vocab_size": 8000,
    }
    model, config = meta_model("llama", small)
    inputs, loss_fn = training_batch(config, 256, 2)
    g = ss.profile(model, inputs, loss_fn, fake=True, hardware="a100-80gb-pcie4")
    assert g.extra["model_state"]["parameter_bytes"] == 2 * llama_like(
        2, 512, 1376, 8, 8, 8000, tied=False
    )


def test_a_model_id_is_read_from_the_local_cache_only(tmp_path, monkeypatch):
    import huggingface_hub.constants

    snapshot = tmp_path / "models--acme--tiny-llama" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(
        json.dumps({"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4})
    )
    (tmp_path / "models--acme--tiny-llama" / "refs").mkdir()
    (tmp_path / "models--acme--tiny-llama" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    config = hf_config("acme/tiny-llama")
    assert (config.model_type, config.hidden_size, config.head_dim) == ("llama", 256, 64)
    with pytest.raises(ModelSpecError, match="acme/other: .* local Hugging Face cache"):
        hf_config("acme/other")
    # a folder holding the config.json names the model too
    assert hf_config(str(snapshot)).hidden_size == 256


@pytest.mark.parametrize(
    "args, message",
    [
        (["nosuch"], "unknown model 'nosuch'"),
        (["t5"], "t5: transformers has no causal or masked language model"),
        (["llama", "--hf-config", '{"num_hiden_layers": 2}'], "no field 'num_hiden_layers'"),
        (["llama", "--precision", "mixed", "--dtype", "bfloat16"], "float32 master parameters"),
    ],
)
def test_what_cannot_be_built_is_refused_in_one_line(args, message, capsys):
    assert main(["fit", *args, "--seq", "16"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_families_beyond_the_first_four_are_their_language_models():
    names = {
        "qwen2": "Qwen2ForCausalLM",
        "gemma2": "Gemma2ForCausalLM",
        "phi3": "Phi3ForCausalLM",
        "gpt_neox": "GPTNeoXForCausalLM",
        "bert": "BertForMaskedLM",
        "roberta": "RobertaForMaskedLM",
    }
    tiny = {"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2}
    for family, cls in names.items():
        model, _ = meta_model(family, {**tiny, "intermediate_size": 128})
        assert type(model).__name__ == cls


# ---- precision regimes: counted as torch allocates them -------------------------------------


def _tiny_llama(dtype):
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        vocab_size=300,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype).train()


def _allocated_after_one_step(model, autocast_dtype, foreach):
    """The bytes torch holds after one AdamW step: parameters, their gradients and every state
    tensor of the optimizer (the scalar step counts live on the host unless capturable)."""
    opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
    ids = torch.randint(0, 300, (2, 16))
    if autocast_dtype is None:
        loss = model(input_ids=ids, labels=ids).loss
    else:
        with torch.autocast("cpu", dtype=autocast_dtype):
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    params = list(model.parameters())
    state = [
        t
        for s in opt.state.values()
        for key, t in s.items()
        if torch.is_tensor(t) and key != "step"
    ]

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    return nbytes(params), nbytes(p.grad for p in params), nbytes(state)


@pytest.mark.parametrize(
    "precision, dtype",
    [("pure", torch.bfloat16), ("pure", torch.float32), ("mixed", torch.float32)],
)
def test_each_precision_regimes_state_is_what_torch_allocates(precision, dtype):
    model = _tiny_llama(dtype)
    autocast = {"pure": None, "mixed": torch.bfloat16}[precision]
    counted = model_state(model, "adamw", foreach=False, precision=precision)
    params, grads, state = _allocated_after_one_step(model, autocast, foreach=False)
    assert counted["parameter_bytes"] == params
    assert counted["gradient_bytes"] == grads
    assert counted["optimizer_state_bytes"] == state
    assert all(p.grad.dtype == dtype for p in model.parameters())  # mixed: float32 gradients


def test_a_mixed_profile_runs_its_forward_under_autocast_and_refuses_16_bit_masters():
    model = _tiny_llama(torch.float32)
    ids = torch.randint(0, 300, (2, 16))
    inputs = {"input_ids": ids, "labels": ids}
    g = ss.profile(model, inputs, lambda o: o.loss, precision="mixed", overhead=False)
    dtypes = {t.extra.get("dtype") for t in g.tensors if t.saved_for}
    assert "torch.bfloat16" in dtypes or "bfloat16" in dtypes
    assert g.extra["model_state"]["precision"] == "mixed"
    assert g.extra["model_state"]["compute_dtype"] == "bfloat16"
    with pytest.raises(ProfileError, match="parameter 'model.embed_tokens.weight' is bfloat16"):
        ss.profile(_tiny_llama(torch.bfloat16), inputs, lambda o: o.loss, precision="mixed")


def test_the_fsdp_mixed_regime_runs_on_bf16_copies_and_leaves_the_model_as_it_was():
    """precision="fsdp-mixed" profiles the step FSDP2's MixedPrecisionPolicy runs (the forward
    on bf16 parameters, no autocast), counts float32 masters, and hands back the user's
    float32 parameters untouched: same objects, same values, no gradient."""
    model = _tiny_llama(torch.float32)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.randint(0, 300, (2, 16))
    inputs = {"input_ids": ids, "labels": ids}
    g = ss.profile(model, inputs, lambda o: o.loss, precision="fsdp-mixed", overhead=False)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad is None
        assert torch.equal(p, before[name]), name
    state = g.extra["model_state"]
    assert (state["compute_dtype"], state["gathered_dtype"]) == ("bfloat16", "bfloat16")
    assert state["parameter_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    assert g.extra["parameter_gradients"] == "held"  # shards beside the step, not in backward
    assert {dtype for _, _, dtype in g.extra["parameters"]} == {"float32"}
    # no autocast: the norms run in bf16 too, so every floating saved tensor is bf16 but the
    # loss's float32 upcast of the logits and what the rotary embedding makes in float32
    saved = [g.tensors[int(t)] for t in g.saved]
    assert sum(t.extra.get("dtype") == "bfloat16" for t in saved) > len(saved) // 2
    # a fake profile of the same model saves the same tensors
    fake = ss.profile(
        model, inputs, lambda o: o.loss, fake=True, hardware="cpu", precision="fsdp-mixed"
    )
    assert sorted(map(int, fake.tensor_bytes[fake.saved])) == sorted(
        map(int, g.tensor_bytes[g.saved])
    )
    with pytest.raises(ProfileError, match="gradients='made'"):
        ss.profile(model, inputs, lambda o: o.loss, precision="fsdp-mixed", gradients="made")
    with pytest.raises(ProfileError, match="float32 master parameters"):
        ss.profile(_tiny_llama(torch.bfloat16), inputs, lambda o: o.loss, precision="fsdp-mixed")


def test_fit_under_fsdp_mixed_counts_the_gathered_copies_on_one_rank(capsys):
    """One rank under MixedPrecisionPolicy holds float32 masters (4 + 4 + 8 bytes a parameter
    with AdamW) and, beside them, the bf16 copies FSDP2 gathers: the CLI and the API say the
    same, and --gradients made is refused."""
    tiny = json.dumps(
        {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 344,
         "num_attention_heads": 4, "vocab_size": 1000}
    )  # fmt: skip
    argv = ["fit", "llama", "--hf-config", tiny, "--seq", "64", "--solver", "heuristic"]
    assert main([*argv, "--precision", "fsdp-mixed"]) == 0
    printed = capsys.readouterr().out
    model, config = meta_model("llama", json.loads(tiny), dtype="float32")
    inputs, loss_fn = training_batch(config, 64, 1)
    g = ss.profile(
        model, inputs, loss_fn, fake=True, hardware="a100-80gb-pcie4", precision="fsdp-mixed"
    )
    report = ss.fit(g, "a100-80gb-pcie4", solver="heuristic")
    rows = dict(report.rows())
    assert "MixedPrecisionPolicy" in rows["precision"]
    # the root's group (embeddings and untied head, 2 x 1000 x 128, the final norm 128) in
    # bf16, three of it: 3 x 256,128 x 2 = 1,536,768 bytes
    assert report.model_state["unsharded_bytes"] == 3 * 256_128 * 2
    n = sum(p.numel() for p in model.parameters())
    assert report.model_state["total_bytes"] == 16 * n
    for key, value in report.rows():
        if key != "plan":
            assert key in printed and value in printed, (key, value)
    assert main([*argv, "--precision", "fsdp-mixed", "--gradients", "made"]) == 2
    assert "--precision fsdp-mixed: FSDP2 reduce-scatters" in capsys.readouterr().err


def test_the_api_and_the_command_line_give_one_answer(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 2,
                "hidden_size": 256,
                "intermediate_size": 688,
                "num_attention_heads": 4,
                "vocab_size": 1000,
            }
        )
    )
    out = tmp_path / "g.json"
    argv = ["fit", str(path), "--seq", "128", "--batch", "2", "--solver", "heuristic"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    model, config = meta_model(str(path))
    inputs, loss_fn = training_batch(config, 128, 2)
    g = ss.profile(model, inputs, loss_fn, fake=True, hardware="a100-80gb-pcie4")
    api = ss.fit(g, "a100-80gb-pcie4", solver="heuristic")
    cli = ss.load_graph(str(out))
    assert cli.extra["model_state"] == g.extra["model_state"]
    assert cli.extra["parameter_gradients"] == g.extra["parameter_gradients"] == "made"
    for key, value in api.rows():
        if key not in ("plan",):
            assert f"{key}" in printed and value in printed, (key, value)


@pytest.mark.slow
def test_fit_on_the_published_configs_prints_their_hand_counts(capsys):
    for name, count in HAND_COUNTS.items():
        rc = main(
            [
                "fit",
                str(CONFIGS / f"{name}.json"),
                "--seq",
                "4096",
                "--hardware",
                "a100-80gb-pcie4",
                "--solver",
                "heuristic",
            ]
        )
        out = capsys.readouterr().out
        assert rc == 0, out
        rows = dict(
            line.split("  ", 1) for line in out.splitlines() if "  " in line and line[0] != " "
        )
        rows = {k.strip(): v.strip() for k, v in rows.items()}
        assert rows["parameters"] == f"{2 * count / GIB:.2f} GiB", name
        assert rows["gradients"].startswith(f"{2 * count / GIB:.2f} GiB"), name
        assert rows["optimizer state (adamw)"] == f"{4 * count / GIB:.2f} GiB", name
