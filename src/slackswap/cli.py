"""The `slackswap` command line: solve, compare, sweep, simulate, plot, profile."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from . import __version__
from .cli_errors import CliError
from .cli_fit import add_fit
from .core.errors import GraphError, InfeasibleBudget, PlanError
from .core.status import Status


def _graph(spec: str, hw):
    from .core.graph import load_graph
    from .workloads import WORKLOADS, workload

    if Path(spec).exists():
        return load_graph(spec)
    if spec in WORKLOADS:
        return workload(spec, hw)
    raise CliError(
        f"{spec!r} is neither a graph file nor a workload ({', '.join(sorted(WORKLOADS))})"
    )


def _budget(text: str) -> str:
    """The budget as the API reads a string (core/units.py): "0.5" and "50%" are fractions,
    "1000000", "4e10" and "12GiB" bytes, "smallest" the smallest any plan reaches."""
    return text


def _budget_arg(text: str) -> str:
    """--budget, refused as it is read when it is none of the accepted forms."""
    from .core.units import check_budget

    try:
        return check_budget(text, "--budget")  # type: ignore[return-value]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _memory_arg(text: str) -> int:
    """--memory, read as bytes when the command line is parsed."""
    try:
        return _bytes(text)
    except (CliError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def cmd_solve(args) -> int:
    from .check.simulate import simulate
    from .core.hardware import hardware
    from .solve import solve

    hw = hardware(args.hardware)
    g = _graph(args.graph, hw)
    with _Spinner(f"solving {g.name} with {args.solver}"):
        plan = solve(
            g,
            _budget(args.budget),
            hw,
            solver=args.solver,
            time_limit_s=args.time_limit,
            allowed=args.allowed,
        )
    sim = simulate(g, plan)
    print(
        f"{g.name}: {plan.count('keep')} keep, {plan.count('swap')} swap, "
        f"{plan.count('recompute')} recompute; status {plan.info.status}, gap "
        f"{_pct(plan.info.gap)}, solved in {plan.info.wall_s:.2f} s"
    )
    print(sim.summary())
    if args.out:
        plan.save(args.out)
        print(f"wrote {args.out}")
    return 0


def cmd_compare(args) -> int:
    from .compare import compare
    from .core.hardware import hardware

    hw = hardware(args.hardware)
    g = _graph(args.graph, hw)
    solvers = tuple(args.solvers.split(","))
    rows = []
    with _Progress(len(solvers), "solvers") as bar:
        for s in solvers:
            rows.extend(
                compare(
                    g,
                    _budget(args.budget),
                    hw,
                    solvers=(s,),
                    time_limit_s=args.time_limit,
                    allowed=args.allowed,
                )
            )
            bar.update(1)
    print(
        f"{'solver':<14} {'status':<10} {'retention':>9} {'step ms':>9} {'peak GiB':>9} "
        f"{'stall ms':>9} {'solve s':>8} {'gap':>8}"
    )
    for r in rows:
        if r.get("status") == Status.INFEASIBLE and "retention" not in r:
            print(f"{r['solver']:<14} infeasible  {r.get('error', '')}")
            continue
        fit = "" if r["fits"] else "  (over budget)"
        print(
            f"{r['solver']:<14} {r['status']:<10} {_pct(r['retention']):>9} "
            f"{1e3 * r['step_time_s']:9.2f} {r['peak_bytes'] / 2**30:9.3f} {1e3 * r['stall_s']:9.2f} "
            f"{r['wall_s']:8.2f} {_pct(r['gap']):>8}{fit}"
        )
    return 0


def _sweep_row(task):
    workload_name, fraction, solver, hw_name, time_limit = task
    from .compare import infeasible_row, result_row
    from .core.budget import parse_budget
    from .core.hardware import hardware
    from .solve import solve

    hw = hardware(hw_name)
    g = _graph(workload_name, hw)
    budget = parse_budget(fraction, g, hw)
    context = {"workload": workload_name, "budget_fraction": fraction}
    try:
        plan = solve(g, budget, hw, solver=solver, time_limit_s=time_limit, strict=False)
    except InfeasibleBudget as exc:
        return infeasible_row(solver, exc, **context)
    return result_row(g, plan, **context)


def cmd_sweep(args) -> int:
    from concurrent.futures import ProcessPoolExecutor

    out = Path(args.out)
    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            if line.strip():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    raise CliError(f"{out}: not a JSONL file of sweep rows") from None
                done.add((r["workload"], float(r["budget_fraction"]), r["solver"]))
    tasks = []
    for w in args.workloads.split(","):
        for b in args.budgets.split(","):
            for s in args.solvers.split(","):
                if (w, float(b), s) not in done:
                    tasks.append((w, float(b), s, args.hardware, args.time_limit))
    if not tasks:
        print(f"{out}: all {len(done)} rows present")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as fh, _Progress(len(tasks), "rows") as bar:
        if args.workers <= 1:
            results = map(_sweep_row, tasks)
            for row in results:
                fh.write(json.dumps(row) + "\n")
                fh.flush()
                bar.update(1)
        else:
            with ProcessPoolExecutor(max_workers=args.workers) as pool:
                for row in pool.map(_sweep_row, tasks):
                    fh.write(json.dumps(row) + "\n")
                    fh.flush()
                    bar.update(1)
    print(f"wrote {len(tasks)} rows to {out} ({len(done)} already there)")
    return 0


def cmd_simulate(args) -> int:
    from .check.simulate import simulate
    from .core.complete import load_plan
    from .core.hardware import hardware

    g = _graph(args.graph, hardware(args.hardware or "a100-80gb-pcie4"))
    plan = load_plan(args.plan, graph=g, hardware=args.hardware)
    sim = simulate(g, plan, args.hardware)
    exp = sim.expansion
    print(sim.summary())
    print(f"{'t (ms)':>10} {'dur (ms)':>9} {'memory MiB':>11}  what")
    memory = exp.memory()
    for start, end, op, kind in sim.compute_intervals[: args.limit]:
        what = ("forward", "rerun", "backward")[int(kind)]
        mem = f"{memory[int(op)] / 2**20:11.2f}" if kind == 0 else ""
        print(
            f"{1e3 * start:10.3f} {1e3 * (end - start):9.3f} {mem:>11}  {what} {g.ops[int(op)].name}"
        )
    if len(sim.compute_intervals) > args.limit:
        print(f"... {len(sim.compute_intervals) - args.limit} more ops (--limit)")
    for lane, ivs in (("D2H", sim.d2h_intervals), ("H2D", sim.h2d_intervals)):
        busy = sum(e - s for s, e, _ in ivs)
        print(f"{lane}: {len(ivs)} copies, busy {1e3 * busy:.2f} ms")
    if not sim.fits:
        print("does not fit the budget:")
        for v in sim.violations[:5]:
            print(f"  {v}")
    return 0 if sim.fits else 1


def cmd_plot(args) -> int:
    from .check.simulate import simulate
    from .core.complete import load_plan
    from .core.hardware import hardware
    from .plot import plot_gantt, plot_memory

    g = _graph(args.graph, hardware(args.hardware or "a100-80gb-pcie4"))
    sims = {}
    budget = 0
    for p in args.plans:
        plan = load_plan(p, graph=g, hardware=args.hardware)
        sims[f"{Path(p).stem} ({plan.info.solver})"] = simulate(g, plan, args.hardware)
        budget = max(budget, plan.budget_bytes)
    written = plot_memory(sims, budget, f"{args.out}-memory", title=f"{g.name}: activation memory")
    first = next(iter(sims.values()))
    written += plot_gantt(g, first, f"{args.out}-lanes")
    for w in written:
        print(f"wrote {w}")
    return 0


def cmd_profile(args) -> int:
    from .runtime.profiler import profile

    module_name, _, func_name = args.target.partition(":")
    if not func_name:
        raise CliError(
            "profile target must be MODULE:FUNCTION (a function returning model, inputs, loss_fn)"
        )
    sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CliError(f"cannot import {module_name!r}: {exc}") from None
    fn = getattr(module, func_name, None)
    if fn is None:
        raise CliError(f"module {module_name!r} has no function {func_name!r}")
    result = fn()
    if not isinstance(result, tuple) or len(result) != 3:
        raise CliError(f"{args.target} must return (model, inputs, loss_fn)")
    model, inputs, loss_fn = result
    with _Spinner("profiling"):
        g = profile(model, inputs, loss_fn, warmup=args.warmup, repeat=args.repeat, name=args.name)
    Path(args.out).write_text(g.to_json(indent=1))
    print(f"{g.summary()}; wrote {args.out}")
    return 0


def _bytes(text: str) -> int:
    from .core.units import budget_bytes_from

    def no_fraction() -> int:
        raise CliError(f"--memory {text!r}: give bytes or a size such as 80GB, not a fraction")

    return budget_bytes_from(text, no_fraction)


class _Progress:
    """A tqdm bar on stderr (hidden when not a terminal, as in CI logs)."""

    def __init__(self, total: int, unit: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit=unit, file=sys.stderr, disable=not sys.stderr.isatty())

    def __enter__(self):
        return self.bar

    def __exit__(self, *exc):
        self.bar.close()


class _Spinner(_Progress):
    def __init__(self, what: str):
        super().__init__(1, "step")
        self.bar.set_description(what)


class _Parser(argparse.ArgumentParser):
    """Bad arguments are bad input like any other: one line, exit status 2."""

    def error(self, message: str):
        raise CliError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="slackswap",
        description="Plan the activation memory of "
        "a training step: keep, swap to host, or recompute.",
    )
    parser.add_argument("--version", action="version", version=f"slackswap {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(p, budget=True):
        p.add_argument(
            "--hardware", default="a100-80gb-pcie4", help="hardware preset (default %(default)s)"
        )
        if budget:
            p.add_argument(
                "--budget",
                required=True,
                type=_budget_arg,
                help='fraction of the keep-all peak (0.5), bytes (4e10, 12GiB), or "smallest"',
            )
        p.add_argument(
            "--time-limit",
            type=float,
            default=10.0,
            help="seconds per exact solve (default %(default)s)",
        )
        p.add_argument(
            "--allowed",
            default=None,
            help="decisions plans may use, e.g. keep,recompute (default: all three)",
        )

    p = sub.add_parser("solve", help="plan one graph or workload")
    p.add_argument("graph", help="graph JSON file or workload name")
    common(p)
    p.add_argument("--solver", default="cpsat")
    p.add_argument("--out", help="write the plan JSON here")
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("compare", help="every solver side by side")
    p.add_argument("graph")
    common(p)
    p.add_argument("--solvers", default="heuristic,cpsat,cbc,highs,recompute-all,swap-all")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser(
        "sweep", help="solvers x budgets x workloads, one JSON line per row (resumable)"
    )
    p.add_argument("--workloads", required=True)
    p.add_argument("--budgets", required=True)
    p.add_argument("--solvers", default="heuristic,cpsat")
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=1)
    common(p, budget=False)
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("simulate", help="the step's timeline under a plan, in text")
    p.add_argument("graph")
    p.add_argument("plan")
    p.add_argument("--hardware", help="simulate on this preset instead of the plan's hardware")
    p.add_argument("--limit", type=int, default=60, help="ops to list")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("plot", help="memory against the budget and a Gantt chart of the lanes")
    p.add_argument("graph")
    p.add_argument("plans", nargs="+")
    p.add_argument("--hardware", help="simulate on this preset instead of each plan's hardware")
    p.add_argument("--out", default="slackswap-plot")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("profile", help="profile MODULE:FUNCTION returning (model, inputs, loss_fn)")
    p.add_argument("target")
    p.add_argument("--out", required=True)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--name")
    p.set_defaults(func=cmd_profile)

    add_fit(sub)
    return parser


def check_output(path: str, prefix: bool = False) -> None:
    """Before any work: ``path`` (a file to write, or with ``prefix`` the start of file names)
    can be written. A directory, a missing or read-only folder is bad input (CliError)."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if not prefix and target.is_dir():
        raise CliError(f"--out {path}: is a directory; name a file")
    if not prefix and target.exists() and not os.access(target, os.W_OK):
        raise CliError(f"--out {path}: the file is not writable")
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # sweep creates missing folders; the first existing one decides
    if not existing.is_dir():
        raise CliError(f"--out {path}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CliError(f"--out {path}: the folder {existing} is not writable")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if getattr(args, "out", None):
            check_output(args.out, prefix=args.func is cmd_plot)
        return args.func(args)
    except (
        CliError,
        GraphError,
        PlanError,
        InfeasibleBudget,
        ValueError,
        FileNotFoundError,
        ImportError,
        KeyError,
    ) as exc:
        print(f"slackswap: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a write that failed anyway (disk full, removed meanwhile)
        print(
            f"slackswap: error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "),
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
