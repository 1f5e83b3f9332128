"""FSDP2 and DDP: 2 processes, gloo backend, spawned with torch.multiprocessing (no launcher).
One plan shared by the ranks; every rank's gradient shards bit-identical to the same distributed
training without slackswap over 3 steps; tracked peaks equal to the simulated ones; parameters
never in the graph; a rank that differs or crashes makes every rank raise, without a hang."""

from __future__ import annotations

import json
import socket
import time

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import dist_workers  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

HAS_HF = __import__("importlib").util.find_spec("transformers") is not None
WORLD = 2
VARIANTS = ["keep-all", "heuristic", "exact", "random"]
pytestmark = pytest.mark.slow


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, args, tmp_path, timeout_s: float, world: int = WORLD) -> list[dict]:
    ctx = mp.start_processes(
        fn,
        args=(world, _port(), *args, str(tmp_path)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the ranks did not finish within {timeout_s:.0f} s (a hang)")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


CASES = [("gpt", "fsdp-reshard"), ("gpt", "fsdp-keep"), ("gpt", "ddp")] + [
    pytest.param("llama", w, marks=pytest.mark.skipif(not HAS_HF, reason="transformers"))
    for w in ("fsdp-reshard", "fsdp-keep", "ddp")
]


@pytest.mark.parametrize("kind,wrapping", CASES)
def test_plans_train_every_rank_bit_identically(kind, wrapping, tmp_path):
    ranks = _spawn(dist_workers.run_case, (kind, wrapping, VARIANTS), tmp_path, timeout_s=600)
    for rank, out in enumerate(ranks):
        assert "error" not in out, f"rank {rank}:\n{out.get('error')}"
        for variant in VARIANTS:
            got = out[variant]
            assert got["grads_equal"], f"rank {rank}, {variant}: gradients differ from plain"
            assert got["n_grads"] > 0
            assert got["valid"], f"rank {rank}, {variant}: the checker refuses the plan"
            for peak in got["tracked_peaks"]:
                assert peak <= got["budget"]
                if variant == "random":
                    # a random plan may free a tensor the model's reference cycles hold (the
                    # profile keeps those to the end of the forward): never above the simulator
                    assert 0.9 * got["simulated_peak"] <= peak <= got["simulated_peak"]
                else:
                    assert peak == got["simulated_peak"], (
                        rank,
                        variant,
                        got["tracked_peaks"],
                        got["simulated_peak"],
                    )
    for variant in VARIANTS:  # one plan for all ranks
        assert ranks[0][variant]["digest"] == ranks[1][variant]["digest"]
    # parameters (sharded, gathered or replicated) are never activations: the wrapped model saves
    # exactly the tensors the unwrapped one does
    assert ranks[0]["heuristic"]["saved_bytes"] == ranks[0]["unwrapped_saved_bytes"]
    if wrapping == "fsdp-reshard":  # reruns stay inside their unit, and there are some
        assert ranks[0]["heuristic"]["recomputed"] + ranks[0]["random"]["recomputed"] > 0
    # the profiled graph carries FSDP's traffic: every unit's all-gather receives half (2 ranks)
    # of its parameters, and its reduce-scatter sends as much; in backward again when resharding
    collectives = ranks[0]["heuristic"]["collectives"]
    if wrapping == "ddp":
        assert collectives == []
        # DDP's own work before the wrapped module runs (the Llama's rotary buffers broadcast
        # through a flat buffer that gloo's worker thread frees at no fixed op) is not traced
        assert ranks[0]["heuristic"]["root_tensors"] == []
    else:
        gathered = sum(h2d for name, phase, _, h2d in collectives if phase == "forward")
        scattered = sum(d2h for name, phase, d2h, _ in collectives if phase == "backward")
        assert gathered == scattered == ranks[0]["parameter_bytes"] // 2
        again = [name for name, phase, _, h2d in collectives if phase == "backward" and h2d]
        assert bool(again) == (wrapping == "fsdp-reshard")


@pytest.mark.parametrize(
    "fault,message",
    [
        ("shapes", "rank 1 traced another step"),
        ("crash", "rank 1 could not profile"),
        ("late", "rank 1 did not reach"),
    ],
)
def test_a_rank_that_differs_or_crashes_fails_every_rank_without_a_hang(fault, message, tmp_path):
    ranks = _spawn(dist_workers.mismatch_case, (fault,), tmp_path, timeout_s=120)
    for rank, out in enumerate(ranks):
        assert out["error"] is not None and message in out["error"], (rank, out)
    if fault == "shapes":
        assert "tensor" in ranks[0]["error"]  # the first tensor that differs is named
    if fault == "crash":
        assert "a user's bug in forward" in ranks[0]["error"]
    if fault == "late":  # a RankError naming the late rank, not torch's raw store timeout
        assert all(out["error"].startswith("RankError") for out in ranks), ranks


@pytest.mark.skipif(not HAS_HF, reason="transformers")
def test_the_fsdp_mixed_regime_counts_what_fully_shard_with_a_mixed_policy_allocates(tmp_path):
    """Under ``MixedPrecisionPolicy(param_dtype=bfloat16)`` each rank holds float32 shards of
    the parameters, their gradients and AdamW's two moments, and the forward runs on bf16
    parameters: fit's rows for precision="fsdp-mixed" (profiled on one process, fake) equal
    the bytes torch allocates on every rank after one step, and the single-process profile
    saves the tensors the sharded step saves."""
    import transformers

    import slackswap as ss
    from slackswap.runtime.model_state import model_state
    from slackswap.sharding import sharded_model_state

    ranks = _spawn(dist_workers.mixed_policy_case, (), tmp_path, timeout_s=300)
    for out in ranks:
        assert "error" not in out, out.get("error")
    cfg = transformers.LlamaConfig(**dist_workers.MIXED_POLICY_CONFIG)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    batch = {"input_ids": ids, "labels": ids}
    fake = ss.profile(
        model, batch, lambda o: o.loss, fake=True, hardware="cpu", precision="fsdp-mixed"
    )
    counted = sharded_model_state(fake, WORLD)
    # every dimension is even: a rank holds exactly half of each parameter, in float32
    whole = model_state(model, "adamw", precision="fsdp-mixed")
    assert counted["parameter_bytes"] == whole["parameter_bytes"] // WORLD
    for out in ranks:
        assert out["parameter_bytes"] == counted["parameter_bytes"]
        assert out["gradient_bytes"] == counted["gradient_bytes"]
        assert out["optimizer_state_bytes"] == counted["optimizer_state_bytes"]
        assert out["dtypes"] == ["torch.float32"]  # shards, gradients and moments
        assert out["gathered_dtypes"] == ["torch.bfloat16"]  # what the forward computes on
        assert out["profile_state"]["gathered_dtype"] == "bfloat16"
    # the unsharded buffers beside the step are counted in bf16 (the policy's param_dtype):
    # the largest group is the root's embeddings and untied head, 2 x 300 x 64, and its norm
    assert counted["unsharded_bytes"] == 3 * (2 * 300 * 64 + 64) * 2
    # the single-process fake step saves what the sharded step saves, tensor for tensor
    assert sorted(int(fake.tensor_bytes[t]) for t in fake.saved) == ranks[0]["saved_bytes"]


@pytest.mark.parametrize("kind,world", [("gpipe", 2), ("1f1b", 2), ("gpipe", 4), ("1f1b", 4)])
def test_pipeline_stages_train_bit_identically_under_their_plans(kind, world, tmp_path):
    """torch.distributed.pipelining's own schedule (GPipe, 1F1B) over 2 and 4 gloo ranks, each
    stage of a TinyGPT under the plan ``ss.plan_stage`` made for its whole schedule (half way
    from its smallest to its keep-all peak): every stage's gradients bit-identical to the same
    schedule without slackswap; the plans are checked and within their budgets; every stage's
    tracked peak (the executor's count of all its micro-batches' tensors at once) within 3% of
    the simulated schedule's; the first stage moves tensors."""
    ranks = _spawn(dist_workers.pipeline_case, (kind,), tmp_path, timeout_s=600, world=world)
    for rank, out in enumerate(ranks):
        assert "error" not in out, out.get("error")
        assert out["grads_equal"], rank
        assert out["n_grads"] > 0 and out["valid"]
        assert out["simulated_peak"] <= out["budget"]
        for tracked in out["tracked_peaks"]:
            assert tracked == pytest.approx(out["simulated_tensor_peak"], rel=0.03), rank
            assert tracked <= out["budget"]
    assert ranks[0]["swapped"] + ranks[0]["recomputed"] > 0


@pytest.mark.parametrize("mixed", [False, True])
def test_interleaved_1f1b_stages_train_bit_identically_under_their_plans(mixed, tmp_path):
    """torch's ScheduleInterleaved1F1B over 2 gloo ranks of two stages each (a 4-block TinyGPT,
    4 micro-batches), each rank's stages under the plans ``ss.plan_rank`` made for the rank's
    whole schedule (half way from its smallest to its keep-all peak), or with every odd
    micro-batch keeping everything (a plan each): gradients bit-identical to the same schedule
    without slackswap; the plans checked and within the rank's budget; every micro-batch ran
    its own plan (the bytes each stage swapped and rebuilt over a step are its plans' sum);
    the rank's tracked peak (both contexts counting together) against its simulated
    schedule's."""
    ranks = _spawn(dist_workers.interleaved_case, (mixed,), tmp_path, timeout_s=600, world=2)
    for rank, out in enumerate(ranks):
        assert "error" not in out, out.get("error")
        assert out["grads_equal"], rank
        assert out["n_grads"] > 0 and out["valid"]
        assert out["simulated_peak"] <= out["budget"]
        for done in out["done_moved"]:
            assert done == out["expected_moved"], rank
        # the rank's two contexts track together: the rank's tensors, at most 3% under the
        # simulated rank's and over it by no more than torch's receive buffers (one per
        # micro-batch on a later stage, allocated at its first step, which the stage model
        # does not count); within the budget
        for tracked in out["tracked_peaks"]:
            simulated = out["simulated_tensor_peak"]
            assert 0.97 * simulated <= tracked <= simulated + out["receive_buffers"], rank
            assert tracked <= out["budget"]
    assert ranks[0]["moved"] > 0
