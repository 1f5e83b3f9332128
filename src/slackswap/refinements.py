"""The training loop's background refinements: one child process at a time (refine.py), queued
per bucket, cancelled when the bucket goes or the loop ends, paused while the loop profiles.

Pausing stops the child and every process under it (SIGSTOP, found through /proc on Linux: the
integral relaxations' native workers too), so the profile's op times are the model's alone; they
continue (SIGCONT) when the profile is done. A paused search loses only wall time: its work
limits are the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from .core.graph import ActivationGraph
from .core.plan import Plan


def process_tree(root: int) -> list[int]:
    """``root`` and every process under it (Linux: from /proc; elsewhere ``root`` alone)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return [root]
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def _signal_tree(root: int, sig: int) -> list[int]:
    """Send ``sig`` to ``root`` and, level by level, to what is under it (a stopped parent
    starts no new child meanwhile). Returns the processes signalled."""
    sent: list[int] = []
    frontier = [root]
    while frontier:
        for pid in frontier:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
                sent.append(pid)
        under: list[int] = []
        for pid in frontier:
            under.extend(p for p in process_tree(pid) if p != pid and p not in sent)
        frontier = list(dict.fromkeys(under))
    return sent


def _state(pid: int) -> str | None:
    """The process's scheduler state (Linux /proc: "T" stopped, "Z" a zombie), None if gone or
    unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return None


def _wait_stopped(pids: list[int], limit_s: float = 5.0) -> None:
    """Until every process in ``pids`` is stopped or gone (at most ``limit_s``: a process that
    does not stop then is left; its load shows in the profile, nothing worse)."""
    if not Path("/proc").is_dir():
        return
    end = time.monotonic() + limit_s
    waiting = list(pids)
    while waiting and time.monotonic() < end:
        waiting = [pid for pid in waiting if _state(pid) not in (None, "T", "t", "Z", "X")]
        if waiting:
            time.sleep(0.001)


class _Running:
    def __init__(self, key, folder: Path, proc: subprocess.Popen, alive_w: int):
        self.key, self.folder, self.proc, self.alive_w = key, folder, proc, alive_w


class Refinements:
    """Plans refined in the background, one child process at a time, in submission order."""

    def __init__(self, solver: str, time_limit_s: float):
        self.solver = solver
        self.time_limit_s = float(time_limit_s)
        self.queue: OrderedDict[Any, tuple[ActivationGraph, Plan, dict]] = OrderedDict()
        self.running: _Running | None = None
        self.done: list[tuple[Any, Plan | Exception]] = []
        self._paused: list[int] = []

    # ------------------------------------------------------------ requests
    def submit(self, key, graph: ActivationGraph, plan: Plan, options: dict[str, Any]) -> None:
        """Refine ``plan`` (the heuristic's, for ``graph``) at its budget and hardware; replaces
        whatever was pending or running for ``key``."""
        self.cancel(key)
        self.queue[key] = (graph, plan, dict(options))
        self._start_next()

    def cancel(self, key) -> None:
        self.queue.pop(key, None)
        self.done = [(k, r) for k, r in self.done if k != key]
        if self.running is not None and self.running.key == key:
            self._stop_running()
            self._start_next()

    def finished(self) -> list[tuple[Any, Plan | Exception]]:
        """What has finished since the last call (never waits)."""
        self._poll()
        done, self.done = self.done, []
        return done

    def join(self, timeout_s: float | None = None) -> None:
        """Wait until nothing is running or queued (or ``timeout_s`` passes)."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while self.running is not None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.running.proc.wait(timeout=None if left is None else min(left, 0.5))
            self._poll()

    @contextlib.contextmanager
    def paused(self):
        """Stop the running refinement's whole process tree meanwhile."""
        stopped = []
        if self.running is not None and self.running.proc.poll() is None:
            stopped = _signal_tree(self.running.proc.pid, signal.SIGSTOP)
            _wait_stopped(stopped)  # a signal is delivered when the process is next scheduled
        self._paused = stopped
        try:
            yield stopped
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGCONT)
            self._paused = []

    def close(self) -> None:
        """Cancel everything: the running child is killed at once, the queue dropped."""
        self.queue.clear()
        self._stop_running()

    # ------------------------------------------------------------ processes
    def _start_next(self) -> None:
        if self.running is not None or not self.queue:
            return
        key, (graph, plan, options) = self.queue.popitem(last=False)
        folder = Path(tempfile.mkdtemp(prefix="slackswap-refine-"))
        (folder / "graph.json").write_text(graph.to_json())
        (folder / "request.json").write_text(
            json.dumps(
                {
                    "budget_bytes": plan.budget_bytes,
                    "hardware": plan.hardware.to_dict() if plan.hardware else None,
                    "solver": self.solver,
                    "time_limit_s": self.time_limit_s,
                    "options": options,
                }
            )
        )
        alive_r, alive_w = os.pipe()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHONSTARTUP")}
        try:
            with open(folder / "stderr.txt", "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "slackswap.refine", str(folder)],
                    stdin=alive_r,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    start_new_session=True,
                    env=env,
                )
        finally:
            os.close(alive_r)
        self.running = _Running(key, folder, proc, alive_w)

    def _poll(self) -> None:
        run = self.running
        if run is None or run.proc.poll() is None:
            return
        self.running = None
        try:
            self.done.append((run.key, self._answer(run)))
        finally:
            os.close(run.alive_w)
            shutil.rmtree(run.folder, ignore_errors=True)
        self._start_next()

    @staticmethod
    def _answer(run: _Running) -> Plan | Exception:
        from .core.complete import load_plan

        plan_file, error_file = run.folder / "plan.json", run.folder / "error.json"
        if plan_file.exists():
            return load_plan(plan_file)
        if error_file.exists():
            return RuntimeError(json.loads(error_file.read_text())["error"])
        err = (run.folder / "stderr.txt").read_text(errors="replace").strip()[-500:]
        return RuntimeError(
            f"the refining process exited with status {run.proc.returncode}"
            + (f": {err}" if err else "")
        )

    def _stop_running(self) -> None:
        run, self.running = self.running, None
        if run is None:
            return
        # killed, then what is under it woken (a stopped worker cannot notice its parent died)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(run.proc.pid, signal.SIGKILL)
        for pid in self._paused:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGCONT)
        run.proc.wait()
        os.close(run.alive_w)
        shutil.rmtree(run.folder, ignore_errors=True)
