"""From a solver's variable values back to decisions and the schedule the model assumed."""

from __future__ import annotations

import numpy as np

from ..plan import KEEP, RECOMPUTE, SWAP, Schedule
from .formulate import Formulation


def decode(f: Formulation, value) -> tuple[np.ndarray, Schedule]:
    """``value(var_index) -> number``. Returns decision codes and the schedule."""
    g = f.graph
    codes = np.where(g.is_saved, KEEP, -1).astype(np.int8)
    free, issue, rebuild = {}, {}, {}
    for t in f.keep:
        name = g.tensors[t].name
        if value(f.swap[t]) > 0.5:
            codes[t] = SWAP
            free[name] = next(k for k, v in f.free_after[t].items() if value(v) > 0.5)
            issue[name] = next(k for k, v in f.issue_at[t].items() if value(v) > 0.5)
        elif value(f.recompute[t]) > 0.5:
            codes[t] = RECOMPUTE
            rebuild[name] = next(k for k, v in f.rebuild_at[t].items() if value(v) > 0.5)
    return codes, Schedule(d2h_free=free, h2d_issue=issue, recompute_at=rebuild)
