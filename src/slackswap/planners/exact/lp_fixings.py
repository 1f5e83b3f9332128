"""Where the LP relaxation guides the MILP (formulations/milp.md, "Solving"): the tensors it
decides integrally, fixed in an LP-guided round, and how many such a round leaves free."""

from __future__ import annotations

import numpy as np

from ...core.plan import KEEP, RECOMPUTE, SWAP
from .formulation import Formulation


def lp_fixings(f: Formulation, lp, threshold: float = 0.999, agree_with=None) -> dict[int, int]:
    """Decision variables fixed where the LP relaxation decides a tensor integrally (and, with
    ``agree_with``, where that decision is also the warm start's)."""
    g = f.graph
    fixed: dict[int, int] = {}
    for t in f.keep:
        name = g.tensors[t].name
        values = {
            KEEP: lp.keep.get(name, 0.0),
            SWAP: lp.swap.get(name, 0.0),
            RECOMPUTE: lp.recompute.get(name, 0.0),
        }
        best = max(values, key=values.__getitem__)
        if values[best] < threshold:
            continue
        if best == RECOMPUTE and not f.rebuild_at[t]:
            continue
        if agree_with is not None and agree_with[t] != best:
            continue
        for code, var in ((KEEP, f.keep[t]), (SWAP, f.swap[t]), (RECOMPUTE, f.recompute[t])):
            fixed[var] = int(code == best)
    return fixed


def free_tensors(f: Formulation, lp, codes: np.ndarray) -> int:
    """How many tensors the first LP-guided round leaves to the MILP: those the LP does not
    decide integrally, or decides otherwise than the warm start (``codes``)."""
    return len(f.keep) - len(lp_fixings(f, lp, 0.999, codes)) // 3
