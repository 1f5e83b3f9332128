"""``ss.planned`` on Hugging Face models on CPU: a swap plan at half the keep-all peak against
plain training, and its gradients against plain training's.

    python benchmarks/executor_hf.py [--rounds 7] [--block 10] [--layers 4] [--width 256]
        [--seq 128] [--batch 4] [--json benchmarks/results/executor_hf.json]

HF GPT-2 and Llama built from their configs (``--layers`` layers, width ``--width``, heads of
64, dropout as the config has it), trained with their own loss (``labels=``) under
``ss.planned(model, loss_fn, 0.5, "cpu-emulated-link", refine_solver=None)``: the heuristic's
plan for half of each bucket's keep-all peak on the emulated host link, whose copies run on the
calling thread. Every figure is the median of paired rounds (``--block`` plain steps, then
``--block`` planned steps, back to back); the planned step's time is given with its copies and
with the time inside the lanes' copy calls (``RunStats.copy_s``: on the emulated link, the
copies themselves) subtracted. Gradients: the same model trained plainly and under the loop
from one state, three steps, every parameter's gradient compared bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import slackswap as ss

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_md import command_line, markdown_table, write_section  # noqa: E402

HW = "cpu-emulated-link"


def build(family: str, layers: int, width: int):
    import transformers

    common = {
        "num_hidden_layers" if family == "llama" else "n_layer": layers,
        "vocab_size": 1000,
    }
    if family == "gpt2":
        config = transformers.GPT2Config(
            n_embd=width, n_head=width // 64, n_positions=1024, **common
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            hidden_size=width,
            intermediate_size=int(width * 8 / 3) // 64 * 64,
            num_attention_heads=width // 64,
            max_position_embeddings=1024,
            **common,
        )
        model = transformers.LlamaForCausalLM(config)
    config.use_cache = False
    return model.train()


def batch(step: int, args) -> dict:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 1000, (args.batch, args.seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def loss_fn(out):
    return out.loss


def grads(model) -> list:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def same_gradients(family: str, args) -> bool:
    """Three steps from one state, plainly and under the loop: every gradient equal."""
    torch.manual_seed(0)
    plain = build(family, args.layers, args.width)
    planned_model = copy.deepcopy(plain)
    expected = []
    for step in range(3):
        torch.manual_seed(100 + step)
        plain.zero_grad(set_to_none=True)
        loss_fn(plain(**batch(step, args))).backward()
        expected.append(grads(plain))
    got = []
    with ss.planned(planned_model, loss_fn, 0.5, HW, refine_solver=None) as loop:
        for step in range(3):
            torch.manual_seed(100 + step)
            planned_model.zero_grad(set_to_none=True)
            loop.step(batch(step, args))
            got.append(grads(planned_model))
    return all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for e, g in zip(expected, got)
        for a, b in zip(e, g)
    )


def measure(family: str, args) -> dict:
    torch.manual_seed(0)
    model = build(family, args.layers, args.width)
    inputs = batch(0, args)

    def plain_block():
        for _ in range(args.block):
            model.zero_grad(set_to_none=True)
            loss_fn(model(**inputs)).backward()

    with ss.planned(model, loss_fn, 0.5, HW, refine_solver=None) as loop:

        def planned_block():
            copies = 0.0  # each step enters the plan's context afresh, with its own stats
            for _ in range(args.block):
                model.zero_grad(set_to_none=True)
                loop.step(inputs)
                copies += loop.last_stats.copy_s
            return copies

        plain_block(), planned_block()  # the first planned step profiles and plans
        rounds = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            plain_block()
            a = time.perf_counter() - start
            start = time.perf_counter()
            copies = planned_block()
            b = time.perf_counter() - start
            rounds.append((a, b, copies))
        plan, graph = loop.plan_for(inputs), loop.graph_for(inputs)
        stats = loop.last_stats
    assert plan is not None and graph is not None
    keep_all = ss.keep_all_peak(graph, HW)
    per = args.block
    return {
        "family": family,
        "forward_ops": int(graph.n_ops),
        "saved_tensors": int(len(graph.saved)),
        "swapped": plan.count("swap"),
        "recomputed": plan.count("recompute"),
        "budget_bytes": int(plan.budget_bytes),
        "keep_all_peak_bytes": int(keep_all),
        "plain_step_s": statistics.median(a for a, _, _ in rounds) / per,
        "planned_step_s": statistics.median(b for _, b, _ in rounds) / per,
        "planned_over_plain": statistics.median(b / a for a, b, _ in rounds),
        "planned_over_plain_copies_excluded": statistics.median((b - c) / a for a, b, c in rounds),
        "copies_s_per_step": statistics.median(c for _, _, c in rounds) / per,
        "hooked_steps": int(stats.hooked_steps),
        "gradients_bit_identical": same_gradients(family, args),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--families", default="gpt2,llama")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/executor_hf.json"))
    args = parser.parse_args()
    rows = []
    for family in args.families.split(","):
        row = measure(family, args)
        rows.append(row)
        print(
            f"{family}: plain {1e3 * row['plain_step_s']:.1f} ms, planned "
            f"{1e3 * row['planned_step_s']:.1f} ms ({row['planned_over_plain']:.3f}x; "
            f"{row['planned_over_plain_copies_excluded']:.3f}x copies excluded), "
            f"{row['swapped']} swapped / {row['recomputed']} recomputed of "
            f"{row['saved_tensors']}, gradients bit-identical: {row['gradients_bit_identical']}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    write_section(
        "executor_hf",
        f"ss.planned on HF models, CPU ({args.layers} layers, width {args.width}, seq "
        f"{args.seq}, batch {args.batch}, half the keep-all peak, emulated link)",
        command_line(),
        markdown_table(
            [
                "model",
                "saved",
                "swapped / recomputed",
                "plain step ms",
                "planned step ms",
                "planned / plain",
                "copies excluded",
                "copies ms",
                "gradients bit-identical",
            ],
            [
                [
                    r["family"],
                    r["saved_tensors"],
                    f"{r['swapped']} / {r['recomputed']}",
                    f"{1e3 * r['plain_step_s']:.1f}",
                    f"{1e3 * r['planned_step_s']:.1f}",
                    f"{r['planned_over_plain']:.3f}x",
                    f"{r['planned_over_plain_copies_excluded']:.3f}x",
                    f"{1e3 * r['copies_s_per_step']:.2f}",
                    "yes" if r["gradients_bit_identical"] else "NO",
                ]
                for r in rows
            ],
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
