"""How long profile() takes on small Hugging Face configs (CPU here; CUDA events on a GPU).

python benchmarks/profile_speed.py [--json benchmarks/results/profile_speed.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

import slackswap as ss


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/profile_speed.json"))
    args = parser.parse_args()
    rows = []
    for layers, width, seq in ((2, 64, 32), (4, 256, 128), (12, 768, 128)):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(
            n_layer=layers,
            n_embd=width,
            n_head=max(1, width // 64),
            n_positions=seq,
            vocab_size=1000,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = transformers.GPT2LMHeadModel(cfg).train()
        ids = {"input_ids": torch.randint(0, 1000, (2, seq))}
        start = time.perf_counter()
        graph = ss.profile(model, ids, lambda o: o.logits.pow(2).mean(), warmup=1, repeat=3)
        wall = time.perf_counter() - start
        row = {
            "layers": layers,
            "width": width,
            "seq": seq,
            "ops": graph.n_ops,
            "saved_tensors": int(len(graph.saved)),
            "profile_s_4_steps": wall,
        }
        rows.append(row)
        print(
            f"GPT-2 {layers} layers x {width}, seq {seq}: {graph.n_ops} ops, "
            f"{row['saved_tensors']} saved tensors, profiled (1 warmup + 3 steps) in {wall:.2f} s"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    from results_md import command_line, markdown_table, write_section

    write_section(
        "profile_speed",
        "Profiler speed (Hugging Face GPT-2, CPU)",
        command_line(),
        markdown_table(
            ["layers", "width", "seq", "ops", "saved tensors", "profile s (1 warmup + 3 steps)"],
            [
                [
                    r["layers"],
                    r["width"],
                    r["seq"],
                    r["ops"],
                    r["saved_tensors"],
                    f"{r['profile_s_4_steps']:.2f}",
                ]
                for r in rows
            ],
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
