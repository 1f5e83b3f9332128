"""Pipeline stages (formulations/pipeline.md): the schedules as torch runs them, a stage's peak
and time under a schedule worked by hand, the checker against the simulator on random graphs,
and plans for every stage of a split workload."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import LINK, graph, op, plan, random_plans, tensor
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_simulator_hand import chain_graph  # A -> a (100 B, saved for B) -> b -> c, 1/1/3 s

import slackswap as ss
from slackswap.core.pipeline import PipelineSchedule, StagePlan

# Link: 100 bytes/s each way, no latency: a 100-byte copy takes 1 s.


def _names(schedule, stage):
    return " ".join(str(a) for a in schedule.actions(stage))


def test_the_schedules_run_as_torchs_do():
    # Schedule1F1B: stage s runs min(M, P - s) forwards, then a backward and a forward in turn,
    # then the backwards left; ScheduleGPipe: every forward, then every backward
    one_f_one_b = PipelineSchedule("1f1b", 2, 4)
    assert _names(one_f_one_b, 0) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert _names(one_f_one_b, 1) == "F0 B0 F1 B1 F2 B2 F3 B3"
    assert _names(PipelineSchedule("gpipe", 2, 4), 1) == "F0 F1 F2 F3 B0 B1 B2 B3"
    four = PipelineSchedule("1f1b", 4, 8)
    assert _names(four, 1) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"
    # stage 0 holds as many micro-batches as there are stages, the last one
    assert [four.in_flight(s) for s in range(4)] == [4, 3, 2, 1]
    assert PipelineSchedule("1f1b", 4, 2).in_flight(0) == 2  # fewer micro-batches than stages
    with pytest.raises(ValueError, match="must be one of"):
        PipelineSchedule("interleaved1f1b", 2, 4)
    with pytest.raises(ValueError, match="runs one stage per rank"):
        PipelineSchedule("1f1b", 4, 4, stages_per_rank=2)
    with pytest.raises(ValueError, match="stage must be 0..1"):
        one_f_one_b.actions(2)


@pytest.mark.parametrize(
    "ranks,per_rank,micro_batches", [(2, 2, 4), (4, 2, 8), (2, 3, 4), (4, 2, 10), (4, 2, 3)]
)
def test_the_interleaved_schedule_runs_as_torchs_does(ranks, per_rank, micro_batches):
    """Every rank's order under ScheduleInterleaved1F1B, as torch's own computation of its
    pipeline order gives it (idle slots left out)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    torchs = object.__new__(schedules.ScheduleInterleaved1F1B)
    torchs.n_local_stages, torchs.pp_group_size = per_rank, ranks
    torchs._n_microbatches = micro_batches
    torchs.number_of_rounds = max(1, micro_batches // ranks)
    torchs.microbatches_per_round = micro_batches // torchs.number_of_rounds
    ours = PipelineSchedule("interleaved-1f1b", ranks * per_rank, micro_batches, per_rank)
    for rank in range(ranks):
        expected = [
            (a.stage_index, "F" if "FORWARD" == a.computation_type.name else "B",
             a.microbatch_index)
            for a in torchs._calculate_single_rank_operations(rank) if a is not None
        ]  # fmt: skip
        got = [(a.stage, str(a)[0], a.micro_batch) for a in ours.rank_actions(rank)]
        assert got == expected, rank
        assert ours.stages_of(rank) == tuple(range(rank, ranks * per_rank, ranks))


def test_interleaved_1f1b_by_hand():
    """Two ranks of two stages each (stages 0 and 2 on rank 0), 2 micro-batches, every stage
    the chain graph kept whole (F 120, B 100, at rest 100, 5 s each way)."""
    g = chain_graph()
    keep = ss.solve(g, 1.0, LINK, solver="keep-all")
    schedule = PipelineSchedule("interleaved-1f1b", 4, 2, stages_per_rank=2)
    assert _rank_names(schedule, 0) == "F0@0 F1@0 F0@2 F1@2 B0@2 B1@2 B0@0 B1@0"
    assert _rank_names(schedule, 1) == "F0@1 F1@1 F0@3 B0@3 F1@3 B1@3 B0@1 B1@1"
    plans = [StagePlan(s, schedule, (keep,) * 2, 1000) for s in range(4)]
    # rank 0 holds every micro-batch of both its stages before its first backward:
    #   F0@0 120; F1@0 120 + 100; F0@2 120 + 200; F1@2 120 + 300 = 420;
    #   B0@2 100 + 300; B1@2 100 + 200; B0@0 100 + 100; B1@0 100
    rank0 = ss.simulate_rank([g, g], [plans[0], plans[2]])
    assert [a.peak_bytes for a in rank0.actions] == [120, 220, 320, 420, 400, 300, 200, 100]
    # rank 1: F0@1 120, F1@1 220, F0@3 320, B0@3 100 + 200, F1@3 120 + 200, B1@3 300, B0@1 200,
    # B1@1 100
    rank1 = ss.simulate_rank([g, g], [plans[1], plans[3]])
    assert rank1.peak_bytes == 320 and rank1.stages == (1, 3)
    for mine in ([plans[0], plans[2]], [plans[1], plans[3]]):
        assert (
            ss.validate_rank([g, g], mine).peak_bytes == ss.simulate_rank([g, g], mine).peak_bytes
        )
    # Time, 5 s an action: rank 0 F0@0 0-5, F1@0 5-10; rank 1 F0@1 5-10, F1@1 10-15; rank 0
    # F0@2 10-15, F1@2 15-20; rank 1 F0@3 15-20, B0@3 20-25, F1@3 25-30, B1@3 30-35; rank 0
    # B0@2 25-30, B1@2 35-40; rank 1 B0@1 35-40, B1@1 40-45; rank 0 B0@0 40-45, B1@0 45-50.
    pipeline = ss.simulate_pipeline([g] * 4, plans)
    assert pipeline.step_s == pytest.approx(50.0)
    assert pipeline.starts[0] == pytest.approx((0, 5, 10, 15, 25, 35, 40, 45))
    assert pipeline.starts[1] == pytest.approx((5, 10, 15, 20, 25, 30, 35, 40))
    # a stage sharing its rank is simulated, checked and planned with the rank's others
    with pytest.raises(ValueError, match="simulate_rank"):
        ss.simulate_stage(g, plans[0])
    with pytest.raises(ValueError, match="plan_rank"):
        ss.plan_stage(g, 500, schedule, 0, LINK)
    with pytest.raises(ValueError, match="rank 0 runs stages"):
        ss.simulate_rank([g, g], [plans[0], plans[1]])
    # planned: rank 0 fits 300 by swapping a (nothing rests: 110), rank 1 too
    stages = ss.plan_for_stages([g] * 4, 300, schedule, LINK)
    assert ss.simulate_rank([g, g], [stages[0], stages[2]]).peak_bytes <= 300
    assert ss.validate_rank([g, g], [stages[1], stages[3]]).ok
    with pytest.raises(ValueError, match="share rank 0's memory"):
        ss.plan_for_stages([g] * 4, [300, 300, 200, 300], schedule, LINK)


def _rank_names(schedule, rank):
    return " ".join(str(a) for a in schedule.rank_actions(rank))


def test_two_stages_four_micro_batches_1f1b_by_hand():
    g = chain_graph()
    schedule = PipelineSchedule("1f1b", 2, 4)
    keep = ss.solve(g, 1.0, LINK, solver="keep-all")
    # One micro-batch, keep-all: forward A 100, B 110, C 120; backward C 100, B 100, A 0. What it
    # holds across its forward's end: a, 100 bytes (b and c are freed after C).
    # Stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3:
    #   F0: 120 alone; F1: 120 + 100 (micro-batch 0 at rest) = 220; B0: 100 + 100 (1 at rest);
    #   F2: 120 + 100 (1) = 220; B1: 200; F3: 220; B2: 200; B3: 100 alone. Peak 220.
    # Stage 1 runs F0 B0 F1 B1 ...: one micro-batch at a time, peak 120.
    stage0 = ss.simulate_stage(g, StagePlan(0, schedule, (keep,) * 4, 1000))
    assert [a.peak_bytes for a in stage0.actions] == [120, 220, 200, 220, 200, 220, 200, 100]
    assert stage0.peak_bytes == 220 and stage0.rest_bytes == (100,) * 4
    assert ss.simulate_stage(g, StagePlan(1, schedule, (keep,) * 4, 1000)).peak_bytes == 120
    # Swapping a: offloaded 1..2 s (behind B), freed after B, prefetched at backward C's start
    # (5..6 s, behind C): forward A 100, B 110, C 20; backward 100, 100, 0, no stall. Nothing
    # crosses the forward's end, so no micro-batch holds anything at rest: stage 0's peak is
    # one micro-batch's, 110.
    swap = plan(g, {"a": "swap"}, 120)
    stage0 = ss.simulate_stage(g, StagePlan(0, schedule, (swap,) * 4, 150))
    assert [a.peak_bytes for a in stage0.actions] == [110, 110, 100, 110, 100, 110, 100, 100]
    assert stage0.fits and stage0.rest_bytes == (0,) * 4
    # a budget of 200 refuses keep-all on stage 0 (F1 holds 220), as the checker says too
    tight = StagePlan(0, schedule, (keep,) * 4, 200)
    assert not ss.simulate_stage(g, tight).fits
    checked = ss.validate_stage(g, tight)
    assert not checked.ok and "forward of micro-batch 1 holds 220 bytes" in str(
        checked.violations[0]
    )
    # Time: each stage is busy 4 x (5 + 5) = 40 s. The pipeline: stage 1's F0 waits for stage
    # 0's F0 (5 s), every backward of stage 0 for stage 1's: (M + P - 1) x 10 s = 50 s.
    plans = [StagePlan(s, schedule, (swap,) * 4, 150) for s in range(2)]
    pipeline = ss.simulate_pipeline([g, g], plans)
    assert pipeline.step_s == pytest.approx(50.0) and pipeline.ideal_step_s == pytest.approx(50.0)
    assert [s.busy_s for s in pipeline.stages] == pytest.approx([40.0, 40.0])
    assert pipeline.starts[1][:2] == pytest.approx((5.0, 10.0))  # stage 1: F0 at 5, B0 at 10
    assert pipeline.starts[0][2] == pytest.approx(15.0)  # stage 0's B0 waits for stage 1's


def test_gpipe_holds_every_micro_batch():
    g = chain_graph()
    keep = ss.solve(g, 1.0, LINK, solver="keep-all")
    # F3 runs with micro-batches 0, 1 and 2 at rest: 120 + 3 x 100 = 420
    result = ss.simulate_stage(g, StagePlan(0, PipelineSchedule("gpipe", 2, 4), (keep,) * 4, 10**6))
    assert result.peak_bytes == 420
    # each micro-batch's output, which torch's schedule keeps from its forward's end to its
    # backward's end (7 bytes): F3 holds the three others', B0 all four (100 + 300 + 28 = 428)
    held = StagePlan(0, PipelineSchedule("gpipe", 2, 4), (keep,) * 4, 10**6, held_bytes=7)
    result = ss.simulate_stage(g, held)
    assert [a.peak_bytes for a in result.actions][3:5] == [420 + 3 * 7, 400 + 4 * 7]
    assert result.peak_bytes == ss.validate_stage(g, held).peak_bytes == 441
    # the last stage's outputs, which schedule.step() returns merged: each stays from its
    # backward's end to the step's end (5 bytes): B3 holds three finished ones beside
    returned = StagePlan(1, PipelineSchedule("1f1b", 2, 4), (keep,) * 4, 10**6, returned_bytes=5)
    result = ss.simulate_stage(g, returned)
    assert [a.peak_bytes for a in result.actions] == [120, 100, 125, 105, 130, 110, 135, 115]
    assert ss.validate_stage(g, returned).peak_bytes == 135


def test_a_plan_each_micro_batch():
    g = chain_graph()
    keep = ss.solve(g, 1.0, LINK, solver="keep-all")
    swap = plan(g, {"a": "swap"}, 120)
    # stage 0 of 1F1B (F0 F1 B0 F2 B1 F3 B2 B3), micro-batches 0..2 swapped and 3 kept:
    # F0 110, F1 110 + 0, B0 100 + 0, F2 110, B1 100, F3 120 (kept) + 0, B2 100 + micro-batch
    # 3 at rest (100) = 200, B3 100
    plans = (swap, swap, swap, keep)
    stage_plan = StagePlan(0, PipelineSchedule("1f1b", 2, 4), plans, 200)
    result = ss.simulate_stage(g, stage_plan)
    assert [a.peak_bytes for a in result.actions] == [110, 110, 100, 110, 100, 120, 200, 100]
    assert result.fits and result.rest_bytes == (0, 0, 0, 100)
    checked = ss.validate_stage(g, stage_plan)
    assert checked.ok and checked.peak_bytes == 200


def test_the_planner_gives_a_micro_batch_its_own_plan_where_it_pays():
    """On a link of 50 bytes/s a swap of a stalls, so the plans that fit drop a and rerun A in
    the backward (1 s more a backward: 6 s). Stage 0 of 1F1B at a budget of 200: recomputing
    everywhere holds 110 and is busy 4 x 5 + 4 x 6 = 44 s. Micro-batch 3 may keep: F3 holds
    120 with nothing at rest, B2 holds 100 + micro-batch 3 at rest (100) = 200, and its
    backward takes 5 s: 43 s. Micro-batch 2 may not as well (F3 would hold 120 + 100)."""
    g = chain_graph()
    slow = LINK.with_link(name="test-slow", d2h_bytes_per_s=50.0, h2d_bytes_per_s=50.0)
    schedule = PipelineSchedule("1f1b", 2, 4)
    stage_plan = ss.plan_stage(g, 200, schedule, 0, slow)
    assert [p.decisions["a"] for p in stage_plan.plans] == ["recompute"] * 3 + ["keep"]
    result = ss.simulate_stage(g, stage_plan)
    assert result.peak_bytes == 200 and result.busy_s == pytest.approx(43.0)
    assert ss.validate_stage(g, stage_plan).ok
    # at 150 every micro-batch recomputes: 44 s
    tight = ss.plan_stage(g, 150, schedule, 0, slow)
    assert {p.decisions["a"] for p in tight.plans} == {"recompute"}
    assert ss.simulate_stage(g, tight).busy_s == pytest.approx(44.0)


def test_plan_stage_fits_the_whole_schedule_or_names_what_it_needs():
    g = chain_graph()
    schedule = PipelineSchedule("1f1b", 2, 4)
    stages = ss.plan_for_stages([g, g], 150, schedule, LINK)
    assert stages[0].plans[0].decisions["a"] == "swap"  # keep-all holds 220 on stage 0
    assert stages[1].plans[0].decisions["a"] == "keep"  # 120 fits on stage 1
    for stage_plan in stages:
        assert ss.validate_stage(g, stage_plan).ok
        assert ss.simulate_stage(g, stage_plan).peak_bytes <= 150
    assert ss.keep_all_stage_peak(g, schedule, 0, LINK) == 220
    with pytest.raises(ss.InfeasibleBudget, match="holds 110 bytes") as info:
        ss.plan_stage(g, 50, schedule, 0, LINK)
    assert info.value.min_budget_bytes == 110
    named = dataclasses.replace(g, extra={**g.extra, "pipeline_stage": 1})
    with pytest.raises(ValueError, match="is stage 1's, given as stage 0"):
        ss.plan_for_stages([named, g], 150, schedule, LINK)
    # an exact planner's option with the heuristic is refused, not ignored
    with pytest.raises(ValueError, match="work_s are the exact planner's options"):
        ss.plan_stage(g, 150, schedule, 0, LINK, work_s=5)
    with pytest.raises(ValueError, match="1 stage graphs for a schedule of 2"):
        ss.plan_for_stages([g], 150, schedule, LINK)


def test_a_stage_plan_travels_as_json():
    g = chain_graph()
    stage_plan = ss.plan_for_stages([g, g], 150, PipelineSchedule("1f1b", 2, 4), LINK)[0]
    again = StagePlan.from_dict(__import__("json").loads(stage_plan.to_json()))
    assert again == stage_plan
    interleaved = PipelineSchedule("interleaved-1f1b", 4, 2, stages_per_rank=2)
    rank_plan = StagePlan(2, interleaved, stage_plan.plans[:2], 300)
    assert StagePlan.from_json(rank_plan.to_json()) == rank_plan


@pytest.mark.slow  # four stages of GPT-2 XL, 12 layers each: about 17 s
def test_the_split_workload_plans_every_stage_within_its_budget():
    graphs = ss.workload_stages("gpt2-xl", 4, "a100-80gb-pcie4")
    # 48 layers: 12 each; the embedding on stage 0, the head and loss on stage 3, a received
    # activation (not to be rerun) at the start of the others
    assert [g.extra["layers"] for g in graphs] == [[0, 12], [12, 24], [24, 36], [36, 48]]
    assert graphs[1].ops[0].name == "recv" and not graphs[1].ops[0].recomputable
    schedule = PipelineSchedule("1f1b", 4, 8)
    peaks = [ss.keep_all_stage_peak(g, schedule, s) for s, g in enumerate(graphs)]
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3]  # 4, 3, 2, 1 micro-batches in flight
    budget = peaks[0] // 2
    stages = ss.plan_for_stages(graphs, budget, schedule)
    result = ss.simulate_pipeline(graphs, stages)
    assert result.fits
    for g, stage_plan, stage in zip(graphs, stages, result.stages):
        assert ss.validate_stage(g, stage_plan).peak_bytes == stage.peak_bytes <= budget
    assert result.step_s >= result.ideal_step_s


def test_messages_between_stages_take_the_link_when_the_hardware_says_so():
    from slackswap.core.stages import pipeline_messages

    # Stage 0 of 2 sends c on, 600 bytes, as C is reached, and receives its gradient as the
    # backward starts. On a link that collectives cross (100 bytes/s: 6 s each way):
    #   forward: A 0..1, B 1..2, C 2..5; the send, issued at 2 s, ends at 8 s: the forward
    #   action ends at 8 s (f = 8);
    #   backward: C 5..8, B 8..9, A 9..10; the gradient received 5..11: the step ends at 11 s,
    #   so g = 11 - 5 = 6.
    g = dataclasses.replace(chain_graph(), collectives=pipeline_messages("A", "C", 0, 600))
    on_link = LINK.with_link(name="test-link-comms", collectives_on_link=True)
    keep = ss.solve(g, 1.0, on_link, solver="keep-all")
    schedule = PipelineSchedule("1f1b", 2, 4)
    stage_plan = StagePlan(0, schedule, (keep,) * 4, 1000)
    stage = ss.simulate_stage(g, stage_plan)
    assert [a.duration_s for a in stage.actions[:3]] == pytest.approx([8.0, 8.0, 6.0])
    assert stage.busy_s == pytest.approx(4 * (8 + 6))
    assert ss.validate_stage(g, stage_plan).busy_s == pytest.approx(stage.busy_s)
    # stage 1 (receiving 600 bytes, sending their gradient) starts its F0 once stage 0's F0
    # has sent them: at 8 s, not 5 s
    receiver = dataclasses.replace(chain_graph(), collectives=pipeline_messages("A", "C", 600, 0))
    received = ss.solve(receiver, 1.0, on_link, solver="keep-all")
    plans = [stage_plan, StagePlan(1, schedule, (received,) * 4, 1000)]
    assert ss.simulate_pipeline([g, receiver], plans).starts[1][0] == pytest.approx(8.0)
    # on a link they do not cross (NVLink), they cost nothing, as FSDP2's collectives
    off = ss.simulate_stage(g, stage_plan, LINK)
    assert off.busy_s == pytest.approx(4 * (5 + 5))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    random_plans(),
    st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]),
    st.integers(1, 3),
    st.integers(1, 5),
    st.lists(st.integers(0, 200), min_size=7, max_size=7) | st.none(),
    st.tuples(st.integers(0, 300), st.integers(0, 300)) | st.none(),
    st.booleans(),
)
def test_the_checker_and_the_simulator_agree_on_every_stage(
    drawn, kind, stages, micro_batches, grads, messages, mixed
):
    """On random graphs and random keep/swap/recompute plans (with parameter gradients made in
    the step, or not; with the stage's messages on the link, or none), the checker's
    composition (its own walk of each step) and the simulator's give the same peak for every
    stage, and the same busy time."""
    from slackswap.core.stages import pipeline_messages

    g, p = drawn
    hw = None
    if messages is not None:
        sent = pipeline_messages(g.ops[0].name, g.ops[-1].name, *messages)
        g = dataclasses.replace(g, collectives=sent)
        # (the messages are no part of the plan's decisions or schedule: the same plan)
        p = dataclasses.replace(p, graph_digest=g.digest)
        hw = p.hardware.with_link(name="test-comms", collectives_on_link=True)
    if grads is not None:
        ops = tuple(
            dataclasses.replace(o, extra={**o.extra, "param_grad_bytes": grads[i]})
            for i, o in enumerate(g.ops)
        )
        g = dataclasses.replace(g, ops=ops, extra={**g.extra, "parameter_gradients": "made"})
    per_rank = 2 if kind == "interleaved-1f1b" else 1
    try:
        schedule = PipelineSchedule(kind, stages * per_rank, micro_batches, per_rank)
    except ValueError:  # micro-batches that interleaved 1F1B refuses, as torch does
        assume(False)
    # every other micro-batch keeping everything: a plan each
    keep = ss.solve(g, 1.0, p.hardware, solver="keep-all")
    plans = tuple(keep if mixed and m % 2 else p for m in range(micro_batches))
    for rank in range(schedule.ranks):
        mine = [StagePlan(s, schedule, plans, 1 << 60) for s in schedule.stages_of(rank)]
        simulated = ss.simulate_rank([g] * per_rank, mine, hw)
        checked = ss.validate_rank([g] * per_rank, mine, hw)
        assert checked.ok, checked.violations
        assert checked.peak_bytes == simulated.peak_bytes
        assert checked.busy_s == pytest.approx(simulated.busy_s, rel=1e-9, abs=1e-12)


# ---- a profiled model split into stages, and fit for a pipeline --------------------------------


def _llama_graph(layers=4):
    pytest.importorskip("transformers")
    from slackswap.runtime.hf_models import meta_model, training_batch

    model, config = meta_model(
        "llama",
        {
            "num_hidden_layers": layers,
            "hidden_size": 256,
            "intermediate_size": 688,
            "num_attention_heads": 4,
            "vocab_size": 4000,
        },
    )
    inputs, loss_fn = training_batch(config, 128, 2)
    return ss.profile(
        model, inputs, loss_fn, fake=True, hardware="a100-80gb-pcie4", gradients="held"
    )


def test_a_profiled_model_splits_into_stages_by_its_blocks():
    from slackswap.core.stages import split_stages

    g = _llama_graph(layers=4)
    parts = split_stages(g, 3)  # 4 blocks over 3 stages: 2, 1, 1
    regions = [{o.extra.get("module", "").split(".")[2] for o in p.ops if ".layers." in
                o.extra.get("module", "")} for p in parts]  # fmt: skip
    assert regions == [{"0", "1"}, {"2"}, {"3"}]
    # every op once, and a receiving op at the start of each later stage, which cannot rerun
    assert sum(p.n_ops for p in parts) == g.n_ops + 2
    for p in parts[1:]:
        assert p.ops[0].name == "recv" and not p.ops[0].recomputable
    assert parts[0].ops[0].name.startswith("model.embed_tokens")
    assert any("lm_head" in o.name for o in parts[-1].ops)
    # what a stage saves for its own backward is what the whole step saves there: the bytes of
    # the saved tensors add up, those received counted on the stage that reads them
    whole = int(g.tensor_bytes[g.saved].sum())
    split = sum(int(p.tensor_bytes[p.saved].sum()) for p in parts)
    received = sum(
        int(p.tensor_bytes[t]) for p in parts for t in p.saved
        if p.tensors[t].name.startswith("recv:")
    )  # fmt: skip
    assert split - received <= whole <= split
    # the model state by the stages' parameters: they add up to the whole model's
    state = g.extra["model_state"]
    for key in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
        assert sum(p.extra["model_state"][key] for p in parts) == pytest.approx(state[key], abs=3)
    with pytest.raises(ValueError, match="has 4 numbered blocks"):
        split_stages(g, 5)


def test_fit_answers_for_the_worst_stage(capsys):
    from slackswap.cli import main
    from slackswap.fit_stages import fit_stages

    g = _llama_graph(layers=4)
    roomy = fit_stages(g, stages=2, micro_batches=4)
    assert roomy.fits and [s.in_flight for s in roomy.stages] == [2, 1]
    assert roomy.stages[0].keep_all_peak_bytes > roomy.stages[1].keep_all_peak_bytes / 2
    # a device just above stage 0's model state and its smallest plan's peak, below its
    # keep-all: stage 0 fits only with a plan, and that plan holds no more than is left
    first = roomy.stages[0]
    tight = first.model_state_bytes + (first.keep_all_peak_bytes * 3) // 4
    report = fit_stages(g, stages=2, micro_batches=4, memory_bytes=tight)
    stage0 = report.stages[0]
    assert stage0.fits
    assert stage0.peak_bytes <= stage0.activation_memory_bytes < stage0.keep_all_peak_bytes
    assert stage0.plan.plans[0].count("keep") < len(stage0.plan.plans[0].decisions)
    # the last stage (the head's logits, 4000 wide) needs more than that device leaves it:
    # the answer is its
    assert not report.stages[1].fits and report.worst.stage == 1
    assert report.verdict.startswith("does not fit: stage 1: its activations need")
    tiny = fit_stages(g, stages=2, micro_batches=4, memory_bytes=first.model_state_bytes // 2)
    assert not tiny.fits and "model state alone" in tiny.verdict
    hf = json_config()
    argv = ["fit", "llama", "--hf-config", hf, "--seq", "128", "--batch", "2", "--solver",
            "heuristic", "--pipeline-stages", "2", "--micro-batches", "4"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "1f1b: 2 stages, 4 micro-batches" in printed and "verdict: fits" in printed
    assert main([*argv[:-2]]) == 2  # --pipeline-stages without --micro-batches
    assert "needs --micro-batches" in capsys.readouterr().err
    assert main([*argv, "--gradients", "made"]) == 2
    assert "accumulates its gradients" in capsys.readouterr().err
    with pytest.raises(ValueError, match="gradients='made'"):
        fit_stages(dataclasses.replace(g, extra={**g.extra, "parameter_gradients": "made"}),
                   stages=2, micro_batches=4)  # fmt: skip
    # interleaved 1F1B: 4 stages of one block on 2 ranks, each rank holding two stages' model
    # state and the micro-batches of both in flight
    interleaved = fit_stages(g, stages=4, micro_batches=4, schedule="interleaved-1f1b",
                             stages_per_rank=2)  # fmt: skip
    assert [f.stages for f in interleaved.stages] == [(0, 2), (1, 3)]
    parts = ss.split_stages(g, 4)
    for f in interleaved.stages:
        assert f.model_state_bytes == sum(
            parts[s].extra["model_state"]["total_bytes"] for s in f.stages
        )
        assert f.blocks == 2 and len(f.plans) == 2
    # rank 0: a warm-up of (V - 1) k + 2 (R - 1 - r) = 1 x 2 + 2 = 4 forwards, then a forward
    # before its first backward: 5 micro-batches in flight over its two stages
    assert interleaved.fits and interleaved.stages[0].in_flight == 5
    assert main([*argv[:-6], "--pipeline-stages", "4", "--micro-batches", "4", "--schedule",
                 "interleaved-1f1b", "--stages-per-rank", "2"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "interleaved-1f1b: 4 stages (2 a rank)" in printed and "  0,2  " in printed
    # the messages between stages on the host link: the predicted step grows by their time
    on_link = ss.hardware("a100-80gb-pcie4").with_link(
        name="a100-comms-on-link", collectives_on_link=True
    )
    linked = fit_stages(g, on_link, stages=2, micro_batches=4)
    assert linked.fits and linked.step_s > roomy.step_s
    assert main([*argv, "--collectives-on-link"]) == 0
    assert "verdict: fits" in capsys.readouterr().out


def json_config() -> str:
    import json

    return json.dumps(
        {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688,
         "num_attention_heads": 4, "vocab_size": 4000}
    )  # fmt: skip


def test_gradients_made_in_backward_stay_for_the_rest_of_the_schedule():
    """A graph profiled with gradients made in the step (zero_grad(set_to_none=True)): under a
    pipeline schedule they are made by the stage's first backward and stay, later backwards
    adding into them."""
    ops = [
        op("A", 1.0, 1.0, ["batch"], ["a"], param_grad_bytes=30),
        op("B", 1.0, 1.0, ["a"], ["b"], param_grad_bytes=20),
        op("C", 3.0, 3.0, ["b"], ["c"]),
    ]
    # what the profiler counts in each backward workspace (runtime/plain_step.py): backward C
    # nothing; backward B its 20; backward A the 20 made before and its 30 (a rebuild there: 20)
    ops[1]["backward_workspace_bytes"] = 20
    ops[0]["backward_workspace_bytes"] = 50
    ops[0]["rerun_workspace_bytes"] = 20
    g = graph(ops, [tensor("a", 100, ["B"]), tensor("b", 10), tensor("c", 10)])
    g = dataclasses.replace(g, extra={**g.extra, "parameter_gradients": "made"})
    keep = ss.solve(g, 1.0, LINK, solver="keep-all")
    # One step: forward 100, 110, 120; backward C 100, B 100 + 20 = 120, A 0 + 50 = 50. Once
    # the gradients exist (G = 50), a backward holds them and its own op's new ones: C 100 + 50,
    # B 100 + 20 + 50 = 170, A 0 + 30 + 50 = 80: 170. A forward holds G beside: 120 + 50.
    # Stage 0 of 1F1B: F0 120; F1 120 + 100 = 220; B0 (makes them) 120 + 100 = 220; F2 170 +
    # 100 = 270; B1 170 + 100 = 270; F3 270; B2 270; B3 170.
    stage_plan = StagePlan(0, PipelineSchedule("1f1b", 2, 4), (keep,) * 4, 10**6)
    result = ss.simulate_stage(g, stage_plan)
    assert [a.peak_bytes for a in result.actions] == [120, 220, 220, 270, 270, 270, 270, 170]
    assert ss.validate_stage(g, stage_plan).peak_bytes == 270
