"""The default solver on real profiles: HF GPT-2, BERT and Llama from small configs, on CPU.

    python benchmarks/profiled_solve.py [--layers 2,6,12] [--budgets 0.3,0.5,0.7]
        [--time-limit 10] [--json benchmarks/results/profiled_solve.json] [--results]
        [--graphs DIR]

Each model is profiled once (width 128, batch 4 x 128 tokens, dropout on where the model has
it); at each budget CP-SAT (the default solver) solves twice with the same time limit. Per row:
wall time of both solves, whether they returned the same plan, status, overhead gap, phases the
clock stopped, and the overhead of the plan against the heuristic's. On a CPU device plans keep
and recompute only.

Profiles differ from run to run (op times are measured), and so do the rows. ``--graphs DIR``
saves each profile there as ``{model}-{layers}L.json``, or loads it from there when the file is
present: two versions of the planner compared on the same graphs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import slackswap as ss

sys.path.insert(0, str(Path(__file__).parent))


def model_of(kind: str, layers: int):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "gpt2":
        config = tf.GPT2Config(
            n_layer=layers, n_embd=128, n_head=4, n_positions=128, vocab_size=1000
        )
        return tf.GPT2LMHeadModel(config).train()
    if kind == "bert":
        config = tf.BertConfig(
            num_hidden_layers=layers,
            hidden_size=128,
            num_attention_heads=4,
            intermediate_size=512,
            vocab_size=1000,
            max_position_embeddings=128,
        )
        return tf.BertForMaskedLM(config).train()
    if kind == "llama":
        config = tf.LlamaConfig(
            num_hidden_layers=layers,
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=344,
            vocab_size=1000,
            max_position_embeddings=128,
        )
        return tf.LlamaForCausalLM(config).train()
    raise ValueError(kind)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,bert,llama")
    parser.add_argument("--layers", default="2,6,12")
    parser.add_argument("--budgets", default="0.3,0.5,0.7")
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/profiled_solve.json"))
    parser.add_argument("--results", action="store_true", help="write the table to RESULTS.md")
    parser.add_argument("--graphs", type=Path, default=None, help="save or load the profiles here")
    args = parser.parse_args()
    rows, lines = [], []

    def say(text: str) -> None:
        lines.append(text)
        print(text, flush=True)

    say(
        f"{'model':<6} {'L':>2} {'ops':>5} {'budget':>6} {'wall 1':>7} {'wall 2':>7} {'same':>5} "
        f"{'status':<9} {'ovh gap':>8} {'overhead':>9} {'heuristic':>9}  clock-stopped"
    )
    for kind in args.models.split(","):
        for layers in (int(x) for x in args.layers.split(",")):
            saved = None if args.graphs is None else args.graphs / f"{kind}-{layers}L.json"
            if saved is not None and saved.exists():
                graph = ss.load_graph(saved)
            else:
                model = model_of(kind, layers)
                ids = torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(1))
                inputs = {"input_ids": ids, "labels": ids}
                if kind != "bert":
                    inputs["use_cache"] = False
                graph = ss.profile(
                    model,
                    inputs,
                    lambda out: out.loss,
                    warmup=1,
                    repeat=2,
                    name=f"{kind}-{layers}L",
                )
                if saved is not None:
                    saved.parent.mkdir(parents=True, exist_ok=True)
                    saved.write_text(graph.to_json())
            ideal = graph.ideal_step_time_s
            for budget in (float(b) for b in args.budgets.split(",")):
                row = {"model": kind, "layers": layers, "ops": graph.n_ops, "budget": budget}
                try:
                    heuristic = ss.solve(graph, budget, solver="heuristic")
                except ss.InfeasibleBudget:
                    heuristic = None  # the heuristic found no plan; the default solver may
                try:
                    plans, walls = [], []
                    for _ in range(2):
                        began = time.perf_counter()
                        plans.append(ss.solve(graph, budget, time_limit_s=args.time_limit))
                        walls.append(time.perf_counter() - began)
                except ss.InfeasibleBudget as exc:
                    row["error"] = str(exc)[:160]
                    rows.append(row)
                    say(
                        f"{kind:<6} {layers:>2} {graph.n_ops:>5} {budget:>6.0%} no plan: "
                        f"{str(exc)[:90]}"
                    )
                    continue
                first, second = plans
                same = first.decisions == second.decisions and first.schedule == second.schedule
                step = first.info.predicted_step_time_s
                row.update(
                    wall_s=walls,
                    same_plan=same,
                    status=first.info.status,
                    overhead_gap=first.info.overhead_gap,
                    overhead_pct=100 * (step / ideal - 1),
                    heuristic_overhead_pct=None
                    if heuristic is None
                    else 100 * (heuristic.info.predicted_step_time_s / ideal - 1),
                    # the phases the clock stopped in either solve (the second's
                    # marked): a plan that differs between the two solves is one of them
                    clock_stopped=list(first.info.extra.get("clock_stopped") or [])
                    + [f"{name} (2nd)" for name in second.info.extra.get("clock_stopped") or []],
                )
                rows.append(row)
                gap = "-" if row["overhead_gap"] is None else f"{100 * row['overhead_gap']:.1f}%"
                say(
                    f"{kind:<6} {layers:>2} {graph.n_ops:>5} {budget:>6.0%} {walls[0]:>6.1f}s "
                    f"{walls[1]:>6.1f}s {str(same):>5} {row['status']:<9} {gap:>8} "
                    f"{row['overhead_pct']:>8.2f}% "
                    f"{'no plan' if heuristic is None else format(row['heuristic_overhead_pct'], '8.2f') + '%':>9}  "
                    f"{','.join(row['clock_stopped'] or []) or '-'}"
                )
    done = [r for r in rows if "status" in r]
    say(
        f"{len(done)} solves: within {args.time_limit:g} s + 10%: "
        f"{sum(max(r['wall_s']) <= 1.1 * args.time_limit for r in done)}; same plan twice: "
        f"{sum(r['same_plan'] for r in done)}; never worse than the heuristic: "
        f"{sum(r['heuristic_overhead_pct'] is None or r['overhead_pct'] <= r['heuristic_overhead_pct'] + 1e-9 for r in done)}"
    )
    from results_md import save_outputs

    save_outputs(
        args.json,
        rows,
        args.results,
        "profiled_solve",
        "The default solver on HF profiles (CPU)",
        lines,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
