"""A plan refined in a child process: ``python -m slackswap.refine FOLDER``.

The training loop (loop.py) writes the bucket's graph (``graph.json``) and what to solve
(``request.json``: budget, hardware, solver, time limit, options) into FOLDER; this process
solves and writes ``plan.json`` (or ``error.json``). A process of its own, not a thread, so that
the loop can pause it while it profiles (its timings would otherwise include the solver's load),
cancel it at once, and so that it dies with the loop: its standard input is a pipe the loop holds
open, and a parent-death signal (Linux) kills it if the loop's process goes first.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path


def _die_with_parent() -> None:
    """Exit when the parent is gone: its end of standard input closes (a thread waits for it),
    or, on Linux, the parent-death signal arrives."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        try:
            while os.read(0, 64):
                pass
        except OSError:
            pass
        os._exit(3)

    threading.Thread(target=watch, name="slackswap-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    folder = Path((argv if argv is not None else sys.argv[1:])[0])
    _die_with_parent()
    from .core.errors import InfeasibleBudget
    from .core.graph import load_graph
    from .core.hardware import Hardware
    from .solve import solve

    request = json.loads((folder / "request.json").read_text())
    graph = load_graph(folder / "graph.json")
    try:
        plan = solve(
            graph,
            int(request["budget_bytes"]),
            Hardware.from_dict(request["hardware"]),
            solver=request["solver"],
            time_limit_s=request["time_limit_s"],
            **request.get("options", {}),
        )
    except (InfeasibleBudget, ValueError) as exc:
        (folder / "error.json").write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 0
    part = folder / "plan.json.part"
    plan.save(part)
    part.replace(folder / "plan.json")  # whole or absent, whenever the loop looks
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
