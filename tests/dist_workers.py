"""What each of the 2 gloo processes runs in tests/test_distributed.py (importable by the
spawned children): distributed training with and without a plan, written to JSON for the parent."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import slackswap as ss

STEPS = 3
HW = "cpu-emulated-link"


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "gpt":
        from models import TinyGPT

        model = TinyGPT(vocab=50, d=32, layers=2, p=0.1)
        blocks = list(model.blocks)
        loss_fn = lambda out: out.logsumexp(-1).mean()  # noqa: E731
        vocab = 50
    else:
        import transformers

        cfg = transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=100,
            max_position_embeddings=32,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = transformers.LlamaForCausalLM(cfg)
        blocks = list(model.model.layers)
        loss_fn = lambda out: out.logits.pow(2).mean()  # noqa: E731
        vocab = 100
    model.train()
    return model, blocks, loss_fn, vocab


def _wrap(model, blocks, wrapping: str):
    if wrapping == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if wrapping == "none":
        return model
    from torch.distributed.fsdp import fully_shard

    reshard = wrapping == "fsdp-reshard"
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def _batch(kind: str, vocab: int, rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    ids = torch.randint(0, vocab, (2, 8), generator=g)
    return ids if kind == "gpt" else {"input_ids": ids}


def _call(model, batch):
    return model(**batch) if isinstance(batch, dict) else model(batch)


def _local_grads(model) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        g = p.grad
        if g is None:
            out.append(None)
            continue
        out.append((g.to_local() if hasattr(g, "to_local") else g).detach().clone())
    return out


def _random_plan(graph, budget: int, seed: int):
    """Random keep / swap / recompute (the same on every rank), respecting what may be rebuilt
    and RNG groups."""
    import numpy as np

    rng = np.random.default_rng(seed)
    decisions = {}
    for t in graph.saved:
        choices = ["keep", "swap"] + (["recompute"] if graph.can_recompute[t] else [])
        decisions[graph.tensors[int(t)].name] = str(rng.choice(choices))
    for members in graph.rng_groups.values():
        names = [graph.tensors[int(m)].name for m in members]
        if any(decisions[n] != "recompute" for n in names):
            for n in names:
                if decisions[n] == "recompute":
                    decisions[n] = "keep"
    return ss.complete(ss.Plan(graph.name, graph.digest, budget, decisions), graph, HW)


def train(kind: str, wrapping: str, variant: str, rank: int) -> dict:
    """3 steps of SGD; per step every local gradient; with a plan, its tracked and simulated
    peaks."""
    model, blocks, loss_fn, vocab = _model(kind)
    model = _wrap(model, blocks, wrapping)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result: dict = {"grads": []}
    plan = graph = None
    if variant != "plain":
        batch = _batch(kind, vocab, 0, 0)  # every rank profiles the same shapes
        solver = {
            "keep-all": "keep-all",
            "heuristic": "heuristic",
            "exact": "cpsat",
            "random": "heuristic",
        }[variant]
        graph = ss.profile(model, batch, loss_fn, warmup=1, repeat=1)
        lo, hi = ss.min_budget(graph, HW), ss.keep_all_peak(graph, HW)
        # as fractions of the agreed graph's own keep-all peak: each profile measures what the
        # step holds beside its tensors afresh, and DDP's buckets are rebuilt after the first
        # backward (half way from the smallest to keep-all, as this profile has them)
        budget = 1.0 if variant == "keep-all" else (lo + (hi - lo) / 2) / hi
        graph, plan = ss.plan_for_ranks(
            model,
            batch,
            loss_fn,
            budget,
            HW,
            solver=solver,
            time_limit_s=5,
            profile_options={"warmup": 1, "repeat": 1},
        )
        budget = plan.budget_bytes
        if variant == "random":  # closed at the budget it needs, so it is a valid plan
            plan = _random_plan(graph, budget, seed=7)
            budget = ss.simulate(graph, plan, HW).peak_bytes
            plan = _random_plan(graph, budget, seed=7)
        result.update(
            budget=budget,
            simulated_peak=ss.simulate(graph, plan, HW).tensor_peak_bytes,
            saved_bytes=sorted(int(graph.tensor_bytes[t]) for t in graph.saved),
            valid=ss.validate(graph, plan).ok,
            digest=plan.graph_digest,
            recomputed=sum(d == "recompute" for d in plan.decisions.values()),
            collectives=[[c.name, c.phase, c.d2h_bytes, c.h2d_bytes] for c in graph.collectives],
            root_tensors=[t.name for t in graph.tensors if t.name.split("#")[0] == "model"],
        )
    peaks = []
    for step in range(STEPS):
        torch.manual_seed(1000 + step)
        opt.zero_grad(set_to_none=True)
        batch = _batch(kind, vocab, rank, step)
        if plan is None:
            loss_fn(_call(model, batch)).backward()
        else:
            with ss.apply(plan, model, graph=graph) as run:
                loss_fn(_call(model, batch)).backward()
            peaks.append(run.stats.peak_activation_bytes)
        result["grads"].append(_local_grads(model))
        opt.step()
    result["tracked_peaks"] = peaks
    return result


def run_case(
    rank: int, world: int, port: int, kind: str, wrapping: str, variants: list[str], out_dir: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict = {}
    try:
        plain = train(kind, wrapping, "plain", rank)
        unwrapped = None
        for variant in variants:
            got = train(kind, wrapping, variant, rank)
            same = all(
                (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                for ref_step, got_step in zip(plain["grads"], got["grads"])
                for a, b in zip(ref_step, got_step)
            )
            out[variant] = {k: v for k, v in got.items() if k != "grads"}
            out[variant]["grads_equal"] = same
            out[variant]["n_grads"] = sum(g is not None for g in got["grads"][0])
        if rank == 0:
            model, _, loss_fn, vocab = _model(kind)
            unwrapped = ss.profile(model, _batch(kind, vocab, 0, 0), loss_fn, warmup=1, repeat=1)
            out["unwrapped_saved_bytes"] = sorted(
                int(unwrapped.tensor_bytes[t]) for t in unwrapped.saved
            )
            out["parameter_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    except Exception:  # noqa: BLE001 - reported to the parent
        out["error"] = traceback.format_exc()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        # torch's DDP leaves reference cycles behind: torn down at interpreter exit they abort
        # the process ("terminate called without an active exception"), about one run in seven
        # here with plain DDP training alone; collected while the process group is up, they do not
        gc.collect()
        dist.destroy_process_group()


def mismatch_case(rank: int, world: int, port: int, fault: str, out_dir: str) -> None:
    """``fault`` "shapes": rank 1 profiles another batch size; "crash": rank 1's forward raises
    (rank 0 then waits in DDP's gradient all-reduce until the job's own timeout, 10 s here)."""
    import datetime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=10)
    )
    out: dict = {}
    try:
        model, blocks, loss_fn, vocab = _model("gpt")
        model = _wrap(model, blocks, "ddp")
        batch = _batch("gpt", vocab, 0, 0)
        if rank == 1 and fault == "shapes":
            batch = torch.cat([batch, batch])
        if rank == 1 and fault == "crash":

            def broken(module, args):
                raise ValueError("a user's bug in forward")

            model.module.blocks[1].register_forward_pre_hook(broken)
        if rank == 1 and fault == "late":
            time.sleep(6)  # past rank 0's timeout_s: it gives up first
        ss.plan_for_ranks(
            model,
            batch,
            loss_fn,
            0.9,
            HW,
            timeout_s=3 if fault == "late" else 60,
            profile_options={"warmup": 0, "repeat": 1},
        )
        out["error"] = None
    except Exception as exc:  # noqa: BLE001 - what every rank raised is the point
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["trace"] = traceback.format_exc()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


def mixed_policy_case(rank: int, world: int, port: int, out_dir: str) -> None:
    """One AdamW step of a tiny HF Llama under ``fully_shard`` with FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bfloat16)``: what torch allocates on this rank (local
    shards of parameters, gradients and moments), the dtype the forward sees its parameters in,
    and the profile of the sharded step (its saved tensors) for the parent to compare with
    slackswap's "fsdp-mixed" regime."""
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict = {}
    try:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MIXED_POLICY_CONFIG))
        model.train()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for block in model.model.layers:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        seen: list[str] = []
        # inside a unit's forward, its modules hold the gathered parameters
        model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(
            lambda module, _: seen.append(str(module.weight.dtype))
        )
        ids = torch.randint(0, MIXED_POLICY_CONFIG["vocab_size"], (2, 16))
        batch = {"input_ids": ids, "labels": ids}
        graph = ss.profile(model, batch, lambda o: o.loss, precision="fsdp-mixed")
        out["saved_bytes"] = sorted(int(graph.tensor_bytes[t]) for t in graph.saved)
        out["profile_state"] = graph.extra["model_state"]
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        opt.step()

        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t

        def nbytes(ts):
            return sum(local(t).numel() * local(t).element_size() for t in ts)

        params = list(model.parameters())
        state = [
            t
            for s in opt.state.values()
            for k, t in s.items()
            if torch.is_tensor(t) and k != "step"
        ]
        out.update(
            parameter_bytes=nbytes(params),
            gradient_bytes=nbytes(p.grad for p in params),
            optimizer_state_bytes=nbytes(state),
            dtypes=sorted({str(local(t).dtype) for t in params + [p.grad for p in params] + state}),
            gathered_dtypes=sorted(set(seen)),
        )
    except Exception:  # noqa: BLE001 - reported to the parent
        out["error"] = traceback.format_exc()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


MIXED_POLICY_CONFIG = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 64,
}


class PipelineStageModule(torch.nn.Module):
    """Stage ``stage`` of ``stages`` of a TinyGPT: the embedding on the first, an equal share of
    the blocks, the final norm and head on the last."""

    def __init__(self, full, stage: int, stages: int):
        super().__init__()
        per = len(full.blocks) // stages
        self.emb = full.emb if stage == 0 else None
        self.blocks = torch.nn.ModuleList(full.blocks[stage * per : (stage + 1) * per])
        self.ln = full.ln if stage == stages - 1 else None
        self.head = full.head if stage == stages - 1 else None

    def forward(self, x):
        if self.emb is not None:
            x = self.emb(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)) if self.head is not None else x


PIPELINE_MICRO_BATCHES = 4


def _pipeline_loss(out, target):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def _pipeline_train(rank: int, world: int, kind: str, planned: bool) -> dict:
    """Three steps of ``kind`` (gpipe, 1f1b) on this rank's stage of a 4-block TinyGPT; the
    first initializes torch's schedule (its shape inference runs a forward and a backward of
    its own), the next two run under the stage's plan when ``planned``. Their gradients are
    returned."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    from models import TinyGPT

    full = TinyGPT(vocab=50, d=32, layers=4, p=0.1)
    module = PipelineStageModule(full, rank, world)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    runs = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind]
    schedule = runs(stage, PIPELINE_MICRO_BATCHES, loss_fn=_pipeline_loss)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 50, (8, 16), generator=g)
    y = torch.randint(0, 50, (8, 16), generator=g)
    out: dict = {"grads": []}
    context = None
    if planned:
        per_batch = x.shape[0] // PIPELINE_MICRO_BATCHES
        if rank == 0:
            example = x[:per_batch]
        else:
            example = torch.randn(per_batch, 16, 32, requires_grad=True)
        if rank == world - 1:

            def loss_fn(o):
                return _pipeline_loss(o, y[:per_batch])

        else:

            def loss_fn(o):
                return o.sum()  # (its backward saves nothing: the stage's own saves stand)

        graph = ss.profile(module, example, loss_fn, warmup=1, repeat=1)
        pipeline = ss.PipelineSchedule(kind, world, PIPELINE_MICRO_BATCHES)
        # torch's schedule keeps each micro-batch's output for its backward, and the last
        # stage's to return them merged at the step's end
        with torch.no_grad():
            output = module(example).untyped_storage().nbytes()
        held = {"held_bytes": output, "returned_bytes": output if rank == world - 1 else 0}
        low = ss.smallest_stage_peak(graph, pipeline, rank, HW, **held)
        high = ss.keep_all_stage_peak(graph, pipeline, rank, HW, **held)
        stage_plan = ss.plan_stage(graph, (low + high) // 2, pipeline, rank, HW, **held)
        simulated = ss.simulate_stage(graph, stage_plan)
        out.update(
            swapped=stage_plan.plans[0].count("swap"),
            recomputed=stage_plan.plans[0].count("recompute"),
            valid=ss.validate_stage(graph, stage_plan).ok,
            simulated_peak=simulated.peak_bytes,
            simulated_tensor_peak=simulated.tensor_peak_bytes,
            budget=stage_plan.budget_bytes,
        )
        # every step traced, so that the executor tracks every micro-batch's tensors at once
        context = ss.apply(stage_plan.plans[0], module, graph=graph, trace_every_step=True)
    for step in range(3):
        torch.manual_seed(100 + step)
        module.zero_grad(set_to_none=True)

        def run():
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y)
            else:
                schedule.step()

        if context is not None and step > 0:
            with context as applied:
                run()
            out.setdefault("tracked_peaks", []).append(applied.stats.peak_activation_bytes)
        else:
            run()
        if step > 0:
            out["grads"].append(_local_grads(module))
    return out


def _plain_against_planned(rank: int, world: int, port: int, out_dir: str, train) -> None:
    """``train(planned)`` run plainly, then under the plans: the planned run's report and
    whether its gradients equal the plain run's, written for the parent."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict = {}
    try:
        plain = train(False)
        planned = train(True)
        out = {k: v for k, v in planned.items() if k != "grads"}
        out["grads_equal"] = all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for ref, got in zip(plain["grads"], planned["grads"])
            for a, b in zip(ref, got)
        )
        out["n_grads"] = sum(g is not None for g in planned["grads"][0])
    except Exception:  # noqa: BLE001 - reported to the parent
        out["error"] = traceback.format_exc()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


def pipeline_case(rank: int, world: int, port: int, kind: str, out_dir: str) -> None:
    """This rank's stage trained plainly and under its stage plan: are the gradients equal?"""
    _plain_against_planned(
        rank, world, port, out_dir, lambda planned: _pipeline_train(rank, world, kind, planned)
    )


def _moved_bytes(graph, plan) -> tuple[int, int]:
    """(swapped, recomputed) bytes of one micro-batch's step under ``plan``."""
    out = [0, 0]
    for name, d in plan.decisions.items():
        if d in ("swap", "recompute"):
            out[d == "recompute"] += int(graph.tensors[graph.tensor_index[name]].bytes)
    return out[0], out[1]


def _interleaved_train(rank: int, world: int, planned: bool, mixed: bool) -> dict:
    """Three steps of ScheduleInterleaved1F1B on this rank's two stages of a 4-block TinyGPT
    (stages rank and rank + world); the first initializes torch's schedule, the next two run
    under the rank's plans (``plan_rank``) when ``planned``: with ``mixed``, every odd
    micro-batch keeps everything (a plan each) at the rank's keep-all budget."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    torch.manual_seed(0)
    from models import TinyGPT

    stages = 2 * world
    full = TinyGPT(vocab=50, d=32, layers=stages, p=0.1)
    mine = (rank, rank + world)
    modules = [PipelineStageModule(full, s, stages) for s in mine]
    pipes = [PipelineStage(m, s, stages, torch.device("cpu")) for m, s in zip(modules, mine)]
    schedule = ScheduleInterleaved1F1B(pipes, PIPELINE_MICRO_BATCHES, loss_fn=_pipeline_loss)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 50, (8, 16), generator=g)
    y = torch.randint(0, 50, (8, 16), generator=g)
    out: dict = {"grads": []}
    contexts = []
    if planned:
        per_batch = x.shape[0] // PIPELINE_MICRO_BATCHES
        graphs, held, returned = [], [], []
        receive_buffers = 0
        for s, module in zip(mine, modules):
            example = (
                x[:per_batch] if s == 0 else torch.randn(per_batch, 16, 32, requires_grad=True)
            )
            if s == stages - 1:

                def loss_fn(o):
                    return _pipeline_loss(o, y[:per_batch])

            else:

                def loss_fn(o):
                    return o.sum()

            graphs.append(ss.profile(module, example, loss_fn, warmup=1, repeat=1))
            with torch.no_grad():
                output = module(example).untyped_storage().nbytes()
            held.append(output)
            returned.append(output if s == stages - 1 else 0)
            # torch's stage allocates a receive buffer per micro-batch (a later stage's input)
            # that the stage model does not count
            receive_buffers += PIPELINE_MICRO_BATCHES * example.untyped_storage().nbytes() * (s > 0)
        pipeline = ss.PipelineSchedule(
            "interleaved-1f1b", stages, PIPELINE_MICRO_BATCHES, stages_per_rank=2
        )
        kw = {"held_bytes": held, "returned_bytes": returned}
        low = ss.smallest_rank_peak(graphs, pipeline, rank, HW, **kw)
        high = ss.keep_all_rank_peak(graphs, pipeline, rank, HW, **kw)
        stage_plans = ss.plan_rank(graphs, (low + high) // 2, pipeline, rank, HW, **kw)
        if mixed:
            keeps = [ss.solve(gr, 1.0, HW, solver="keep-all") for gr in graphs]
            stage_plans = [
                ss.StagePlan(
                    sp.stage,
                    pipeline,
                    tuple(k if m % 2 else sp.plans[m] for m in range(PIPELINE_MICRO_BATCHES)),
                    high,
                    sp.held_bytes,
                    sp.returned_bytes,
                )
                for sp, k in zip(stage_plans, keeps)
            ]
        simulated = ss.simulate_rank(graphs, stage_plans)
        out.update(
            moved=sum(
                sum(_moved_bytes(gr, p)) for gr, sp in zip(graphs, stage_plans) for p in sp.plans
            ),
            expected_moved=[
                sum(_moved_bytes(gr, p)[i] for p in sp.plans)
                for gr, sp in zip(graphs, stage_plans)
                for i in (0, 1)
            ],
            valid=ss.validate_rank(graphs, stage_plans).ok,
            simulated_peak=simulated.peak_bytes,
            budget=stage_plans[0].budget_bytes,
        )
        # the rank's two contexts track together: their peak is the rank's
        contexts = []
        for sp, module, gr in zip(stage_plans, modules, graphs):
            tracked = contexts[0] if contexts else None
            contexts.append(
                ss.apply(sp, module, graph=gr, trace_every_step=True, tracked_with=tracked)
            )
        out["simulated_tensor_peak"] = simulated.tensor_peak_bytes
        out["receive_buffers"] = receive_buffers
    for step in range(3):
        torch.manual_seed(100 + step)
        for module in modules:
            module.zero_grad(set_to_none=True)

        def run():
            # rank 0 runs the first stage, the last rank the last
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y)
            else:
                schedule.step()

        if contexts and step > 0:
            with contextlib.ExitStack() as stack:
                applied = [stack.enter_context(c) for c in contexts]
                run()
            out.setdefault("done_moved", []).append(
                [v for a in applied for v in (a.stats.swapped_out_bytes, a.stats.recomputed_bytes)]
            )
            out.setdefault("tracked_peaks", []).append(
                max(a.stats.peak_activation_bytes for a in applied)
            )
        else:
            run()
        if step > 0:
            out["grads"].append([g for m in modules for g in _local_grads(m)])
    return out


def interleaved_case(rank: int, world: int, port: int, mixed: bool, out_dir: str) -> None:
    """This rank's two stages trained plainly and under their plans: are the gradients
    equal?"""
    _plain_against_planned(
        rank,
        world,
        port,
        out_dir,
        lambda planned: _interleaved_train(rank, world, planned, mixed and planned),
    )
