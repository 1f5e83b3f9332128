"""Native solvers in a child process: crashes become errors or fallbacks, deadlines hold, and
the caller's process (its stdout, its other threads, its own PuLP) is left alone."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
from helpers import CAP, LINK, seeded_graph

import slackswap as ss
from slackswap.planners import native


def _worker(tmp_path, body: str):
    path = tmp_path / "worker.py"
    path.write_text(body)
    return path


def test_a_crashing_solver_is_an_error_not_a_dead_interpreter(tmp_path, monkeypatch):
    monkeypatch.setattr(
        native,
        "WORKER",
        _worker(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"),
    )
    with pytest.raises(native.NativeSolverError, match="SIGSEGV"):
        native.run_in_child("pulp", {}, None, 10.0)


@pytest.mark.slow
def test_the_deadline_kills_the_solver_and_its_children(tmp_path, monkeypatch):
    pids = tmp_path / "pids"
    monkeypatch.setattr(
        native,
        "WORKER",
        _worker(
            tmp_path,
            (
                "import os, subprocess, sys, time\n"
                "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
                "time.sleep(60)\n"
            ),
        ),
    )
    start = time.perf_counter()
    with pytest.raises(native.NativeTimeout):
        native.run_in_child("pulp", {}, None, 1.0)
    assert time.perf_counter() - start < 3.0
    time.sleep(0.2)
    for pid in map(int, pids.read_text().split()):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # a zombie reaped by init may linger a moment; a live sleeper may not
        assert open(f"/proc/{pid}/stat").read().split()[2] == "Z", f"process {pid} survived"


def test_a_crashing_interior_point_solver_leaves_the_lp_bound_to_highs(tmp_path, monkeypatch):
    """PIQP (large graphs' LP bound) dies in its child: HiGHS's interior point method answers,
    with the simplex bound lowered by a millionth, not an error and not a wrong bound."""
    from slackswap.planners import limits, lpmodel

    g = seeded_graph(5, n_ops=10)
    simplex = ss.lp_bound(g, 0.5, LINK)
    monkeypatch.setattr(
        native,
        "WORKER",
        _worker(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"),
    )
    monkeypatch.setattr(limits, "IPM_FROM_POSITIONS", 0)
    crashed = lpmodel.LinearModel.solve_piqp
    outcomes = []
    monkeypatch.setattr(
        lpmodel.LinearModel,
        "solve_piqp",
        lambda self, **kw: outcomes.append(crashed(self, **kw)) or outcomes[-1],
    )
    interior = ss.lp_bound(g, 0.5, LINK)
    assert outcomes[0].status == 4 and "SIGSEGV" in outcomes[0].message
    assert interior.status == simplex.status == "optimal"
    extra = simplex.step_time_s - g.ideal_step_time_s
    assert (
        extra - 1e-5 * max(extra, g.ideal_step_time_s)
        <= interior.step_time_s - g.ideal_step_time_s
        <= extra + 1e-12
    )


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_exact_planner_falls_back_when_the_native_solver_crashes(solver, tmp_path, monkeypatch):
    if not ss.is_available(solver):
        pytest.skip(f"{solver} is not installed")
    monkeypatch.setattr(
        native,
        "WORKER",
        _worker(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"),
    )
    g = seeded_graph(22, n_ops=8)
    plan = ss.solve(
        g, 0.6, LINK, solver=solver, work_s=5, time_limit_s=CAP, full=True, warm_start=True, gap=0.0
    )
    assert ss.validate(g, plan).ok
    assert plan.info.status in ss.core.plan.STATUSES


@pytest.mark.slow
def test_concurrent_solves_leave_stdout_and_pulp_alone(capfd):
    """Four solves in threads beside a thread that prints: every printed line arrives, and a
    PuLP CBC solve of the user's own afterwards runs normally (nothing was patched)."""
    import pulp

    g = seeded_graph(22, n_ops=8)
    lines = 300
    errors = []

    def printer():
        for i in range(lines):
            print(f"user line {i}", flush=True)
            time.sleep(0.005)

    def solving(solver):
        try:
            ss.solve(
                g, 0.6, LINK, solver=solver, work_s=3, time_limit_s=CAP, gap=0.0, warm_start=False
            )
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=printer)] + [
        threading.Thread(target=solving, args=(s,)) for s in ("highs", "cbc", "highs", "cbc")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    out = capfd.readouterr().out
    assert sum(1 for line in out.splitlines() if line.startswith("user line")) == lines
    # the user's own PuLP model, solved by CBC in this process, is not cut short
    prob = pulp.LpProblem("user", pulp.LpMaximize)
    x = pulp.LpVariable("x", 0, 10, cat="Integer")
    prob += x
    prob += x <= 7.5
    start = time.perf_counter()
    prob.solve(pulp.PULP_CBC_CMD(msg=False))
    assert pulp.value(x) == 7 and time.perf_counter() - start < 10
    assert sys.stdout is not None
