"""Native solvers run in a child process: a crash in a C library (HiGHS, CBC) becomes an error,
a hard deadline holds (the child's whole process group is killed at it), and nothing the solver
prints reaches the user's stdout. No process-wide state of the caller is touched: no file
descriptor is redirected and nothing is patched.

The child runs ``native_worker.py`` by path, so it imports only the solver's own package. It dies
with its parent: the worker's first process only watches the parent (a parent-death signal where
Linux has one, and the end of the pipe the parent holds open) while a forked process solves, and
on the parent's death kills its whole process group (CBC's own process too) and removes the
temporary folder, in which the solver's own temporary files (PuLP's .mps and .mst) are written
too. An interrupt (Ctrl-C) kills the group at once (interrupts.py) and reaches the caller as
``KeyboardInterrupt``, the folder removed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .interrupts import running_child

WORKER = Path(__file__).with_name("native_worker.py")


class NativeSolverError(RuntimeError):
    """The native solver died (a crash, a signal) or answered nothing readable."""


class NativeTimeout(RuntimeError):
    """The native solver ran past its hard deadline and was killed."""


def run_in_child(
    kind: str,
    payload: dict[str, Any],
    arrays: dict[str, np.ndarray] | None,
    deadline_s: float | None,
) -> dict[str, Any]:
    """Run ``kind`` ("pulp", "scipy", "highs-mip" or "piqp") on ``payload`` (JSON) and ``arrays`` (npz) in a child
    process; its answer (JSON) or NativeSolverError / NativeTimeout. ``deadline_s`` None: no
    deadline (the caller set no time limit)."""
    with tempfile.TemporaryDirectory(prefix="slackswap-") as tmp:
        inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        inp.write_text(json.dumps(payload))
        if arrays:
            np.savez(Path(tmp) / "in.npz", allow_pickle=False, **arrays)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        # the solver's own temporary files (PuLP's model and start files) go into the folder
        env.update(TMPDIR=tmp, TMP=tmp, TEMP=tmp, SLACKSWAP_PARENT=str(os.getpid()))
        # the child's standard input is a pipe whose other end this process holds until the
        # child is done: its end (EOF) tells the worker that this process is gone
        alive_r, alive_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", str(WORKER), kind, tmp],
                stdin=alive_r,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env=env,
            )
        finally:
            os.close(alive_r)
        try:
            with running_child(proc.pid):
                _, err = proc.communicate(
                    timeout=None if deadline_s is None else max(0.05, deadline_s)
                )
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise NativeTimeout(
                f"{kind} solver killed at its {deadline_s:.2f} s deadline"
            ) from None
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            os.close(alive_w)
        if proc.returncode != 0:
            raise NativeSolverError(
                f"{kind} solver {_died(proc.returncode)}: "
                f"{err.decode(errors='replace').strip()[-300:]}"
            )
        try:
            return json.loads(out.read_text())
        except (OSError, ValueError) as exc:
            raise NativeSolverError(f"{kind} solver left no answer ({exc})") from None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.communicate()


def _died(code: int) -> str:
    if code < 0:
        try:
            return f"crashed ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
