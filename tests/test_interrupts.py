"""Processes and files are left clean: a native solver's child dies with its parent (SIGKILL,
SIGTERM), Ctrl-C ends a solve as KeyboardInterrupt with its children reaped, and no solve leaves
files in the temporary directory (CBC killed at its deadline included)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

import slackswap as ss

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")

SOLVING = textwrap.dedent("""
    import signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Ctrl-C
    import slackswap as ss
    hw = ss.hardware("a100-80gb-pcie4")
    g = ss.workload("gpt2-xl", hw)
    print("solving", flush=True)
    try:
        ss.solve(g, 0.3, hw, solver=sys.argv[1], time_limit_s=120, work_s=120)
        print("returned", flush=True)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
""")


def workers_in(folder: Path) -> list[int]:
    """Processes whose command line names ``folder`` (the native workers started from it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "native_worker.py" in cmdline and str(folder) in cmdline:
            found.append(int(entry.name))
    return found


def wait_for(condition, limit_s: float = 60.0, every_s: float = 0.05) -> bool:
    """Poll ``condition`` until it holds (an event, not a speed: the limit is generous)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(every_s)
    return condition()


def start(solver: str, tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SOLVING, solver],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # mid-solve: a native child is running (the MILP's, or an integral relaxation's)
    assert wait_for(lambda: workers_in(tmp_path) or proc.poll() is not None), "no child started"
    assert proc.poll() is None
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_a_killed_parent_leaves_no_child_and_no_folder(solver, how, tmp_path):
    proc = start(solver, tmp_path)
    proc.send_signal(how)
    proc.communicate()
    # the workers notice the parent is gone, kill their process groups and remove their folders
    assert wait_for(lambda: not workers_in(tmp_path)), workers_in(tmp_path)
    assert wait_for(lambda: not any(tmp_path.iterdir())), list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["cbc", "highs", "cpsat"])
def test_ctrl_c_ends_the_solve_as_keyboard_interrupt_and_cleans_up(solver, tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SOLVING, solver],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "solving"
    if solver != "cpsat":
        assert wait_for(lambda: bool(workers_in(tmp_path))), "no child started"
    else:
        time.sleep(3)  # inside the planner (a CP-SAT search or a relaxation's child)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert out.strip().splitlines()[-1] == "KeyboardInterrupt", (out, err[-2000:])
    assert "Abort" not in err and "terminate called" not in err
    assert not workers_in(tmp_path)
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


@pytest.mark.slow
def test_an_ordinary_solve_leaves_nothing_in_the_temporary_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    g = ss.workload("bert-large", "a100-80gb-pcie4")
    for solver in ("cbc", "highs"):
        # a limit shorter than the MILP needs: CBC is killed at its deadline, whose files
        # (PuLP's .mps and .mst) stayed behind before
        ss.solve(g, 0.3, "a100-80gb-pcie4", solver=solver, time_limit_s=4, strict=False)
        ss.solve(g, 0.5, "a100-80gb-pcie4", solver=solver, time_limit_s=20, strict=False)
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


def test_an_unknown_solver_kind_is_an_error_in_the_child():
    from slackswap.planners.native import NativeSolverError, run_in_child

    with pytest.raises(NativeSolverError, match="unknown solver kind 'nope'"):
        run_in_child("nope", {}, None, 30.0)


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [0.0, 0.5, 1.5, 4.0])
def test_ctrl_c_at_any_moment_of_a_cpsat_solve_is_a_keyboard_interrupt(after_s, tmp_path):
    """At the search's start, in the relaxations (a native child), beside the background
    departure search (a CP-SAT search in a thread): the process ends by KeyboardInterrupt, never
    by an abort of a native thread left running as the interpreter exits."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SOLVING, "cpsat"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "solving"
    time.sleep(after_s)  # a moment, not a speed: each moment is a case that must hold
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    # the process ends by KeyboardInterrupt (caught: exit 0) or by SIGINT's own default action
    # (-2: an interpreter that ends on an interrupt re-raises the signal), never by an abort
    # (-6, SIGABRT: "terminate called without an active exception")
    assert proc.returncode in (0, -signal.SIGINT), (proc.returncode, err[-2000:])
    if proc.returncode == 0:
        assert out.strip().splitlines()[-1] in ("KeyboardInterrupt", "returned"), (out, err)
    assert "Abort" not in err and "terminate called" not in err
    assert not workers_in(tmp_path)


def test_a_ctrl_c_while_a_solver_library_loads_is_not_a_missing_library(tmp_path, monkeypatch):
    """pybind11 extension modules (OR-Tools) turn an interrupt during their initialisation into
    ImportError("initialization failed"): a Ctrl-C while cpsat loads on a busy machine was
    reported as "solver 'cpsat' is not available here". It stays a KeyboardInterrupt; an
    ImportError of its own is still a missing library."""
    from slackswap.planners.base import installed

    (tmp_path / "interrupted_ext.py").write_text(
        "try:\n    raise KeyboardInterrupt\n"
        "except KeyboardInterrupt as exc:\n"
        "    raise ImportError('initialization failed') from exc\n"
    )
    (tmp_path / "missing_ext.py").write_text("raise ImportError('no such library')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        installed("interrupted_ext")
    assert installed("missing_ext") is False
    assert installed("json") is True


def test_a_ctrl_c_inside_any_import_of_a_solve_is_a_keyboard_interrupt():
    """The same inside a solve, for an import no availability check makes (a library that
    imports a pybind11 module lazily, as PuLP's HiGHS interface does): interruptible() turns
    the ImportError an interrupt caused back into a KeyboardInterrupt, and leaves any other
    ImportError as it is."""
    from slackswap.planners.interrupts import interruptible

    def interrupted_import():
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise ImportError("initialization failed") from exc

    with pytest.raises(KeyboardInterrupt), interruptible():
        interrupted_import()
    with pytest.raises(ImportError, match="no such library"), interruptible():
        raise ImportError("no such library")
    # the same off the main thread, where SIGINT is not watched (a server's worker thread)
    import threading

    caught: list[BaseException] = []

    def in_a_thread():
        try:
            with interruptible():
                interrupted_import()
        except BaseException as exc:  # noqa: BLE001 - what it raised is the point
            caught.append(exc)

    worker = threading.Thread(target=in_a_thread)
    worker.start()
    worker.join()
    assert len(caught) == 1 and isinstance(caught[0], KeyboardInterrupt)
