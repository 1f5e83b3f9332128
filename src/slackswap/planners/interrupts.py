"""Ctrl-C during a solve ends it at once and reaches the caller as ``KeyboardInterrupt``.

Python runs its SIGINT handler in the main thread between bytecodes, never while that thread sits
in a native call: a CP-SAT search (which would otherwise catch SIGINT itself and return as if
its limit had come) or a wait on a native solver's child. While ``interruptible()`` is active,
the signal also wakes a watcher thread (Python's wakeup file descriptor), which stops every
running CP-SAT search and kills every native child's process group; the native call returns, and
Python's own handler raises ``KeyboardInterrupt`` in the main thread, through every ``finally``
(temporary folders, the children's reaping). Only the main thread can install this; elsewhere it
does nothing (the main thread gets the signal anyway).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any

_lock = threading.Lock()
_solvers: set[Any] = set()  # CP-SAT solvers searching now
_groups: set[int] = set()  # process groups of native children running now
_active = False


@contextlib.contextmanager
def running_solver(solver):
    """Register a CP-SAT solver for the duration of its search."""
    with _lock:
        _solvers.add(solver)
    try:
        yield solver
    finally:
        with _lock:
            _solvers.discard(solver)


@contextlib.contextmanager
def running_child(pid: int):
    """Register a native child (leader of its own process group) while it runs."""
    with _lock:
        _groups.add(pid)
    try:
        yield
    finally:
        with _lock:
            _groups.discard(pid)


def stop_everything() -> None:
    """Stop every registered search and kill every registered child's group."""
    with _lock:
        solvers, groups = list(_solvers), list(_groups)
    for solver in solvers:
        with contextlib.suppress(Exception):
            solver.stop_search()
    for pid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def interruptible():
    """Make SIGINT stop the native work in flight (module docstring). Nested uses are one. A
    Ctrl-C inside an import of a pybind11 module (OR-Tools, highspy, one a library imports
    lazily) comes out of it as ImportError("initialization failed"): it leaves as the
    KeyboardInterrupt it is, whether or not this thread may watch SIGINT."""
    try:
        with _watching_sigint():
            yield
    except ImportError as exc:
        reraise_interrupt(exc)
        raise


@contextlib.contextmanager
def _watching_sigint():
    global _active
    if (
        _active
        or threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None)
    ):
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main interpreter's main thread after all
        os.close(read_fd)
        os.close(write_fd)
        yield
        return
    _active = True

    def watch() -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGINT in data:
                stop_everything()
            if previous >= 0:  # whoever listened before (an event loop) still hears it
                with contextlib.suppress(OSError):
                    os.write(previous, data)

    watcher = threading.Thread(target=watch, name="slackswap-interrupts", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        _active = False
        os.close(write_fd)  # the watcher reads the end of the pipe and returns
        watcher.join(timeout=5)
        os.close(read_fd)


def reraise_interrupt(exc: BaseException) -> None:
    """Raise KeyboardInterrupt if one caused ``exc`` (its cause or context, at any depth)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            raise KeyboardInterrupt from exc
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__


def solve_cpsat(solver, model):
    """``solver.solve(model)``, stopped by Ctrl-C like the rest (CP-SAT would otherwise catch
    SIGINT itself and return as if its limit had come: the interrupt lost)."""
    solver.parameters.catch_sigint_signal = False
    with running_solver(solver):
        return solver.solve(model)
