"""The child side of native.run_in_child: read a model, solve it, write the answer.

Run as ``python -I native_worker.py KIND FOLDER``; imports only the solver's package, never
slackswap. Its first process forks the solver and watches the parent (supervise): a worker whose
parent died kills its process group and removes FOLDER. KIND "pulp": a PuLP problem (``LpProblem.to_dict``) and a solver spec; KIND "scipy":
scipy.optimize linprog / milp on arrays from FOLDER/in.npz; KIND "highs-mip": the integral
relaxation through highspy; KIND "piqp": an LP by PIQP's interior point method.
"""

import json
import os
import sys
from pathlib import Path


def solve_pulp(req: dict) -> dict:
    import warnings

    warnings.simplefilter("ignore")
    import pulp

    variables, prob = pulp.LpProblem.from_dict(req["problem"])
    opts = req["options"]
    nodes = opts.get("max_nodes")  # a work limit (with one thread, the same on any machine)
    if req["solver"] == "cbc":
        solver = pulp.PULP_CBC_CMD(
            msg=False,
            timeLimit=max(1, int(round(opts["time_limit_s"]))),
            threads=opts["workers"],
            warmStart=opts["warm"],
            gapRel=opts["gap"],
            options=opts.get("cbc_options", []),
            maxNodes=None if nodes is None else int(nodes),
        )
    else:
        extra = {} if nodes is None else {"mip_max_nodes": int(nodes)}
        solver = pulp.HiGHS(
            msg=False,
            timeLimit=float(opts["time_limit_s"]),
            threads=opts["workers"],
            gapRel=opts["gap"],
            warmStart=opts["warm"],
            random_seed=opts["seed"],
            output_flag=False,
            **extra,
        )
    prob.solve(solver)
    return {
        "status": pulp.LpStatus.get(prob.status, "Undefined"),
        "solution": {1: "optimal", 2: "feasible"}.get(getattr(prob, "sol_status", 0)),
        "values": {name: v.varValue for name, v in variables.items()},
        "objective": pulp.value(prob.objective),
    }


def solve_scipy(req: dict, folder: Path) -> dict:
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, linprog, milp
    from scipy.sparse import csr_matrix

    data = np.load(folder / "in.npz")

    def matrix(name):
        return csr_matrix(
            (data[f"{name}_data"], data[f"{name}_indices"], data[f"{name}_indptr"]),
            shape=tuple(data[f"{name}_shape"]),
        )

    A_ub, A_eq = matrix("ub"), matrix("eq")
    opts = req["options"]
    if req["problem"] == "lp":
        res = linprog(
            data["c"],
            A_ub=A_ub,
            b_ub=data["b_ub"],
            A_eq=A_eq,
            b_eq=data["b_eq"],
            bounds=np.stack([data["lb"], data["ub_vars"]], axis=1),
            method="highs",
            options={"time_limit": opts["time_limit_s"]},
        )
        bound = None
    else:
        res = milp(
            data["c"],
            integrality=data["integrality"],
            constraints=[
                LinearConstraint(A_ub, -np.inf, data["b_ub"]),
                LinearConstraint(A_eq, data["b_eq"], data["b_eq"]),
            ],
            bounds=Bounds(data["lb"], data["ub_vars"]),
            options={
                "time_limit": opts["time_limit_s"],
                "mip_rel_gap": opts["gap"],
                "disp": False,
                **({"node_limit": opts["node_limit"]} if "node_limit" in opts else {}),
            },
        )
        bound = getattr(res, "mip_dual_bound", None)
    x = None if res.x is None else [float(v) for v in res.x]
    return {
        "status": int(res.status),
        "message": str(res.message),
        "x": x,
        "fun": None if res.fun is None else float(res.fun),
        "dual_bound": None if bound is None else float(bound),
    }


def solve_highs_mip(req: dict, folder: Path) -> dict:
    """The integral relaxation with highspy directly: every HiGHS option is reachable, among them
    ``mip_max_improving_sols``, a limit on work that (unlike time) does not depend on the load of
    the machine: HiGHS's path is deterministic, so the k-th improving solution is the same on
    every run."""
    import highspy
    import numpy as np

    # numpy alone (no scipy.sparse: its import is most of this child's start)
    data = np.load(folder / "in.npz")
    parts = [
        (data[f"{k}_data"], data[f"{k}_indices"], data[f"{k}_indptr"], data[f"{k}_shape"])
        for k in ("ub", "eq")
    ]
    n = int(parts[0][3][1])
    rows = np.concatenate(
        [
            np.repeat(np.arange(int(shape[0])) + offset, np.diff(indptr))
            for (_, _, indptr, shape), offset in zip(parts, (0, int(parts[0][3][0])))
        ]
    ).astype(np.int64)
    cols = np.concatenate([p[1] for p in parts]).astype(np.int64)
    values = np.concatenate([p[0] for p in parts]).astype(float)
    order = np.lexsort((rows, cols))  # column-major: HiGHS's colwise format
    start = np.concatenate([[0], np.cumsum(np.bincount(cols, minlength=n))])
    A_rows = int(parts[0][3][0]) + int(parts[1][3][0])
    inf = highspy.kHighsInf
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n, A_rows
    lp.col_cost_ = data["c"]
    lp.col_lower_ = np.where(np.isfinite(data["lb"]), data["lb"], -inf)
    lp.col_upper_ = np.where(np.isfinite(data["ub_vars"]), data["ub_vars"], inf)
    lp.row_lower_ = np.concatenate([np.full(len(data["b_ub"]), -inf), data["b_eq"]])
    lp.row_upper_ = np.concatenate([data["b_ub"], data["b_eq"]])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = start.astype(np.int32)
    lp.a_matrix_.index_ = rows[order].astype(np.int32)
    lp.a_matrix_.value_ = values[order]
    lp.integrality_ = [
        highspy.HighsVarType.kInteger if v else highspy.HighsVarType.kContinuous
        for v in data["integrality"]
    ]
    h = highspy.Highs()
    opts = req["options"]
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("time_limit", float(opts["time_limit_s"]))
    h.setOptionValue("mip_rel_gap", float(opts["gap"]))
    if "abs_gap" in opts:
        h.setOptionValue("mip_abs_gap", float(opts["abs_gap"]))
    for name in ("mip_max_improving_sols", "mip_max_nodes", "simplex_iteration_limit"):
        if name in opts:
            h.setOptionValue(name, int(opts[name]))
    for name, value in opts.get("highs", {}).items():  # further HiGHS options, by name
        h.setOptionValue(name, value)
    h.passModel(lp)
    if "start_index" in data.files:  # a partial starting solution: HiGHS completes it
        index = data["start_index"].astype(np.int32)
        h.setSolution(len(index), index, data["start_value"].astype(float))
    h.run()
    status = h.getModelStatus()
    ms = highspy.HighsModelStatus
    info = h.getInfo()
    has_x = info.primal_solution_status == 2  # a feasible point
    x = list(map(float, h.getSolution().col_value)) if has_x else None
    kind: str | None = {ms.kOptimal: "optimal", ms.kInfeasible: "infeasible"}.get(status)
    if kind is None:
        limits = {ms.kTimeLimit: "time", ms.kSolutionLimit: "work", ms.kIterationLimit: "work"}
        limits[getattr(ms, "kNodeLimit", ms.kSolutionLimit)] = "work"
        kind = f"{limits[status]} limit" if status in limits else "failed"
    return {
        "status": kind,
        "message": h.modelStatusToString(status),
        "x": x,
        "fun": float(info.objective_function_value) if has_x else None,
        "dual_bound": float(info.mip_dual_bound),
        "nodes": int(info.mip_node_count),
        "iterations": int(info.simplex_iteration_count),
    }


def solve_piqp(req: dict, folder: Path) -> dict:
    """An LP by PIQP (a sparse interior point method with a direct LDL factorisation): on the LP
    bound's long chains of running sums it is 10x faster than HiGHS's IPX at 640 layers. Its
    iteration limit is a work limit; both objectives are returned (the dual one bounds the
    optimum from below once the dual is feasible)."""
    import numpy as np
    import piqp
    from scipy.sparse import csc_matrix, csr_matrix

    data = np.load(folder / "in.npz")

    def matrix(name):
        return csc_matrix(
            csr_matrix(
                (data[f"{name}_data"], data[f"{name}_indices"], data[f"{name}_indptr"]),
                shape=tuple(data[f"{name}_shape"]),
            )
        )

    A_ub, A_eq = matrix("ub"), matrix("eq")
    n = A_ub.shape[1]
    solver = piqp.SparseSolver()
    solver.settings.verbose = False
    solver.settings.num_threads = 1
    if "max_iterations" in req["options"]:
        solver.settings.max_iter = int(req["options"]["max_iterations"])
    solver.setup(
        csc_matrix((n, n)),
        data["c"],
        A_eq,
        data["b_eq"],
        A_ub,
        np.full(A_ub.shape[0], -np.inf),
        data["b_ub"],
        data["lb"],
        data["ub_vars"],
    )
    status = solver.solve()
    info = solver.result.info
    kind = {
        piqp.Status.PIQP_SOLVED: "optimal",
        piqp.Status.PIQP_PRIMAL_INFEASIBLE: "infeasible",
        piqp.Status.PIQP_MAX_ITER_REACHED: "work limit",
    }.get(status, "failed")
    solved = kind == "optimal"
    return {
        "status": kind,
        "message": str(status).split(".")[-1],
        "x": [float(v) for v in solver.result.x] if solved else None,
        "fun": float(info.primal_obj) if solved else None,
        "dual_bound": float(info.dual_obj) if solved else None,
        "duality_gap_rel": float(info.duality_gap_rel),
        "iterations": int(info.iter),
    }


# the solvers by kind: native.run_in_child names one; an unknown kind is an error, never a
# fallback to another solver
SOLVERS = {
    "pulp": lambda req, folder: solve_pulp(req),
    "scipy": solve_scipy,
    "highs-mip": solve_highs_mip,
    "piqp": solve_piqp,
}


def main() -> int:
    kind, folder = sys.argv[1], Path(sys.argv[2])
    if kind not in SOLVERS:
        print(
            f"native worker: unknown solver kind {kind!r}; known: {', '.join(SOLVERS)}",
            file=sys.stderr,
        )
        return 2
    solver = os.fork()
    if solver == 0:  # the solver; this process's first one watches the parent
        try:
            req = json.loads((folder / "in.json").read_text())
            answer = SOLVERS[kind](req, folder)
            (folder / "out.json").write_text(json.dumps(answer))
        except BaseException:  # noqa: BLE001 - reported on stderr, the exit status says it
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        sys.stderr.flush()
        os._exit(0)
    return supervise(solver, folder)


def supervise(solver: int, folder: Path) -> int:
    """Wait for the solver; if the parent dies first (its end of standard input closes, or the
    parent-death signal arrives), remove the folder and kill this whole process group (the
    solver and any process it started, CBC's own). Returns the solver's exit status, or dies of
    the signal that killed it."""
    import select
    import shutil
    import signal

    parent = int(os.environ.get("SLACKSWAP_PARENT", os.getppid()))

    def orphaned(*_args) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        os.killpg(0, signal.SIGKILL)

    signal.signal(signal.SIGTERM, orphaned)
    signal.signal(signal.SIGHUP, orphaned)
    _parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the signal was asked for
        orphaned()
    try:
        watch = [0, os.pidfd_open(solver)]
        poll_s = None
    except (AttributeError, OSError):  # no pidfd: poll the solver
        watch, poll_s = [0], 0.02
    while True:
        ready, _, _ = select.select(watch, [], [], poll_s)
        if 0 in ready and not os.read(0, 1):
            orphaned()
        done, status = os.waitpid(solver, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)
            return os.waitstatus_to_exitcode(status)


def _parent_death_signal(sig: int) -> None:
    """Linux: ``sig`` arrives when the parent dies (prctl PR_SET_PDEATHSIG); elsewhere the end of
    standard input alone tells."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    raise SystemExit(main())
