"""slackswap beside what a PyTorch user would pick instead, on the same models, measured alike.

    python benchmarks/vs_torch.py [--budgets 0.7,0.5,0.3] [--rounds 5] [--models gpt2,resnet]
        [--json benchmarks/results/vs_torch.json]

Models: an HF GPT-2 from a config (4 layers, width 256, dropout 0.1, batch 8 x 256 tokens), a
ResNet with batch norm (stem + 8 basic blocks, 8 images of 64 x 64), and (``--models
transformer``) torch's own test Transformer (4 layers, width 256, 8 heads, dropout 0.1, batch 4 x
256 tokens: the model torch's automatic-SAC tests plan). Variants: plain training;
per-block checkpointing (torch.utils.checkpoint around every block); torch's selective
checkpointing per block (matmuls saved, the rest recomputed: the policy of torch's own example);
torch.compile with ``activation_memory_budget`` = the budget (its min-cut partitioner:
``aot_eager_decomp_partition`` on CPU); offload-everything (``torch.autograd.graph.save_on_cpu``);
slackswap's executor (``ss.apply``, the default planner's plan, 10 s limit); slackswap's exported policy
(``ss.checkpointed``, a plan made for ``g = ss.checkpoint_graph(graph)`` with
``pins=ss.boundary_pins(g)``; compiled: ``checkpoint_graph(graph, compiled=True)``), eager and compiled
(``aot_eager``). Per variant: bytes held at the start
of backward and the step peak (``ss.StepMeter``: the C heap on CPU, the caching allocator on
CUDA; above what was allocated before the step, parameter gradients included) as fractions of plain training's, step time
over plain's (median of paired rounds: plain then the variant, the same inputs), the time spent
planning or compiling, and the gradients against plain training's (bitwise, or the largest
difference). On a CPU device slackswap plans keep and recompute only (there is no host to swap
to); save_on_cpu copies to the same memory there and saves nothing.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import slackswap as ss

sys.path.insert(0, str(Path(__file__).parent))


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = (
            None
            if stride == 1 and c_in == c_out
            else nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
        )

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, classes: int = 100):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU()
        )
        widths = [
            (32, 32, 1),
            (32, 32, 1),
            (32, 64, 2),
            (64, 64, 1),
            (64, 128, 2),
            (128, 128, 1),
            (128, 256, 2),
            (256, 256, 1),
        ]
        self.blocks = nn.ModuleList(BasicBlock(*w) for w in widths)
        self.fc = nn.Linear(256, classes)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean((2, 3)))


def build(name: str):
    """(model, inputs, loss_fn, blocks) for one benchmark model."""
    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=4,
            n_embd=256,
            n_head=4,
            n_positions=256,
            vocab_size=2000,
            resid_pdrop=0.1,
            embd_pdrop=0.1,
            attn_pdrop=0.1,
        )
        model = GPT2LMHeadModel(config).train()
        ids = torch.randint(0, 2000, (8, 256))
        # no KV cache: its update in forward is state a checkpoint recompute would see changed
        # (HF turns it off for its own gradient checkpointing)
        return (
            model,
            {"input_ids": ids, "labels": ids, "use_cache": False},
            (lambda out: out.loss),
            list(model.transformer.h),
        )
    if name == "transformer":
        # torch's own test Transformer (the model torch's automatic-SAC tests plan): pre-norm
        # blocks, attention with an explicit softmax, dropout 0.1 on attention and residuals
        from torch.testing._internal.distributed._tensor.common_dtensor import (
            ModelArgs,
            Transformer,
        )

        args = ModelArgs(
            n_layers=4, vocab_size=8192, max_seq_len=256, dim=256, n_heads=8, dropout_p=0.1
        )
        model = Transformer(args).train()
        ids = torch.randint(0, 8192, (4, 256))

        def next_token_loss(out):
            return nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

        return model, ids, next_token_loss, list(model.layers)
    if name == "resnet":
        model = ResNet().train()
        x = torch.randn(8, 3, 64, 64)
        target = torch.randint(0, 100, (8,))
        return model, x, (lambda out: nn.functional.cross_entropy(out, target)), list(model.blocks)
    raise ValueError(f"unknown model {name!r}")


def call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


class Wrapped:
    """Blocks' forwards replaced by a checkpointed call while the context is open."""

    def __init__(self, blocks, context_fn=None):
        self.blocks, self.context_fn = blocks, context_fn

    def __enter__(self):
        for block in self.blocks:
            forward = block.forward
            options = {} if self.context_fn is None else {"context_fn": self.context_fn}

            def wrapped(*args, _forward=forward, _options=options, **kwargs):
                return checkpoint(_forward, *args, use_reentrant=False, **_options, **kwargs)

            block.forward = wrapped
        return self

    def __exit__(self, *exc):
        for block in self.blocks:
            block.__dict__.pop("forward", None)


def save_matmuls(ctx, func, *args, **kwargs):
    """torch's selective-checkpointing example policy: keep matmul outputs, recompute the rest."""
    keep = {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.convolution.default,
        torch.ops.aten.baddbmm.default,
    }
    return CheckpointPolicy.MUST_SAVE if func in keep else CheckpointPolicy.PREFER_RECOMPUTE


def measured_step(model, runner, inputs, loss_fn, sample: str):
    """One step: its gradients, (peak, bytes at backward start) and wall time. Parameter
    gradients are allocated (zeroed) before the step: every variant holds them alike, and a
    step peak late in backward would otherwise count them where an early one does not."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()
    torch.manual_seed(7)
    start = time.perf_counter()
    with ss.StepMeter(sample=sample) as meter:
        loss = loss_fn(call(runner, inputs))
        meter.mark("backward")
        loss.backward()
    wall = time.perf_counter() - start
    return (
        [p.grad.clone() for p in model.parameters()],
        meter.peak_bytes,
        meter.marks["backward"],
        wall,
    )


def timed_step(model, runner, inputs, loss_fn) -> float:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    start = time.perf_counter()
    loss_fn(call(runner, inputs)).backward()
    return time.perf_counter() - start


def compare(model, inputs, loss_fn, variant, plain_grads, plain_peak, plain_held, rounds: int):
    """Measure one variant: ``variant`` is (name, context manager factory, runner, setup_s,
    sample)."""
    name, make_context, runner, setup_s, sample = variant
    with make_context():
        for _ in range(2):  # warm-up (compilation, first allocations)
            measured_step(model, runner, inputs, loss_fn, sample)
        grads, peak, held, _ = measured_step(model, runner, inputs, loss_fn, sample)
        ratios = []
        for _ in range(rounds):
            plain_s = timed_step(model, model, inputs, loss_fn)
            ratios.append(timed_step(model, runner, inputs, loss_fn) / plain_s)
    diff = max(float((a - b).abs().max()) for a, b in zip(plain_grads, grads))
    return {
        "variant": name,
        "held_at_backward": held / plain_held,
        "step_peak": peak / plain_peak,
        "peak_mib": peak / 2**20,
        "time_vs_plain": statistics.median(ratios),
        "setup_s": setup_s,
        "bitwise": diff == 0.0,
        "max_grad_diff": diff,
    }


def compare_or_error(model, inputs, loss_fn, variant, *reference) -> dict:
    """``compare``'s row, or the error the variant raised: a variant that fails is a result."""
    try:
        return compare(model, inputs, loss_fn, variant, *reference)
    except Exception as exc:  # noqa: BLE001
        return {"variant": variant[0], "error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def run_model(name: str, budgets, rounds: int) -> list[dict]:
    model, inputs, loss_fn, blocks = build(name)
    nullcontext = __import__("contextlib").nullcontext
    for _ in range(2):
        measured_step(model, model, inputs, loss_fn, "ops")
    plain_grads, plain_peak, plain_held, _ = measured_step(model, model, inputs, loss_fn, "ops")
    rows = [
        {
            "model": name,
            "budget": None,
            "variant": "plain",
            "held_at_backward": 1.0,
            "step_peak": 1.0,
            "peak_mib": plain_peak / 2**20,
            "time_vs_plain": 1.0,
            "setup_s": 0.0,
            "bitwise": True,
            "max_grad_diff": 0.0,
        }
    ]
    fixed = [
        ("per-block checkpoint", lambda: Wrapped(blocks), model, 0.0, "ops"),
        (
            "torch selective checkpoint (save matmuls)",
            lambda: Wrapped(
                blocks, functools.partial(create_selective_checkpoint_contexts, save_matmuls)
            ),
            model,
            0.0,
            "ops",
        ),
        (
            "offload everything (save_on_cpu)",
            lambda: torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()),
            model,
            0.0,
            "ops",
        ),
    ]
    for variant in fixed:
        row = compare_or_error(
            model, inputs, loss_fn, variant, plain_grads, plain_peak, plain_held, rounds
        )
        rows.append({"model": name, "budget": None, **row})
        print(_line(rows[-1]), flush=True)
    began = time.perf_counter()
    graph = ss.profile(model, inputs, loss_fn, warmup=1, repeat=2)
    profile_s = time.perf_counter() - began
    # the graph as torch's checkpoint runs it: each region rebuilt at once, at its entry; in
    # eager mode what it reruns anyway (dropout masks drawn in place) recomputed, compiled saved
    policy_graph = ss.checkpoint_graph(graph)
    compiled_graph = ss.checkpoint_graph(graph, compiled=True)
    for budget in budgets:
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = budget
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager_decomp_partition")
        variants = [
            (
                f"torch.compile activation_memory_budget={budget}",
                nullcontext,
                compiled,
                0.0,
                "thread",
            )
        ]
        functorch_config.activation_memory_budget = 1.0
        try:
            began = time.perf_counter()
            plan = ss.solve(graph, budget, time_limit_s=10)  # the default solver (CP-SAT)
            plan_s = profile_s + time.perf_counter() - began
        except ss.InfeasibleBudget as exc:
            rows.append(
                {"model": name, "budget": budget, "variant": "slackswap", "error": str(exc)[:200]}
            )
            print(f"{name} {budget}: slackswap: infeasible ({str(exc)[:120]})", flush=True)
            plan = None
        pinned = None
        if plan is not None:
            # the exported policy runs a plan that keeps what torch's checkpoint holds anyway
            pinned, pinned_s = policy_plan(
                policy_graph, budget, name, "slackswap exported policy (checkpointed)", rows
            )
            pinned_s += profile_s
            variants.append(
                (
                    "slackswap executor (apply)",
                    lambda p=plan: ss.apply(p, model, graph=graph),
                    model,
                    plan_s,
                    "ops",
                )
            )
            if pinned is not None:
                variants.append(
                    (
                        "slackswap exported policy (checkpointed)",
                        lambda p=pinned: ss.checkpointed(model, p, policy_graph),
                        model,
                        pinned_s,
                        "ops",
                    )
                )
        for variant in variants:
            row = compare_or_error(
                model, inputs, loss_fn, variant, plain_grads, plain_peak, plain_held, rounds
            )
            if plan is not None and variant[0].startswith("slackswap"):
                used, for_graph = (
                    (plan, graph) if "executor" in variant[0] else (pinned, policy_graph)
                )
                simulated = ss.simulate(for_graph, used)
                row["simulated_peak_mib"] = simulated.peak_bytes / 2**20
                row["simulated_step_ms"] = simulated.step_time_s * 1e3
            rows.append({"model": name, "budget": budget, **row})
            print(_line(rows[-1]), flush=True)
        compiled_plan = None
        if pinned is not None:
            compiled_plan, compiled_s = policy_plan(
                compiled_graph,
                budget,
                name,
                "slackswap exported policy, compiled (aot_eager)",
                rows,
            )
            compiled_s += profile_s
        if compiled_plan is not None:
            with ss.checkpointed(model, compiled_plan, compiled_graph):
                torch._dynamo.reset()
                compiled = torch.compile(model, backend="aot_eager")
                variant = (
                    "slackswap exported policy, compiled (aot_eager)",
                    nullcontext,
                    compiled,
                    compiled_s,
                    "thread",
                )
                row = compare(
                    model, inputs, loss_fn, variant, plain_grads, plain_peak, plain_held, rounds
                )
            rows.append(
                {
                    "model": name,
                    "budget": budget,
                    **row,
                    "simulated_peak_mib": ss.simulate(compiled_graph, compiled_plan).peak_bytes
                    / 2**20,
                }
            )
            print(_line(rows[-1]), flush=True)
        torch._dynamo.reset()
    return rows


def policy_plan(graph, budget: float, model: str, variant: str, rows: list):
    """(plan for the exported policy on a checkpoint graph, or None, and the planning time): a
    budget with no such plan is a row saying so."""
    began = time.perf_counter()
    try:
        plan = ss.solve(graph, budget, time_limit_s=10, pins=ss.boundary_pins(graph))
    except ss.InfeasibleBudget as exc:
        rows.append(
            {
                "model": model,
                "budget": budget,
                "variant": variant,
                "error": f"no plan keeps the regions' inputs: {str(exc)[:120]}",
            }
        )
        print(_line(rows[-1]), flush=True)
        plan = None
    return plan, time.perf_counter() - began


def _line(r: dict) -> str:
    head = f"{r['model']:<7} {str(r.get('budget') or '-'):>4} {r['variant']:<48}"
    if "error" in r:
        return head + f" error: {r['error']}"
    grads = "bitwise" if r["bitwise"] else f"max diff {r['max_grad_diff']:.2e}"
    simulated = f" (simulated {r['simulated_peak_mib']:.0f})" if "simulated_peak_mib" in r else ""
    if "simulated_step_ms" in r:  # the plan's own step, from the profile's op times
        grads += f"  simulated step {r['simulated_step_ms']:.0f} ms"
    return (
        head + f" held {r['held_at_backward']:.2f}  peak {r['step_peak']:.2f} "
        f"({r['peak_mib']:.0f} MiB{simulated})  time {r['time_vs_plain']:.2f}x  setup "
        f"{r['setup_s']:.1f} s  {grads}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="0.7,0.5,0.3")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default="gpt2,resnet")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/vs_torch.json"))
    parser.add_argument("--results", action="store_true", help="write the table to RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for name in args.models.split(","):
        rows += run_model(name, [float(b) for b in args.budgets.split(",")], args.rounds)
    from results_md import save_outputs

    models = args.models.split(",")
    save_outputs(
        args.json,
        rows,
        args.results,
        "vs_torch" if models == ["gpt2", "resnet"] else "vs_torch_" + "_".join(models),
        "slackswap beside torch's checkpointing, torch.compile and offloading (CPU"
        + ("" if models == ["gpt2", "resnet"] else f": {', '.join(models)}")
        + ")",
        [_line(r) if "variant" in r else str(r) for r in rows],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
