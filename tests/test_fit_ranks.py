"""fit for FSDP2: one rank's model state as fully_shard shards it, the unsharded buffers beside
the step, the fewest ranks at which it fits, and a plan the checker accepts."""

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import slackswap as ss  # noqa: E402
from slackswap.cli import main  # noqa: E402
from slackswap.runtime.hf_models import meta_model, training_batch  # noqa: E402
from slackswap.sharding import shard_bytes, sharded_model_state  # noqa: E402

HW = "a100-80gb-pcie4"


def test_a_shard_is_a_padded_share_of_the_first_dimension():
    # 10 rows of 4 float32 over 4 ranks: ceil(10 / 4) = 3 rows = 3 * 4 * 4 = 48 bytes a rank
    assert shard_bytes([10, 4], 4, 4) == 48
    assert shard_bytes([8, 4], 4, 4) == 32  # evenly: 2 rows
    assert shard_bytes([], 4, 8) == 4  # a scalar is on every rank


def _small(gradients="held", seq=64):
    model, config = meta_model(
        "llama",
        {
            "num_hidden_layers": 2,
            "hidden_size": 128,
            "intermediate_size": 344,
            "num_attention_heads": 4,
            "vocab_size": 1000,
        },
    )
    inputs, loss_fn = training_batch(config, seq, 2)
    return ss.profile(model, inputs, loss_fn, fake=True, hardware=HW, gradients=gradients)


def test_one_ranks_state_is_the_shards_and_three_blocks_unsharded():
    g = _small()
    whole = g.extra["model_state"]
    state = sharded_model_state(g, 4)
    params = g.extra["parameters"]
    shards = sum(shard_bytes(shape, 2, 4) for _, shape, _ in params)  # bf16
    assert state["parameter_bytes"] == shards
    assert state["gradient_bytes"] == shards
    assert state["optimizer_state_bytes"] == 2 * shards  # AdamW: two moments
    assert shards == pytest.approx(whole["parameter_bytes"] / 4, rel=0.01)
    # a block: q, k, v, o (128 x 128 each), the MLP (3 x 128 x 344), two norms (128): 197,888
    # parameters, 395,776 bytes in bf16; the rest of the model (embeddings and the untied head,
    # 2 x 1000 x 128, the final norm 128): 256,128 parameters, 512,256 bytes, the largest group.
    # Three of it: the group running, the one gathered ahead, the unsharded gradients
    block = (4 * 128 * 128 + 3 * 128 * 344 + 2 * 128) * 2
    rest = (2 * 1000 * 128 + 128) * 2
    assert (block, rest) == (395_776, 512_256)
    assert state["unsharded_bytes"] == 3 * rest
    assert sharded_model_state(g, 1)["unsharded_bytes"] == 0


def test_ranks_need_gradients_held_and_say_the_fewest_that_fit():
    made = _small(gradients="made")
    with pytest.raises(ValueError, match="gradients='held'"):
        ss.fit(made, HW, ranks=2, solver="heuristic")
    g = _small()
    whole = g.extra["model_state"]
    # a device with room for the activations' smallest budget beside a quarter of the state
    smallest = ss.smallest_budget(g, HW).budget_bytes
    quarter = sharded_model_state(g, 4)
    memory = quarter["total_bytes"] + quarter["unsharded_bytes"] + smallest + 1024
    assert whole["total_bytes"] + smallest > memory  # one device is not enough
    report = ss.fit(g, HW, memory_bytes=memory, ranks=4, solver="heuristic")
    assert report.fits and report.fewest_ranks is not None and report.fewest_ranks <= 4
    fewer = report.fewest_ranks - 1
    if fewer >= 1:
        assert not ss.fit(g, HW, memory_bytes=memory, ranks=fewer, solver="heuristic").fits


@pytest.mark.slow
def test_llama_2_70b_on_8_ranks(tmp_path, capsys):
    """Per-rank model state within 1% of the hand count, and a plan the checker accepts."""
    layers, hidden, inter, heads, kv, vocab = 80, 8192, 28672, 64, 8, 32000
    head_dim = hidden // heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv * head_dim + 3 * hidden * inter + 2 * hidden
    count = layers * per_layer + 2 * vocab * hidden + hidden
    assert count == 68_976_648_192  # Llama-2-70B
    config = (
        '{"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, '
        '"num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 32000, '
        '"max_position_embeddings": 4096}'
    )
    graph, plan = tmp_path / "g.json", tmp_path / "p.json"
    argv = ["fit", "llama", "--hf-config", config, "--seq", "4096", "--ranks", "8"]
    argv += ["--foreach", "off", "--solver", "heuristic", "--out", str(graph), "--plan", str(plan)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fits with the plan" in out and "fewest that fit: 8" in out
    g = ss.load_graph(str(graph))
    state = sharded_model_state(g, 8)
    hand = 2 * count / 8  # bf16, one eighth
    for key, copies in (
        ("parameter_bytes", 1),
        ("gradient_bytes", 1),
        ("optimizer_state_bytes", 2),
    ):
        assert state[key] == pytest.approx(copies * hand, rel=0.01), key
    assert math.isclose(state["parameter_bytes"], hand, rel_tol=1e-4)  # padding: a few rows
    assert ss.validate(g, ss.load_plan(str(plan), graph=g)).ok


def test_a_ranks_step_carries_fsdp2s_collectives_by_hand():
    """The small Llama over 4 ranks (bf16): each block's all-gather receives 3/4 of its 395,776
    bytes = 296,832 as its first op runs, again as its backward starts, and its reduce-scatter
    sends as much once its backward is done; the root (512,256 bytes: embeddings, head, final
    norm) gathers 384,192 once (FSDP2 does not reshard it) and reduces as much at the end."""
    from slackswap.fit import rank_graph
    from slackswap.sharding import fsdp_collectives_of

    g = _small()
    found = {c.name: c for c in fsdp_collectives_of(g, 4)}
    block, root = 296_832, 384_192
    assert len(found) == 2 + 2 * 3
    assert found["model.all_gather"].h2d_bytes == root
    assert found["model.all_gather"].op == g.ops[0].name
    assert found["model.reduce_scatter"].d2h_bytes == root
    assert "model.all_gather.backward" not in found
    for i in range(2):
        unit = f"model.layers.{i}"
        first = found[f"{unit}.all_gather"]
        again = found[f"{unit}.all_gather.backward"]
        reduced = found[f"{unit}.reduce_scatter"]
        assert (first.h2d_bytes, again.h2d_bytes, reduced.d2h_bytes) == (block, block, block)
        assert (first.phase, again.phase, reduced.phase) == ("forward", "backward", "backward")
        inside = [
            op.name
            for op in g.ops
            if (m := op.extra.get("module", "")) == unit or m.startswith(unit + ".")
        ]
        assert first.op == inside[0] and reduced.op == inside[0] and again.op == inside[-1]
    assert rank_graph(g, 1) is g
    ranked = rank_graph(g, 4)
    assert rank_graph(ranked, 4) is ranked  # a graph with its own collectives stays as it is


def test_collectives_on_the_link_take_the_swaps_lanes_in_fit():
    """With the collectives on the host link, fit plans the rank's step with them on the copy
    lanes: the plan is for the graph with the collectives, the checker accepts it there, and
    the report states the traffic."""
    from dataclasses import replace

    from slackswap.fit import rank_graph

    g = _small()
    hw = replace(ss.hardware(HW), collectives_on_link=True)
    state = sharded_model_state(g, 4)
    keep_all = ss.keep_all_peak(g, hw)
    memory = state["total_bytes"] + state["unsharded_bytes"] + keep_all * 6 // 10
    report = ss.fit(g, hw, memory_bytes=memory, ranks=4, solver="heuristic")
    assert report.fits and report.collectives_on_link
    assert (report.gathered_bytes, report.reduced_bytes) == (1_571_520, 977_856)
    assert "all-gathers" in report.table() and "on the copy lanes" in report.table()
    ranked = rank_graph(g, 4)
    assert ss.validate(ranked, report.plan, hw).ok
    assert report.plan.graph_digest == ranked.digest != g.digest  # not one device's graph


def test_collectives_on_link_needs_ranks(capsys):
    argv = ["fit", "llama", "--seq", "64", "--collectives-on-link"]
    assert main(argv) != 0
    assert "--ranks 2 or more" in capsys.readouterr().err
