"""The GPU check behind gpu_check.sh (see there). Writes one JSON summary."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import slackswap as ss


def gpt2_medium(seq: int, batch: int, device):
    import transformers

    cfg = transformers.GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=seq,
                                  vocab_size=50257, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).to(device=device, dtype=torch.bfloat16)
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    return model, {"input_ids": ids}, (lambda out: out.logits.float().logsumexp(-1).mean())


def measure(step, repeat: int = 3) -> dict:
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "max_memory_allocated": torch.cuda.max_memory_allocated()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_check.json"))
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--report", type=Path,
                        help="write the RESULTS.md section from this summary, run nothing")
    args = parser.parse_args()
    if args.report:
        return report(json.loads(args.report.read_text()))
    summary: dict = {"ok": False}

    def save() -> None:  # after every measurement, so a run cut short still reports
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1, default=str))
    if not torch.cuda.is_available():
        summary["error"] = "no CUDA device"
        args.out.write_text(json.dumps(summary, indent=1))
        print(summary)
        return 1
    # deterministic kernels, so that gradients can be compared bit for bit
    torch.use_deterministic_algorithms(True, warn_only=True)
    # attention's fused backward kernels are not bitwise reproducible: the math kernel is
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    device = torch.device("cuda")
    summary["device"] = torch.cuda.get_device_name(device)
    summary["torch"] = torch.__version__
    hw = ss.calibrate_link(device)
    summary["link"] = {"d2h_GBps": hw.d2h_bytes_per_s / 1e9, "h2d_GBps": hw.h2d_bytes_per_s / 1e9,
                       "latency_us": hw.latency_s * 1e6}
    model, inputs, loss_fn = gpt2_medium(args.seq, args.batch, device)
    start = time.perf_counter()
    graph = ss.profile(model, inputs, loss_fn, warmup=1, repeat=2, name="gpt2-medium")
    summary["profile_s"] = time.perf_counter() - start
    summary["graph"] = graph.summary()

    def plain():
        model.zero_grad(set_to_none=True)
        loss_fn(model(**inputs)).backward()

    base = measure(plain)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    summary["plain"] = {**base, "param_bytes": params}
    summary["keep_all_peak_simulated"] = ss.keep_all_peak(graph, hw)
    rows = []
    torch.manual_seed(0)  # dropout is on: the same masks for the reference and each plan
    plain()
    reference = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    torch.manual_seed(0)
    plain()
    summary["plain_bit_reproducible"] = all(
        (a is None and b is None) or torch.equal(a, b)
        for a, b in zip(reference, (p.grad for p in model.parameters())))
    summary["deterministic_algorithms"] = torch.are_deterministic_algorithms_enabled()
    solvers = [s for s in ("heuristic", "cpsat") if ss.is_available(s)]
    summary["solvers"] = solvers
    for fraction in (1.0, 0.7, 0.5):
        for solver in solvers:
            try:
                plan = ss.solve(graph, fraction, hw, solver=solver, time_limit_s=args.time_limit)
            except ss.InfeasibleBudget as exc:
                rows.append({"budget": fraction, "solver": solver, "error": str(exc)})
                continue
            sim = ss.simulate(graph, plan)
            check = ss.validate(graph, plan)

            def step(plan=plan):
                model.zero_grad(set_to_none=True)
                with ss.apply(plan, model, graph=graph):
                    loss_fn(model(**inputs)).backward()

            try:
                torch.manual_seed(0)
                step()
                pairs = [(a, b) for a, b in zip(reference, (p.grad for p in model.parameters()))
                         if a is not None and b is not None]
                same = all(torch.equal(a, b) for a, b in pairs)
                max_diff = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
                got = measure(step)
            except Exception as exc:  # report it and go on with the other rows
                rows.append({"budget": fraction, "solver": solver, "error": f"{type(exc).__name__}: {exc}"})
                summary["rows"] = rows
                save()
                continue
            rows.append({"budget": fraction, "solver": solver, "status": plan.info.status,
                         "checker_ok": check.ok, "gradients_bit_identical": same,
                         "gradients_max_abs_diff": max_diff,
                         "counts": {d: plan.count(d) for d in ("keep", "swap", "recompute")},
                         "budget_bytes": plan.budget_bytes, **got,
                         "activation_bytes_measured": got["max_memory_allocated"] - params,
                         "simulated_peak_bytes": sim.peak_bytes,
                         "simulated_step_s": sim.step_time_s, "retention_simulated": sim.retention,
                         "retention_measured": base["step_s"] / got["step_s"]})
            print(rows[-1], flush=True)
            summary["rows"] = rows
            save()
    model.gradient_checkpointing_enable()
    ckpt = measure(plain)
    model.gradient_checkpointing_disable()

    def offload():
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            loss_fn(model(**inputs)).backward()

    summary.update(rows=rows, torch_checkpoint=ckpt, offload_everything=measure(offload), ok=True)
    save()
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, default=str))
    return 0


def report(summary: dict) -> int:
    """benchmarks/RESULTS.md's GPU section, from a summary the check wrote on the GPU."""
    from results_md import markdown_table, write_section

    plain = summary["plain"]
    rows = [["plain training", "-", "-", f"{1e3 * plain['step_s']:.1f}", "1.00",
             f"{(plain['max_memory_allocated'] - plain['param_bytes']) / 2**30:.2f}", "-", "-"]]
    for r in summary.get("rows", []):
        if "error" in r:
            rows.append([f"{r['solver']} plan", f"{100 * r['budget']:.0f}%", r["error"][:60], "", "",
                         "", "", ""])
            continue
        rows.append([f"{r['solver']} plan ({r['counts']['swap']} swap, {r['counts']['recompute']} "
                     f"recompute)", f"{100 * r['budget']:.0f}%",
                     f"{r['budget_bytes'] / 2**30:.2f}", f"{1e3 * r['step_s']:.1f}",
                     f"{r['step_s'] / plain['step_s']:.2f}",
                     f"{r['activation_bytes_measured'] / 2**30:.2f}",
                     f"{r['simulated_peak_bytes'] / 2**30:.2f}",
                     "yes" if r["gradients_bit_identical"] else f"no ({r['gradients_max_abs_diff']:.2g})"])
    for key, label in (("torch_checkpoint", "torch checkpointing (every block)"),
                       ("offload_everything", "offload everything (save_on_cpu)")):
        m = summary[key]
        rows.append([label, "-", "-", f"{1e3 * m['step_s']:.1f}", f"{m['step_s'] / plain['step_s']:.2f}",
                     f"{(m['max_memory_allocated'] - plain['param_bytes']) / 2**30:.2f}", "-", "-"])
    body = markdown_table(["variant", "budget", "budget GiB", "step ms", "x plain",
                           "measured peak - params, GiB", "simulated peak GiB",
                           "gradients bit-identical"], rows)
    link = summary["link"]
    body += (f"\n\n{summary['device']}, {summary['graph']}; link measured {link['d2h_GBps']:.1f} / "
             f"{link['h2d_GBps']:.1f} GB/s, {link['latency_us']:.1f} us; deterministic kernels "
             f"(plain training bit-reproducible: {summary.get('plain_bit_reproducible')}); the "
             "profile's ideal step is "
             f"{1e3 * summary['rows'][0]['simulated_step_s']:.0f} ms against "
             f"{1e3 * plain['step_s']:.0f} ms measured." if summary.get("rows") else "")
    write_section("gpu_check", "GPU check (one run on the device)",
                  "bash benchmarks/gpu_check.sh --time-limit 10  (on the GPU), then "
                  "python benchmarks/gpu_check.py --report benchmarks/results/gpu_check.json", body,
                  where=", ".join([summary["device"]] + (
                      [f"torch {summary['torch']}"] if summary.get("torch") else [])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
