"""The device check behind gpu_check.sh: does a plan run the way it was planned?

For HF GPT-2 medium and an HF Llama config of about 1B parameters (bf16, SDPA attention as users
run them), at budgets of 100 / 70 / 50 / 30% of the keep-all peak, with the heuristic and the
default solver, and beside plain training, per-block checkpointing, torch's selective
checkpointing (save the matmuls), save_on_cpu and torch.compile with an activation memory budget:
the measured step (median of paired rounds against plain), the measured activation peak
(max_memory_allocated less parameters and gradients), the simulated step and peak, gradients
against plain, allocator counters per step, and, from one torch.profiler trace of a swapping
plan, the share of copy time that overlaps kernels. One JSON summary, written after every row.

    bash benchmarks/gpu_check.sh                 # on a GPU
    python benchmarks/gpu_check.py --cpu --out /tmp/gpu_check_cpu.json   # the CPU fallback:
        # the same rows on tiny configs and the cpu-emulated-link preset (no torch.compile
        # activation-budget row; the compiled-swaps row with the aot_eager backend)
    python benchmarks/gpu_check.py --report benchmarks/results/gpu_check.json  # RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch

import slackswap as ss
from slackswap.runtime.overhead import without_overhead

BUDGETS = (1.0, 0.7, 0.5, 0.3)


def models(cpu: bool, device, dtype):
    """(name, model, inputs, loss_fn) for GPT-2 medium and a Llama config of about 1B
    parameters (TinyLlama's shape), or tiny configs of both for the CPU fallback."""
    import transformers

    torch.manual_seed(0)
    if cpu:
        shapes = [
            ("gpt2-tiny", dict(n_layer=2, n_embd=128, n_head=4), 64, 2),
            (
                "llama-tiny",
                dict(
                    num_hidden_layers=2,
                    hidden_size=128,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    intermediate_size=344,
                ),
                64,
                2,
            ),
        ]
    else:
        shapes = [
            ("gpt2-medium", dict(n_layer=24, n_embd=1024, n_head=16), 1024, 4),
            (
                "llama-1b",
                dict(
                    num_hidden_layers=22,
                    hidden_size=2048,
                    num_attention_heads=32,
                    num_key_value_heads=4,
                    intermediate_size=5632,
                ),
                2048,
                2,
            ),
        ]
    out = []
    for name, shape, seq, batch in shapes:
        vocab = 1000 if cpu else 32000
        if name.startswith("gpt2"):
            cfg = transformers.GPT2Config(
                n_positions=seq, vocab_size=vocab, bos_token_id=0, eos_token_id=0, **shape
            )
            model = transformers.GPT2LMHeadModel(cfg)
        else:
            cfg = transformers.LlamaConfig(max_position_embeddings=seq, vocab_size=vocab, **shape)
            model = transformers.LlamaForCausalLM(cfg)
        model = model.to(device=device, dtype=dtype).train()
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        out.append(
            (name, model, {"input_ids": ids}, lambda o: o.logits.float().logsumexp(-1).mean())
        )
    return out


class Device:
    """Synchronisation, peak memory and allocator counters, on CUDA or the CPU."""

    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def counters(self) -> dict:
        if not self.cuda:
            return {}
        s = torch.cuda.memory_stats(self.device)
        return {
            "num_device_alloc": s.get("num_device_alloc", 0),
            "num_alloc_retries": s.get("num_alloc_retries", 0),
        }

    def peak(self, step) -> tuple[int, dict]:
        """The step's peak bytes above what was allocated before it, and its counters. On CUDA
        that includes the parameter gradients the step makes (the caller takes them off); on
        the CPU it is StepMeter's figure for the step's tensors."""
        self.sync()
        before = self.counters()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            start = torch.cuda.memory_allocated(self.device)
            step()
            self.sync()
            peak = torch.cuda.max_memory_allocated(self.device) - start
        else:
            with ss.StepMeter(sample="ops") as meter:
                step()
            peak = meter.peak_bytes
        after = self.counters()
        return peak, {k: after[k] - before[k] for k in after}


def paired(dev: Device, plain, other, rounds: int) -> tuple[float, float]:
    """Median step time of ``other`` and its median ratio to plain, the two run back to back
    in each round (load drifts equally over both)."""
    plain(), other()
    ratios, times = [], []
    for _ in range(rounds):
        dev.sync()
        start = time.perf_counter()
        plain()
        dev.sync()
        a = time.perf_counter() - start
        start = time.perf_counter()
        other()
        dev.sync()
        b = time.perf_counter() - start
        ratios.append(b / a)
        times.append(b)
    return statistics.median(times), statistics.median(ratios)


def gradients(model) -> list:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def compare(reference, model) -> dict:
    pairs = [
        (a, b)
        for a, b in zip(reference, (p.grad for p in model.parameters()))
        if a is not None and b is not None
    ]
    return {
        "gradients_bit_identical": all(torch.equal(a, b) for a, b in pairs),
        "gradients_max_abs_diff": max(
            (float((a.float() - b.float()).abs().max()) for a, b in pairs), default=0.0
        ),
    }


def overlap_share(step) -> float | None:
    """From one torch.profiler trace: the share of host<->device copy time during which a
    compute kernel runs too."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    copies, kernels = [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (e.time_range.start, e.time_range.end)
        (
            copies if "Memcpy" in e.name and ("DtoH" in e.name or "HtoD" in e.name) else kernels
        ).append(span)
    if not copies:
        return None
    kernels.sort()
    total = overlapped = 0.0
    for start, end in copies:
        total += end - start
        covered, cursor = 0.0, start
        for ks, ke in kernels:
            if ke <= cursor:
                continue
            if ks >= end:
                break
            lo, hi = max(ks, cursor), min(ke, end)
            if hi > lo:
                covered += hi - lo
                cursor = hi
        overlapped += covered
    return overlapped / total if total else None


def baselines(model, inputs, loss_fn, cpu: bool, compile_row: bool) -> dict:
    """The steps of torch's own ways, each a callable."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def plain():
        model.zero_grad(set_to_none=True)
        loss_fn(model(**inputs)).backward()

    def with_checkpointing(**kwargs):
        def step():
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False, **kwargs}
            )
            try:
                plain()
            finally:
                model.gradient_checkpointing_disable()

        return step

    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def save_matmuls(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in matmuls else CheckpointPolicy.PREFER_RECOMPUTE

    def save_on_cpu():
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.save_on_cpu(pin_memory=not cpu):
            loss_fn(model(**inputs)).backward()

    steps = {
        "per-block checkpointing": with_checkpointing(),
        "selective checkpointing (save matmuls)": with_checkpointing(
            context_fn=partial(create_selective_checkpoint_contexts, save_matmuls)
        ),
        "save_on_cpu": save_on_cpu,
    }
    if compile_row:
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = 0.5
        compiled = torch.compile(model)

        def compiled_step():
            model.zero_grad(set_to_none=True)
            loss_fn(compiled(**inputs)).backward()

        steps["torch.compile, activation_memory_budget 0.5"] = compiled_step
    return plain, steps


def compiled_swaps(
    model,
    inputs,
    loss_fn,
    graph,
    dev: Device,
    hw,
    plain_s: float,
    reference,
    grads: int,
    rounds: int,
) -> dict:
    """A plan for the compiled checkpoint graph at 50% (swaps and recomputes), run compiled
    inside ``ss.checkpointed``: swaps through torch's activation-offloading pass. The step is the
    median of ``rounds`` steps with the context open (re-entering it would recompile). HF models
    are called with ``use_cache=False`` (as HF's own checkpointing does: a step that makes a cache
    writes state torch's checkpoint would replay), profiled so."""
    if isinstance(inputs, dict):
        inputs = {**inputs, "use_cache": False}
        graph = ss.profile(model, inputs, loss_fn, warmup=1, repeat=2, name=graph.name)
    compiled_graph = ss.checkpoint_graph(graph, compiled=True)
    pins = ss.boundary_pins(compiled_graph)
    budget = max(
        int(0.5 * ss.keep_all_peak(compiled_graph, hw)),
        ss.min_budget(compiled_graph, hw, pins=pins),
    )
    plan = ss.solve(compiled_graph, budget, hw, solver="heuristic", pins=pins)
    sim = ss.simulate(compiled_graph, plan)
    row = {
        "budget_bytes": plan.budget_bytes,
        "simulated_step_s": sim.step_time_s,
        "simulated_peak_bytes": sim.peak_bytes,
        "counts": {d: plan.count(d) for d in ("keep", "swap", "recompute")},
    }
    with ss.checkpointed(model, plan, compiled_graph) as ctx:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="inductor" if dev.cuda else "aot_eager")

        def step():
            model.zero_grad(set_to_none=True)
            loss_fn(compiled(**inputs)).backward()

        torch.manual_seed(0)
        step()
        row.update(compare(reference, model))
        times = []
        for _ in range(rounds):
            dev.sync()
            start = time.perf_counter()
            step()
            dev.sync()
            times.append(time.perf_counter() - start)
        row["step_s"] = statistics.median(times)
        row["x_plain"] = row["step_s"] / plain_s
        peak, counters = dev.peak(step)
        row.update(
            activation_peak_bytes=peak - grads,
            counters=counters,
            within_budget=peak - grads <= plan.budget_bytes,
        )
        info = ctx.info
        row["swaps_ran"] = {
            kind: sum(v == kind for v in info["swaps"].values())
            for kind in ("offloaded", "saved", "recomputed", "not compiled")
        }
        row["compiled_graphs"] = info.get("compiled_graphs", [])
    torch._dynamo.reset()
    return row


def cost_preset(dev: Device) -> str:
    """The hardware preset whose figures the cost model uses on this device."""
    if not dev.cuda:
        return "cpu"
    here = torch.cuda.get_device_name(dev.device).lower()
    for token, preset in (
        ("h200", "h200-sxm-pcie5"),
        ("h100", "h100-sxm-pcie5"),
        ("a100", "a100-80gb-pcie4"),
    ):
        if token in here:
            return preset
    return "a100-80gb-pcie4"


def fake_against_measured(model, inputs, loss_fn, graph, dev: Device) -> dict:
    """A fake profile of the same model and inputs (profile(fake=True), the cost model for the
    device's preset) against the measured profile: same structure, and the op times' ratios
    (fake / measured) over the forward, the backward and the matrix products alone."""
    import statistics

    preset = cost_preset(dev)
    fake = ss.profile(model, inputs, loss_fn, fake=True, hardware=preset, device=dev.device)
    out = {
        "preset": preset,
        # (the measured profile's overhead, runtime/overhead.py, is what a fake step cannot see)
        "same_structure": fake.structure_digest == without_overhead(graph).structure_digest,
        "forward_ratio": sum(o.forward_s for o in fake.ops)
        / max(1e-12, sum(o.forward_s for o in graph.ops)),
        "backward_ratio": sum(o.backward_s for o in fake.ops)
        / max(1e-12, sum(o.backward_s for o in graph.ops)),
    }
    if out["same_structure"]:
        mm = [
            f.forward_s / m.forward_s
            for f, m in zip(fake.ops, graph.ops)
            if m.forward_s > 0 and f.extra["aten"].split(".")[1] in ("mm", "addmm", "bmm")
        ]
        if mm:
            out["matmul_ratio_median"] = statistics.median(mm)
            out["matmul_ops"] = len(mm)
    return out


def check_model(name, model, inputs, loss_fn, dev: Device, hw, args, summary, save) -> None:
    entry: dict = {"model": name, "rows": []}
    summary["models"].append(entry)
    started = time.perf_counter()
    graph = ss.profile(model, inputs, loss_fn, warmup=1, repeat=2, name=name)
    entry["profile_s"] = time.perf_counter() - started
    entry["graph"] = graph.summary()
    try:
        entry["fake_vs_measured"] = fake_against_measured(model, inputs, loss_fn, graph, dev)
    except Exception as exc:  # the row reports, the check goes on
        entry["fake_vs_measured"] = {"error": f"{type(exc).__name__}: {exc}"}
    print(
        name,
        "fake profile against the measured one:",
        json.dumps(entry["fake_vs_measured"]),
        flush=True,
    )
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    entry["param_bytes"] = params
    plain, others = baselines(
        model, inputs, loss_fn, not dev.cuda, dev.cuda and not args.no_compile
    )
    torch.manual_seed(0)
    plain()
    reference = gradients(model)
    plain_s, _ = paired(dev, plain, plain, args.rounds)
    # activation peak: the step's peak above what was allocated before it, less the parameter
    # gradients it makes (zeroed to None first): activations and workspaces alone
    grads = params if dev.cuda else 0
    plain_peak, plain_counters = dev.peak(plain)
    entry["plain"] = {
        "step_s": plain_s,
        "activation_peak_bytes": plain_peak - grads,
        "counters": plain_counters,
        "ideal_step_s": graph.ideal_step_time_s,
        "keep_all_peak_simulated": ss.keep_all_peak(graph, hw),
    }
    save()
    swapping = None
    for fraction in BUDGETS:
        for solver in args.solvers:
            row: dict = {"budget": fraction, "solver": solver}
            entry["rows"].append(row)
            try:
                plan = ss.solve(graph, fraction, hw, solver=solver, time_limit_s=args.time_limit)
            except ss.InfeasibleBudget as exc:  # below the smallest budget: a finding, not a fault
                row.update(infeasible=str(exc), smallest_budget_bytes=exc.min_budget_bytes)
                save()
                continue
            sim = ss.simulate(graph, plan)
            row.update(
                status=plan.info.status,
                checker_ok=ss.validate(graph, plan).ok,
                counts={d: plan.count(d) for d in ("keep", "swap", "recompute")},
                budget_bytes=plan.budget_bytes,
                simulated_step_s=sim.step_time_s,
                simulated_peak_bytes=sim.peak_bytes,
            )

            def step(plan=plan):
                model.zero_grad(set_to_none=True)
                with ss.apply(plan, model, graph=graph) as run:
                    loss_fn(model(**inputs)).backward()
                return run

            try:
                torch.manual_seed(0)
                run = step()
                row.update(compare(reference, model))
                row["log_matches_plan"] = run.log.schedule == plan.schedule
                pool_before = run.stats.host_pool_bytes
                row["step_s"], row["x_plain"] = paired(dev, plain, step, args.rounds)
                peak, counters = dev.peak(step)
                row.update(
                    activation_peak_bytes=peak - grads,
                    counters=counters,
                    host_pool_growth_bytes=step().stats.host_pool_bytes - pool_before,
                )
                row["within_budget"] = row["activation_peak_bytes"] <= plan.budget_bytes
                if swapping is None and plan.count("swap"):
                    swapping = step
            except Exception as exc:  # report it and go on with the other rows
                row["error"] = f"{type(exc).__name__}: {exc}"
            print(name, json.dumps(row, default=str), flush=True)
            save()
    for label, fn in others.items():
        row = {"variant": label}
        entry["rows"].append(row)
        try:
            torch.manual_seed(0)
            fn()
            row.update(compare(reference, model))
            row["step_s"], row["x_plain"] = paired(dev, plain, fn, args.rounds)
            peak, counters = dev.peak(fn)
            row.update(activation_peak_bytes=peak - grads, counters=counters)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        print(name, json.dumps(row, default=str), flush=True)
        save()
    if not args.no_compile:
        row = {"variant": "torch.compile + ss.checkpointed at 50% (swaps by torch's pass)"}
        entry["rows"].append(row)
        try:
            row.update(
                compiled_swaps(
                    model, inputs, loss_fn, graph, dev, hw, plain_s, reference, grads, args.rounds
                )
            )
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        print(name, json.dumps(row, default=str), flush=True)
        save()
    if dev.cuda and swapping is not None:
        try:
            entry["copy_overlap_share"] = overlap_share(swapping)
        except Exception as exc:
            entry["copy_overlap_share_error"] = f"{type(exc).__name__}: {exc}"
    save()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_check.json"))
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="the CPU fallback: tiny configs on the cpu-emulated-link preset",
    )
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--solvers", nargs="+", default=["heuristic", "cpsat"])
    parser.add_argument("--no-compile", action="store_true", help="leave out the compile row")
    parser.add_argument(
        "--report", type=Path, help="write the RESULTS.md section from this summary, run nothing"
    )
    args = parser.parse_args()
    if args.report:
        return report(json.loads(args.report.read_text()))
    summary: dict = {"ok": False, "models": [], "torch": torch.__version__}

    def save() -> None:  # after every row, so a run cut short still reports
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1, default=str))

    if not args.cpu and not torch.cuda.is_available():
        summary["error"] = "no CUDA device (the CPU fallback: --cpu)"
        save()
        print(summary["error"])
        return 1
    device = torch.device("cpu" if args.cpu else "cuda")
    dev = Device(device)
    if dev.cuda:
        # deterministic kernels, so that gradients can be compared bit for bit
        torch.use_deterministic_algorithms(True, warn_only=True)
        summary["device"] = torch.cuda.get_device_name(device)
        hw = ss.calibrate_link(device)
    else:
        summary["device"] = "cpu (fallback)"
        hw = ss.hardware("cpu-emulated-link")
    summary["link"] = {
        "name": hw.name,
        "d2h_GBps": hw.d2h_bytes_per_s / 1e9,
        "h2d_GBps": hw.h2d_bytes_per_s / 1e9,
        "latency_us": hw.latency_s * 1e6,
        "duplex": hw.duplex,
    }
    dtype = torch.float32 if args.cpu else torch.bfloat16
    for name, model, inputs, loss_fn in models(args.cpu, device, dtype):
        check_model(name, model, inputs, loss_fn, dev, hw, args, summary, save)
        del model
        if dev.cuda:
            torch.cuda.empty_cache()
    summary["ok"] = True
    save()
    return 0


def report(summary: dict) -> int:
    """benchmarks/RESULTS.md's device section, from a summary the check wrote."""
    from results_md import markdown_table, write_section

    body = []
    for entry in summary.get("models", []):
        plain = entry["plain"]
        rows = [
            [
                "plain training",
                "-",
                f"{1e3 * plain['step_s']:.1f}",
                "1.00",
                f"{plain['activation_peak_bytes'] / 2**30:.2f}",
                "-",
                "-",
                "-",
            ]
        ]
        for r in entry["rows"]:
            label = r.get("variant") or f"{r['solver']} at {100 * r['budget']:.0f}%"
            if "error" in r:
                rows.append([label, r["error"][:60], "", "", "", "", "", ""])
                continue
            if "infeasible" in r:
                rows.append(
                    [
                        label,
                        f"below the smallest budget ({r['smallest_budget_bytes'] / 2**30:.2f} GiB)",
                        "",
                        "",
                        "",
                        "",
                        "",
                        "",
                    ]
                )
                continue
            sim = r.get("simulated_step_s")
            rows.append(
                [
                    label
                    + (
                        f" ({r['counts']['swap']} swap, {r['counts']['recompute']} recompute)"
                        if "counts" in r
                        else ""
                    ),
                    f"{r['budget_bytes'] / 2**30:.2f}" if "budget_bytes" in r else "-",
                    f"{1e3 * r['step_s']:.1f}",
                    f"{r['x_plain']:.2f}",
                    f"{r['activation_peak_bytes'] / 2**30:.2f}",
                    f"{1e3 * sim:.1f}" if sim else "-",
                    f"{r['simulated_peak_bytes'] / 2**30:.2f}"
                    if "simulated_peak_bytes" in r
                    else "-",
                    "yes"
                    if r.get("gradients_bit_identical")
                    else f"no ({r.get('gradients_max_abs_diff', float('nan')):.2g})",
                ]
            )
        body.append(
            f"**{entry['model']}** ({entry['graph']}; ideal step "
            f"{1e3 * plain['ideal_step_s']:.1f} ms)\n\n"
            + markdown_table(
                [
                    "variant",
                    "budget GiB",
                    "step ms",
                    "x plain",
                    "activation peak GiB",
                    "simulated step ms",
                    "simulated peak GiB",
                    "gradients bit-identical",
                ],
                rows,
            )
        )
        fake = entry.get("fake_vs_measured") or {}
        if "error" in fake:
            body.append(f"Fake profile: {fake['error'][:120]}")
        elif fake:
            body.append(
                f"Fake profile ({fake['preset']} cost model) against the measured one: same "
                f"structure {fake['same_structure']}; forward {fake['forward_ratio']:.2f}x, "
                f"backward {fake['backward_ratio']:.2f}x the measured times"
                + (
                    f"; matrix products {fake['matmul_ratio_median']:.2f}x (median of "
                    f"{fake['matmul_ops']})"
                    if "matmul_ratio_median" in fake
                    else ""
                )
                + "."
            )
    link = summary.get("link", {})
    body.append(
        f"Link: {link.get('name')}, {link.get('d2h_GBps', 0):.1f} / "
        f"{link.get('h2d_GBps', 0):.1f} GB/s, {link.get('latency_us', 0):.1f} us per "
        f"copy, duplex {link.get('duplex')}."
    )
    write_section(
        "gpu_check",
        "Device check (plans as they run)",
        "bash benchmarks/gpu_check.sh, then python benchmarks/gpu_check.py --report "
        "benchmarks/results/gpu_check.json",
        "\n\n".join(body),
        where=f"{summary.get('device')}, torch {summary.get('torch')}",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
