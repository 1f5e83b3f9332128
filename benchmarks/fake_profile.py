"""Plan models this machine cannot run: fake profiles at full scale, and the seed's workloads
profiled from their Hugging Face configs beside the analytic graphs.

Part 1: Llama-2-7B's config at sequence 4096, batch 1 (bf16, SDPA), built on the meta device and
profiled with ``profile(fake=True)`` for the A100 80GB preset: time and peak resident memory of
the profile, the graph, and plans at 50% of the keep-all peak (heuristic, default solver). Then
Llama-2-70B's config at the same shape: the profile alone.

Part 2: BERT-Large, GPT-2 XL and the Llama-7B-like model at the seed's shapes
(shared/reference.md), profiled fake from their HF configs, beside ``slackswap.workload``'s
analytic graphs: keep-all peak, saved bytes, ideal step, retention at 50%.

    python benchmarks/fake_profile.py [--time-limit 60] [--json benchmarks/results/fake_profile.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch
import transformers

import slackswap as ss
from slackswap.runtime.hf_models import meta_model, training_batch

HW = "a100-80gb-pcie4"
GIB = 2**30


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def llama2(size: str) -> dict:
    if size == "7b":
        return {
            "num_hidden_layers": 32,
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "intermediate_size": 11008,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
        }
    return {
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    }


def full_scale(time_limit: float) -> list[dict]:
    rows = []
    for size in ("7b", "70b"):
        start = time.perf_counter()
        model, config = meta_model("llama", llama2(size))
        inputs, loss_fn = training_batch(config, 4096, 1)
        built = time.perf_counter() - start
        start = time.perf_counter()
        g = ss.profile(model, inputs, loss_fn, fake=True, hardware=HW, name=f"llama-2-{size}")
        row = {
            "model": f"llama-2-{size}",
            "seq": 4096,
            "batch": 1,
            "build_s": built,
            "profile_s": time.perf_counter() - start,
            "peak_rss_gib": rss_gib(),
            "ops": g.n_ops,
            "saved": len(g.saved),
            "saved_bytes": int(g.tensor_bytes[g.saved].sum()),
            "keep_all_bytes": ss.keep_all_peak(g, HW),
            "ideal_step_s": g.ideal_step_time_s,
            "model_state": g.extra["model_state"],
        }
        print(
            f"{row['model']}: built {built:.1f} s, profiled fake in {row['profile_s']:.1f} s, "
            f"peak RSS {row['peak_rss_gib']:.2f} GiB; {g.summary()}; ideal step "
            f"{1e3 * g.ideal_step_time_s:.0f} ms"
        )
        if size == "7b":
            for solver in ("heuristic", "cpsat"):
                start = time.perf_counter()
                plan = ss.solve(g, 0.5, HW, solver=solver, time_limit_s=time_limit)
                sim = ss.simulate(g, plan)
                row[solver] = {
                    "solve_s": time.perf_counter() - start,
                    "status": plan.info.status,
                    "retention": sim.retention,
                    "checker_ok": ss.validate(g, plan).ok,
                    "counts": {d: plan.count(d) for d in ("keep", "swap", "recompute")},
                }
                print(
                    f"  50% with {solver}: {plan.info.status}, {100 * sim.retention:.2f}% of "
                    f"ideal, {row[solver]['solve_s']:.1f} s"
                )
        rows.append(row)
    return rows


def seed_models():
    """(workload name, model on meta, inputs, loss_fn) at the seed's shapes, bf16."""
    with torch.device("meta"):
        bert = transformers.BertModel(
            transformers.BertConfig(
                num_hidden_layers=24,
                hidden_size=1024,
                num_attention_heads=16,
                intermediate_size=4096,
                max_position_embeddings=512,
            ),
            add_pooling_layer=False,
        )
    bert.config._attn_implementation = "sdpa"
    ids = torch.zeros((32, 512), dtype=torch.long)
    yield (
        "bert-large",
        bert.to(torch.bfloat16).train(),
        {"input_ids": ids},
        lambda o: o.last_hidden_state.float().pow(2).mean(),
    )  # no head, as the seed
    gpt2, config = meta_model(
        "gpt2", {"n_layer": 48, "n_embd": 1600, "n_head": 25, "n_positions": 1024}
    )
    yield ("gpt2-xl", gpt2, *training_batch(config, 1024, 8))
    llama, config = meta_model("llama", {"max_position_embeddings": 2048})
    yield ("llama-7b", llama, *training_batch(config, 2048, 4))


def seed_rows(time_limit: float) -> list[dict]:
    rows = []
    for name, model, inputs, loss_fn in seed_models():
        start = time.perf_counter()
        fake = ss.profile(model, inputs, loss_fn, fake=True, hardware=HW, name=f"{name}-hf")
        took = time.perf_counter() - start
        row = {"model": name, "profile_s": took}
        for kind, g in (("analytic", ss.workload(name, HW)), ("fake", fake)):
            plan = ss.solve(g, 0.5, HW, time_limit_s=time_limit)
            row[kind] = {
                "ops": g.n_ops,
                "saved": len(g.saved),
                "saved_bytes": int(g.tensor_bytes[g.saved].sum()),
                "keep_all_bytes": ss.keep_all_peak(g, HW),
                "ideal_step_s": g.ideal_step_time_s,
                "retention_50": ss.simulate(g, plan).retention,
                "status": plan.info.status,
            }
        print(
            f"{name}: profiled fake in {took:.1f} s; "
            + "; ".join(
                f"{k}: {row[k]['ops']} ops, saved {row[k]['saved_bytes'] / GIB:.2f} GiB, keep-all "
                f"{row[k]['keep_all_bytes'] / GIB:.2f} GiB, ideal {1e3 * row[k]['ideal_step_s']:.0f} ms, "
                f"50%: {100 * row[k]['retention_50']:.2f}% ({row[k]['status']})"
                for k in ("analytic", "fake")
            )
        )
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/fake_profile.json"))
    parser.add_argument(
        "--report",
        action="store_true",
        help="write the RESULTS.md section from --json, run nothing",
    )
    args = parser.parse_args()
    if args.report:
        figures = json.loads(args.json.read_text())
        return report(figures["full_scale"], figures["seed"], "python benchmarks/fake_profile.py")
    scale = full_scale(args.time_limit)
    seeds = seed_rows(args.time_limit)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"full_scale": scale, "seed": seeds}, indent=1))
    from results_md import command_line

    return report(scale, seeds, command_line())


WHY = """
Where the two differ, and why (2-layer fake profiles at the same shapes, saved bytes by module):
the analytic graphs count the per-block inventory of shared/reference.md (Korthikanti et al.,
fused kernels); the fake profiles count what the HF models' eager aten ops save.
BERT-Large agrees within 7% (13.65 against 12.80 GiB): its extra is the dropout masks, which
the CPU's dropout draws into a bf16 tensor (2 bytes an element; the analytic graph counts the
1-byte mask a GPU's fused dropout keeps, so the fake profile overcounts there until it fakes the
CUDA kernels), and the loss's fp32 copy of the output. GPT-2 XL saves 1.9x the analytic bytes: HF's `gelu_new` is
written in Python (`0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`), and its eager
ops save four tensors of the FFN's width where a fused GELU saves one (400 MiB per layer at this
shape, against 100), and the LM head's loss upcasts 8 x 1024 x 50,257 logits to fp32 and saves
their log-softmax (1.5 GiB). The Llama-7B-like model saves 1.4x: HF's RMSNorm computes in fp32
and saves its fp32 input and normalised output (256 MiB per norm against the analytic 64), and
its loss saves the fp32 log-softmax of the logits. The ideal steps differ less (1.09-1.44x): the
extra ops are memory-bound elementwise work. At 50% of their own (larger) keep-all peaks the
fake graphs retain 94.1-99.1% of ideal against 96.6-99.6% for the analytic ones: more bytes
per FLOP to move or rebuild. Which is right for a user is the fake profile, of the model they
run; the analytic graphs are the seed's setting, for comparison with its figures.
"""


def report(scale: list[dict], seeds: list[dict], command: str) -> int:
    from results_md import markdown_table, write_section

    body = markdown_table(
        [
            "model (bf16, seq 4096, batch 1)",
            "fake profile s",
            "peak RSS GiB",
            "ops",
            "saved GiB",
            "keep-all GiB",
            "ideal step ms",
            "50%: heuristic",
            "50%: cpsat (default)",
        ],
        [
            [
                r["model"],
                f"{r['profile_s']:.1f}",
                f"{r['peak_rss_gib']:.2f}",
                r["ops"],
                f"{r['saved_bytes'] / GIB:.2f}",
                f"{r['keep_all_bytes'] / GIB:.2f}",
                f"{1e3 * r['ideal_step_s']:.0f}",
            ]
            + [
                f"{100 * r[s]['retention']:.2f}% ({r[s]['status']}, {r[s]['solve_s']:.1f} s)"
                if s in r
                else "-"
                for s in ("heuristic", "cpsat")
            ]
            for r in scale
        ],
    )
    body += (
        "\n\nBuilt on the meta device from the Llama-2 configs, profiled for "
        f"`{HW}` (`profile(fake=True)`: no weights, no activation memory); peak RSS is the "
        "whole process's, 70B after 7B.\n\n"
    )
    body += markdown_table(
        [
            "seed workload",
            "graph",
            "ops",
            "saved GiB",
            "keep-all GiB",
            "ideal step ms",
            "retention at 50% (cpsat)",
        ],
        [
            [
                r["model"],
                kind,
                r[kind]["ops"],
                f"{r[kind]['saved_bytes'] / GIB:.2f}",
                f"{r[kind]['keep_all_bytes'] / GIB:.2f}",
                f"{1e3 * r[kind]['ideal_step_s']:.0f}",
                f"{100 * r[kind]['retention_50']:.2f}% ({r[kind]['status']})",
            ]
            for r in seeds
            for kind in ("analytic", "fake")
        ],
    )
    body += (
        "\n\n`analytic`: `slackswap.workload` (shared/reference.md's per-block inventory); "
        "`fake`: the HF model's own aten ops at the same shapes (BERT-Large without a head, "
        "GPT-2 XL and Llama with their LM heads and the model's own loss), times from the "
        "cost model (formulations/cost-model.md).\n" + WHY
    )
    write_section(
        "fake_profile", "Fake profiles: full-scale models and the seed workloads", command, body
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
