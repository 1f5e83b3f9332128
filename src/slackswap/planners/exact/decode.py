"""From a solver's variable values back to decisions and the schedule the model assumed."""

from __future__ import annotations

import numpy as np

from ...core.codes import keep_all_codes
from ...core.plan import RECOMPUTE, SWAP, Schedule
from .formulation import Formulation


def _chosen(options: dict[int, int], value) -> int:
    """The position whose indicator is set (the largest, against solver tolerances)."""
    if not options:
        raise ValueError("decode: a decision has no position to take")
    return max(options, key=lambda k: value(options[k]))


def decode(f: Formulation, value) -> tuple[np.ndarray, Schedule]:
    """``value(var_index) -> number``. Returns decision codes and the schedule."""
    g = f.graph
    codes = keep_all_codes(g)
    free, issue, rebuild = {}, {}, {}
    for t in f.keep:
        name = g.tensors[t].name
        if value(f.swap[t]) > 0.5:
            codes[t] = SWAP
            free[name] = _chosen(f.free_after[t], value)
            issue[name] = _chosen(f.issue_at[t], value)
        elif value(f.recompute[t]) > 0.5:
            codes[t] = RECOMPUTE
            rebuild[name] = _chosen(f.rebuild_at[t], value)
    return codes, Schedule(d2h_free=free, h2d_issue=issue, recompute_at=rebuild)
