"""Each position's start, bounded before the solve (formulations/milp.md, start_bounds and
start_earliest): CP-SAT's presolve would derive these bounds one position per loop, seconds
on a thousand positions, none of it counted as deterministic time."""

from __future__ import annotations

import numpy as np


def start_domains(
    base_dur: np.ndarray, rerun_cost: np.ndarray | None, horizon: int
) -> tuple[np.ndarray, np.ndarray]:
    """(earliest, latest) start of each position in the model's time units. start_bounds: the
    base durations before it, and ``horizon`` less those from it to the last position.
    start_earliest (``rerun_cost``: per position, the forward time of every rerun candidate
    there; where nothing waits for a lane): an optimum's earliest schedule starts a position
    after the base durations and at most every rerun candidate before it."""
    before = np.concatenate([[0], np.cumsum(base_dur[:-1], dtype=np.int64)])
    latest = horizon - (before[-1] - before)
    if rerun_cost is not None:
        reruns_before = np.concatenate([[0], np.cumsum(rerun_cost[:-1], dtype=np.int64)])
        latest = np.minimum(latest, before + reruns_before)
    return before, latest
