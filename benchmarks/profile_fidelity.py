"""How close a profile's ideal step is to the plain step it measures (small Hugging Face configs,
CPU here; the same on a GPU): ideal step from ``profile(calibrate=True)`` (the default: each phase
scaled to its plain time) and from ``calibrate=False`` (the tracer's own op times), against the
median of plain steps timed afterwards, in alternating rounds with the profiles so that machine
load drifts equally over both.

    python benchmarks/profile_fidelity.py [--rounds 3] [--json benchmarks/results/profile_fidelity.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers

import slackswap as ss


def models():
    """(name, model, inputs, loss_fn): GPT-2, BERT and Llama configs of a few layers, dropout on."""
    torch.manual_seed(0)
    seq, batch, vocab = 128, 4, 1000
    ids = torch.randint(0, vocab, (batch, seq))
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=4,
            n_embd=256,
            n_head=4,
            n_positions=seq,
            vocab_size=vocab,
            bos_token_id=0,
            eos_token_id=0,
        )
    ).train()
    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(
            num_hidden_layers=4,
            hidden_size=256,
            num_attention_heads=4,
            intermediate_size=1024,
            vocab_size=vocab,
            max_position_embeddings=seq,
        )
    ).train()
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=4,
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=688,
            vocab_size=vocab,
            max_position_embeddings=seq,
        )
    ).train()

    def loss(o):
        return o.logits.float().pow(2).mean()

    return [
        ("hf-gpt2", gpt2, {"input_ids": ids}, loss),
        ("hf-bert", bert, {"input_ids": ids}, loss),
        ("hf-llama", llama, {"input_ids": ids}, loss),
    ]


def plain_step_s(model, inputs, loss_fn, steps: int = 5) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss_fn(model(**inputs)).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--json", type=Path, default=Path("benchmarks/results/profile_fidelity.json")
    )
    args = parser.parse_args()
    rows = []
    for name, model, inputs, loss_fn in models():
        plain_step_s(model, inputs, loss_fn, steps=2)  # warm the allocator and the kernels
        calibrated, raw, plain = [], [], []
        for _ in range(args.rounds):
            calibrated.append(
                ss.profile(model, inputs, loss_fn, warmup=1, repeat=3).ideal_step_time_s
            )
            raw.append(
                ss.profile(
                    model, inputs, loss_fn, warmup=1, repeat=3, calibrate=False
                ).ideal_step_time_s
            )
            plain.append(plain_step_s(model, inputs, loss_fn))
        row = {
            "model": name,
            "plain_step_s": statistics.median(plain),
            "ideal_calibrated_s": statistics.median(calibrated),
            "ideal_traced_s": statistics.median(raw),
        }
        row["calibrated_ratio"] = row["ideal_calibrated_s"] / row["plain_step_s"]
        row["traced_ratio"] = row["ideal_traced_s"] / row["plain_step_s"]
        rows.append(row)
        print(
            f"{name}: plain step {1e3 * row['plain_step_s']:.1f} ms; ideal step "
            f"{1e3 * row['ideal_calibrated_s']:.1f} ms calibrated "
            f"({row['calibrated_ratio']:.3f}x), {1e3 * row['ideal_traced_s']:.1f} ms traced "
            f"({row['traced_ratio']:.3f}x)"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    from results_md import command_line, markdown_table, write_section

    write_section(
        "profile_fidelity",
        "Profiled ideal step against the plain step (CPU)",
        command_line(),
        markdown_table(
            [
                "model",
                "plain step ms",
                "ideal, calibrated ms",
                "ratio",
                "ideal, traced op times ms",
                "ratio",
            ],
            [
                [
                    r["model"],
                    f"{1e3 * r['plain_step_s']:.1f}",
                    f"{1e3 * r['ideal_calibrated_s']:.1f}",
                    f"{r['calibrated_ratio']:.3f}",
                    f"{1e3 * r['ideal_traced_s']:.1f}",
                    f"{r['traced_ratio']:.3f}",
                ]
                for r in rows
            ],
        )
        + "\n\nHugging Face GPT-2, BERT and Llama configs of 4 layers, width 256, batch 4 x 128 "
        "tokens, dropout on; medians over alternating rounds of profiles and plain steps.",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
