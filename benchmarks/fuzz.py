"""Fuzz every planner with odd graphs, budgets and links; count what goes wrong.

    python benchmarks/fuzz.py [--graphs 2000] [--solvers heuristic,cpsat,cbc,highs]
        [--time-limit 2] [--workers 2] [--seed 0] [--json benchmarks/results/fuzz.json] [--results]

Graphs come from a generator of its own: chains, skips, branches, multi-reader saves, zero bytes,
zero times, 1e12-byte tensors, 1e-9 s ops, RNG groups, non-recomputable ops, on full- and half-
duplex links with and without latency. Exact planners get the small graphs (<= 12 ops). Each
graph runs in a worker process, so a native crash is counted, not fatal. Per plan it checks:
the independent checker passes it, its status is a documented one, no plan beats its own bound
or the LP bound, and solve() returns within max(0.5 s, 10%) of its time limit.

Per graph also (benchmarks/fuzz_classes.py): the smallest budget with keep and recompute only
(a plan at it; none a byte below a proven one), plans whose claims are made false (a bound above
the step, "optimal" far from the bound, a gap that is not the step's, a key given twice in the
file: the checker or the loader must refuse each). ``--kills N``: N solves killed (SIGKILL,
SIGTERM) or interrupted (SIGINT) at random moments: no child left running, no file left, the
interrupt reaching the caller. ``--state-models N``: N random torch models whose ops write
state (batch norm, in-place buffers, in several module layouts), trained a step under a plan that
recomputes all it may: the state and gradients as plain training's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

import slackswap as ss

STATUSES = {"optimal", "feasible", "timeout", "heuristic", "baseline"}
EXACT = {"cpsat", "cbc", "highs"}
SMALL_OPS = 12


def _bytes(rng, style: str) -> int:
    if style == "zero":
        return 0
    if style == "huge":
        return int(rng.choice([1, 1000, 10**6, 10**9, 10**12]))
    return int(rng.integers(1, 10**6))


def _seconds(rng, style: str) -> float:
    if style == "zero":
        return 0.0
    if style == "tiny":
        return float(rng.choice([0.0, 1e-9, 1e-6]))
    if style == "wide":
        return float(rng.choice([1e-9, 1e-6, 1e-3, 1.0]))
    return float(rng.uniform(1e-5, 1e-3))


def random_graph(seed: int) -> tuple[ss.ActivationGraph, ss.Hardware, dict]:
    """One graph of a random class, and a link to plan it on."""
    rng = np.random.default_rng(seed)
    shape = str(rng.choice(["chain", "skips", "branches", "multi-reader"]))
    byte_style = str(rng.choice(["plain", "plain", "zero", "huge"]))
    time_style = str(rng.choice(["plain", "plain", "zero", "tiny", "wide"]))
    n = int(rng.integers(2, 25)) if rng.random() < 0.8 else int(rng.integers(25, 80))
    ops, tensors, produced = [], [], []
    for i in range(n):
        if shape == "chain" or not produced:
            inputs = produced[-1:] or ["batch"]
        elif shape == "skips":
            inputs = produced[-1:] + (
                [produced[int(rng.integers(0, len(produced)))]] if rng.random() < 0.4 else []
            )
        elif shape == "branches":
            inputs = [produced[int(rng.integers(max(0, len(produced) - 4), len(produced)))]]
        else:
            k = int(rng.integers(1, min(3, len(produced)) + 1))
            inputs = list(rng.choice(produced, size=k, replace=False))
        inputs = list(dict.fromkeys(inputs))
        outs = [f"t{i}_{j}" for j in range(1 if rng.random() < 0.8 else 2)]
        op = {
            "name": f"op{i}",
            "forward_s": _seconds(rng, time_style),
            "backward_s": _seconds(rng, time_style),
            "inputs": inputs,
            "outputs": outs,
        }
        if rng.random() < 0.15:
            op["forward_workspace_bytes"] = _bytes(rng, byte_style)
        if rng.random() < 0.15:
            op["backward_workspace_bytes"] = _bytes(rng, byte_style)
        if rng.random() < 0.1:
            op["recomputable"] = False
        ops.append(op)
        for o in outs:
            tensors.append({"name": o, "bytes": _bytes(rng, byte_style), "saved_for": []})
        for name in inputs + outs:
            if name != "batch" and rng.random() < 0.6:
                entry = next(t for t in tensors if t["name"] == name)
                if op["name"] not in entry["saved_for"]:
                    entry["saved_for"].append(op["name"])
        produced.extend(outs)
    saved = [t for t in tensors if t["saved_for"]]
    if len(saved) >= 2 and rng.random() < 0.3:
        for t in rng.choice(saved, size=min(3, len(saved)), replace=False):
            t["group"] = "rng0"
    g = ss.load_graph(
        {"format": "slackswap.graph/1", "name": f"fuzz-{seed}", "ops": ops, "tensors": tensors}
    )
    base = ss.hardware("a100-80gb-pcie4")
    hw = base.with_link(
        name=f"fuzz-link-{seed}",
        duplex=bool(rng.random() < 0.7),
        latency_s=float(rng.choice([0.0, 1e-5, 1e-3])),
    )
    return g, hw, {"shape": shape, "bytes": byte_style, "times": time_style, "ops": n}


def run_graph(task) -> list[dict]:
    """Every budget x solver on one graph; one record per solve."""
    seed, solvers, time_limit = task
    g, hw, kind = random_graph(seed)
    out = []
    try:
        floor = ss.min_budget(g, hw)
        peak = ss.keep_all_peak(g, hw)
    except Exception as exc:  # noqa: BLE001 - counted, not hidden
        return [
            {
                "seed": seed,
                "kind": kind,
                "solver": "-",
                "error": type(exc).__name__,
                "message": str(exc)[:200],
            }
        ]
    from fuzz_classes import claims_checked, restricted_minimum

    out.extend(restricted_minimum(g, hw, seed, kind))
    budgets = sorted({max(floor, int(peak * f)) for f in (0.3, 0.6, 1.0)} | {floor})
    for budget in budgets:
        bound = None
        try:
            lp = ss.lp_bound(g, budget, hw)
            bound = lp.step_time_s if lp.status == "optimal" else None
            if lp.status == "infeasible":
                out.append(
                    {
                        "seed": seed,
                        "kind": kind,
                        "solver": "lp_bound",
                        "budget": budget,
                        "bound_violation": True,
                        "message": "LP bound infeasible at a feasible budget",
                    }
                )
        except Exception as exc:  # noqa: BLE001
            out.append(
                {
                    "seed": seed,
                    "kind": kind,
                    "solver": "lp_bound",
                    "budget": budget,
                    "error": type(exc).__name__,
                    "message": str(exc)[:200],
                }
            )
        for solver in solvers:
            if solver in EXACT and g.n_ops > SMALL_OPS:
                continue
            rec = {"seed": seed, "kind": kind, "solver": solver, "budget": budget}
            start = time.perf_counter()
            try:
                plan = ss.solve(g, budget, hw, solver=solver, time_limit_s=time_limit)
            except Exception as exc:  # noqa: BLE001
                rec.update(
                    error=type(exc).__name__,
                    message=str(exc)[:200],
                    wall_s=time.perf_counter() - start,
                )
                out.append(rec)
                continue
            wall = time.perf_counter() - start
            check = ss.validate(g, plan)
            step = check.step_time_s
            own_bound = plan.info.bound
            beaten = (
                bound is not None and step is not None and step < bound * (1 - 1e-7) - 1e-15
            ) or (
                own_bound is not None and step is not None and step < own_bound * (1 - 1e-7) - 1e-15
            )
            limit = time_limit if solver in EXACT else None
            rec.update(
                status=plan.info.status,
                valid=check.ok,
                wall_s=wall,
                bound_violation=bool(beaten),
                overrun=bool(limit is not None and wall > limit + max(0.5, 0.1 * limit)),
                message="" if check.ok else check.report()[:200],
            )
            if check.ok:
                rec["false_claims_accepted"] = claims_checked(g, plan)
            out.append(rec)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--graphs", type=int, default=2000)
    parser.add_argument("--solvers", default="heuristic,cpsat,cbc,highs")
    parser.add_argument("--time-limit", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/fuzz.json"))
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    parser.add_argument(
        "--kills",
        type=int,
        default=0,
        help="also kill or interrupt this many native solves at random moments",
    )
    parser.add_argument(
        "--state-models",
        type=int,
        default=0,
        help="also train this many random state-writing torch models",
    )
    args = parser.parse_args()
    from tqdm import tqdm

    solvers = [s for s in args.solvers.split(",") if ss.is_available(s)]
    tasks = [(args.seed + i, solvers, args.time_limit) for i in range(args.graphs)]
    records: list[dict] = []
    crashes: list[int] = []
    start = time.perf_counter()
    with tqdm(total=len(tasks), unit="graph", file=sys.stderr) as bar:
        todo = list(tasks)
        while todo:
            batch, todo = todo, []
            with ProcessPoolExecutor(max_workers=args.workers) as pool:
                futures = [(t, pool.submit(run_graph, t)) for t in batch]
                broken = False
                for task, fut in futures:
                    if broken:
                        todo.append(task)
                        continue
                    try:
                        records.extend(fut.result())
                        bar.update(1)
                    except BrokenProcessPool:
                        # a worker died (a native crash): run what is left again, one by one,
                        # to find which graph killed it
                        broken = True
                        if args.workers == 1 or len(batch) == 1:
                            crashes.append(task[0])
                            bar.update(1)
                        else:
                            todo.append(task)
                if broken and args.workers > 1:
                    args.workers = 1
    from fuzz_classes import kill_rounds, state_rounds

    extra = {}
    if args.kills:
        extra.update(kill_rounds(args.kills, args.seed))
    if args.state_models:
        extra.update(state_rounds(args.state_models, args.seed))
    summary = summarise(records, crashes, time.perf_counter() - start, args)
    summary["counts"].update(extra)
    print(json.dumps(summary, indent=1))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "summary": summary,
                "failures": [
                    r
                    for r in records
                    if r.get("error")
                    or r.get("valid") is False
                    or r.get("bound_violation")
                    or r.get("overrun")
                    or r.get("minimum_violation")
                    or r.get("false_claims_accepted")
                    or r.get("status") not in STATUSES | {None}
                ],
            },
            indent=1,
        )
    )
    if args.results:
        from results_md import command_line, markdown_table, write_section

        body = markdown_table(["what", "count"], [[k, v] for k, v in summary["counts"].items()])
        body += "\n\n" + markdown_table(
            ["solver", "plans", "statuses"],
            [
                [s, v["plans"], ", ".join(f"{k} {n}" for k, n in sorted(v["statuses"].items()))]
                for s, v in summary["by_solver"].items()
            ],
        )
        write_section("fuzz", "Fuzzing every planner", command_line(), body)
    bad = summary["counts"]
    return (
        1
        if any(
            bad.get(k)
            for k in (
                "invalid plans",
                "native crashes",
                "bound violations",
                "undocumented statuses",
                "time overruns",
                "minimum violations",
                "false claims accepted",
                "orphaned children",
                "files left",
                "interrupts lost",
                "state differs",
            )
        )
        else 0
    )


def summarise(records, crashes, wall, args) -> dict:
    plans = [r for r in records if "status" in r]
    errors = Counter(r["error"] for r in records if r.get("error"))
    by_solver: dict[str, dict] = {}
    for r in plans:
        s = by_solver.setdefault(r["solver"], {"plans": 0, "statuses": Counter()})
        s["plans"] += 1
        s["statuses"][r["status"]] += 1
    for s in by_solver.values():
        s["statuses"] = dict(s["statuses"])
    walls = [r["wall_s"] for r in plans if r["solver"] in EXACT]
    return {
        "graphs": args.graphs,
        "solvers": args.solvers,
        "time_limit_s": args.time_limit,
        "wall_s": round(wall, 1),
        "counts": {
            "plans": len(plans),
            "invalid plans": sum(1 for r in plans if not r["valid"]),
            "native crashes": len(crashes),
            "bound violations": sum(1 for r in records if r.get("bound_violation")),
            "undocumented statuses": sum(1 for r in plans if r["status"] not in STATUSES),
            "time overruns": sum(1 for r in plans if r.get("overrun")),
            "restricted minimums": sum(1 for r in records if r.get("solver") == "min_budget"),
            "minimum violations": sum(1 for r in records if r.get("minimum_violation")),
            "false claims tried": sum(5 for r in plans if "false_claims_accepted" in r),
            "false claims accepted": sum(r.get("false_claims_accepted", 0) for r in plans),
            **{f"exception {k}": v for k, v in sorted(errors.items())},
        },
        "crashed_graph_seeds": crashes,
        "exact_wall_s_max": round(max(walls), 2) if walls else None,
        "by_solver": by_solver,
        "non_finite": sum(1 for r in plans if not math.isfinite(r["wall_s"])),
    }


if __name__ == "__main__":
    raise SystemExit(main())
