"""The fuzzer's classes beyond plans (benchmarks/fuzz.py): restricted minimums, false claims,
killed and interrupted solves, and models whose ops write state."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

import slackswap as ss

RECOMPUTE_ONLY = ("keep", "recompute")


def restricted_minimum(g, hw, seed: int, kind: dict) -> list[dict]:
    """The smallest budget with keep and recompute only: a plan at it, and none a byte below
    it where it is proven (InfeasibleBudget naming the same minimum)."""
    rec = {"seed": seed, "kind": kind, "solver": "min_budget"}
    try:
        smallest = ss.smallest_budget(g, hw, allowed=RECOMPUTE_ONLY)
        plan = ss.solve(g, smallest.budget_bytes, hw, allowed=RECOMPUTE_ONLY, solver="heuristic")
        ok = ss.validate(g, plan).ok
        below = None
        if smallest.proven and smallest.budget_bytes > 0:
            try:
                ss.solve(
                    g,
                    smallest.budget_bytes - 1,
                    hw,
                    allowed=RECOMPUTE_ONLY,
                    time_limit_s=60,
                    work_s=2,
                )
                below = "a plan below the proven minimum"
            except ss.InfeasibleBudget as exc:
                if exc.min_budget_bytes != smallest.budget_bytes:
                    below = f"InfeasibleBudget names {exc.min_budget_bytes}"
    except Exception as exc:  # noqa: BLE001 - counted, not hidden
        return [{**rec, "error": type(exc).__name__, "message": str(exc)[:200]}]
    violation = not ok or below is not None
    return [
        {
            **rec,
            "proven": smallest.proven,
            "minimum_violation": violation,
            "message": below or ("" if ok else "the plan at the minimum is refused"),
        }
    ]


def claims_checked(g, plan) -> int:
    """How many of five false claims about ``plan`` the checker or the loader accepts."""
    step = plan.info.predicted_step_time_s
    if step is None or step <= 0:
        return 0
    lies = [
        plan.with_info(bound=step * 1.5 + 1e-9, gap=None, overhead_gap=None),
        plan.with_info(status="optimal", bound=step * 0.5, gap=0.5, overhead_gap=None),
        plan.with_info(bound=step * 0.9, gap=0.5, overhead_gap=None),
        plan.with_info(bound=None, gap=0.1, overhead_gap=None),
    ]
    accepted = sum(1 for lie in lies if ss.validate(g, lie).ok)
    if plan.decisions:
        name = next(iter(plan.decisions))
        text = plan.to_json().replace('"decisions": {', f'"decisions": {{"{name}": "keep", ', 1)
        try:
            ss.load_plan(text)
            accepted += 1
        except ss.PlanError:
            pass
    return accepted


KILLED = textwrap.dedent("""
    import signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import slackswap as ss
    hw = ss.hardware("a100-80gb-pcie4")
    g = ss.workload(sys.argv[2], hw)
    print("solving", flush=True)
    try:
        ss.solve(g, float(sys.argv[3]), hw, solver=sys.argv[1], time_limit_s=120, work_s=120)
        print("returned", flush=True)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
""")


def _workers(folder: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "native_worker.py" in cmdline and str(folder) in cmdline:
                found.append(int(entry.name))
    return found


def kill_rounds(count: int, seed: int) -> dict:
    """Solves killed (SIGKILL, SIGTERM) or interrupted (SIGINT) at a random moment: children
    left running, files left behind, interrupts that did not arrive as KeyboardInterrupt."""
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    counts = {"kills": 0, "orphaned children": 0, "files left": 0, "interrupts lost": 0}
    if not Path("/proc").is_dir():
        return counts
    for _ in tqdm(range(count), unit="kill", file=sys.stderr):
        solver = str(rng.choice(["cbc", "highs", "cpsat"]))
        workload = str(rng.choice(["bert-large", "gpt2-xl"]))
        how = [signal.SIGKILL, signal.SIGTERM, signal.SIGINT][int(rng.integers(0, 3))]
        with tempfile.TemporaryDirectory(prefix="fuzz-kill-") as tmp:
            env = {**os.environ, "TMPDIR": tmp}
            proc = subprocess.Popen(
                [sys.executable, "-c", KILLED, solver, workload, str(rng.choice([0.3, 0.5]))],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            proc.stdout.readline()
            time.sleep(float(rng.uniform(0.2, 6.0)))
            proc.send_signal(how)
            out, _ = proc.communicate(timeout=120)
            counts["kills"] += 1
            if how == signal.SIGINT and "KeyboardInterrupt" not in out and "returned" not in out:
                counts["interrupts lost"] += 1
            end = time.monotonic() + 30
            while time.monotonic() < end and (_workers(Path(tmp)) or any(Path(tmp).iterdir())):
                time.sleep(0.1)
            counts["orphaned children"] += bool(_workers(Path(tmp)))
            counts["files left"] += bool(any(Path(tmp).iterdir()))
            for pid in _workers(Path(tmp)):  # leave no orphan behind the fuzzer itself
                os.kill(pid, signal.SIGKILL)
    return counts


def _state_model(rng):
    """A random small conv net whose forward writes state: batch norm (momentum set or
    cumulative), a functional batch norm on the module's own buffers, an in-place counter,
    laid out flat, nested, or in a ModuleDict."""
    import torch
    from torch import nn

    class Counter(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.register_buffer("seen", torch.zeros(c))

        def forward(self, x):
            self.seen.mul_(0.9).add_(x.detach().mean((0, 2, 3)))
            return x * torch.sigmoid(self.seen)[None, :, None, None]

    class FunctionalBN(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.register_buffer("mean", torch.zeros(c))
            self.register_buffer("var", torch.ones(c))

        def forward(self, x):
            return nn.functional.batch_norm(x, self.mean, self.var, training=True, momentum=0.2)

    def stateful(c):
        pick = int(rng.integers(0, 4))
        return [nn.BatchNorm2d(c), nn.BatchNorm2d(c, momentum=None), FunctionalBN(c), Counter(c)][
            pick
        ]

    class Listed(nn.Module):  # blocks in a ModuleList, called in a loop
        def __init__(self, blocks):
            super().__init__()
            self.blocks = nn.ModuleList(blocks)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    class Named(nn.Module):  # blocks in a ModuleDict, called by name
        def __init__(self, blocks):
            super().__init__()
            self.blocks = nn.ModuleDict({f"b{i}": b for i, b in enumerate(blocks)})

        def forward(self, x):
            for name in self.blocks:
                x = self.blocks[name](x)
            return x

    blocks = [
        nn.Sequential(nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1), stateful(8), nn.ReLU())
        for i in range(int(rng.integers(2, 5)))
    ]
    layout = int(rng.integers(0, 3))
    body = [nn.Sequential(*blocks), Listed(blocks), Named(blocks)][layout]
    return nn.Sequential(body, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def state_rounds(count: int, seed: int) -> dict:
    """Random state-writing models, a step under a plan recomputing all it may: the model's
    state and gradients against plain training."""
    import copy

    import torch

    rng = np.random.default_rng(seed)
    counts = {"state models": 0, "state differs": 0}
    for i in range(count):
        torch.manual_seed(seed + i)
        model = _state_model(rng)
        x = torch.randn(4, 3, 8, 8)
        loss_fn = lambda out: out.square().mean()  # noqa: E731
        graph = ss.profile(model, x, loss_fn, warmup=0, repeat=1)
        plain = copy.deepcopy(model)
        decisions = {
            graph.tensors[int(t)].name: "recompute" if graph.can_recompute[t] else "keep"
            for t in graph.saved
        }
        plan = ss.complete(
            ss.Plan(graph.name, graph.digest, 10**12, decisions), graph, "cpu-emulated-link"
        )
        plan = replace(plan, budget_bytes=10**12)
        for _ in range(2):
            loss_fn(plain(x)).backward()
            with ss.apply(plan, model, graph=graph):
                loss_fn(model(x)).backward()
        same = all(
            torch.equal(a, b)
            for a, b in zip(plain.state_dict().values(), model.state_dict().values())
        )
        same = same and all(
            (p.grad is None and q.grad is None)
            or (p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad))
            for p, q in zip(plain.parameters(), model.parameters())
        )
        counts["state models"] += 1
        counts["state differs"] += not same
    return counts
