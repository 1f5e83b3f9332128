"""A complete, consistent value for every model variable, from a known plan.

CP-SAT starts best from a complete feasible solution. Given a plan's decisions and schedule, the
times, lanes and memory sums of the model follow by the same recurrences the simulator runs (in
the model's integer units), so no solver time is spent completing the hint.
"""

from __future__ import annotations

import numpy as np

from ...core.plan import RECOMPUTE, SWAP
from ...core.stepmodel import trace_reruns
from .formulation import Formulation


def complete_hint(
    f: Formulation, codes: np.ndarray, free: dict, issue: dict, rebuild: dict
) -> dict[int, int]:
    g, m = f.graph, f.model
    n, S = g.n_ops, g.n_positions
    val: dict[int, int] = {}
    for t in f.keep:
        c = int(codes[t])
        val[f.keep[t]] = int(c == 0)
        val[f.swap[t]] = int(c == SWAP)
        val[f.recompute[t]] = int(c == RECOMPUTE)
        for k, v in f.free_after[t].items():
            val[v] = int(c == SWAP and free.get(t) == k)
        for k, v in f.issue_at[t].items():
            val[v] = int(c == SWAP and issue.get(t) == k)
        for k, v in f.rebuild_at[t].items():
            val[v] = int(c == RECOMPUTE and rebuild.get(t) == k)
        if c == SWAP and (free.get(t) not in f.free_after[t] or issue.get(t) not in f.issue_at[t]):
            return {}
        if c == RECOMPUTE and rebuild.get(t) not in f.rebuild_at[t]:
            return {}
    rec = np.full(len(g.tensors), -1, dtype=np.int64)
    for t, r in rebuild.items():
        rec[t] = r
    reruns, needs_at, _, _ = trace_reruns(g, codes, rec)
    for (q, k), v in f.rerun.items():
        val[v] = int(q in reruns[k])
    for k in range(S):
        for q in reruns[k]:
            if (q, k) not in f.rerun:
                return {}
    # evaluate the remaining variables constraint by constraint: running sums and the other
    # defining equalities in order, then lower bounds propagated to a fixed point
    fwd, base = f.units["fwd"], f.units["base_dur"]
    start = [0] * S
    d2h = {t: 0 for t in f.keep}
    h2d = {t: 0 for t in f.keep}
    swapped = [t for t in f.keep if codes[t] == SWAP]
    free_after: dict[int, list[int]] = {}
    issued: dict[int, list[int]] = {}
    for t in swapped:
        free_after.setdefault(free[t], []).append(t)
        issued.setdefault(issue[t], []).append(t)
    d2h_pos = {t: i for i, t in enumerate(f.d2h_order)}
    lane_d = 0
    lane_h = 0
    dur = [int(base[k]) + sum(int(fwd[q]) for q in reruns[k]) for k in range(S)]
    arrive = 0
    for k in range(S):
        if k:
            arrive = start[k - 1] + dur[k - 1]
        ready = arrive
        for t in free_after.get(k - 1, ()):
            ready = max(ready, d2h[t])
        for t in sorted(issued.get(k, ()), key=lambda t: (f.units["u"][t], t)):
            lane = lane_h if f.hw.duplex else max(lane_h, lane_d)
            begin = max(lane, arrive, d2h[t])
            h2d[t] = begin + int(f.units["h2d"][t])
            lane_h = h2d[t]
            if not f.hw.duplex:
                lane_d = lane_h
        for t in needs_at[k]:
            ready = max(ready, h2d[t])
        start[k] = ready
        if k < n:
            for t in sorted((t for t in swapped if g.producer[t] == k), key=lambda t: d2h_pos[t]):
                lane = lane_d if f.hw.duplex else max(lane_h, lane_d)
                d2h[t] = max(lane, start[k] + int(fwd[k])) + int(f.units["d2h"][t])
                lane_d = d2h[t]
                if not f.hw.duplex:
                    lane_h = lane_d
    for k in range(S):
        val[f.start[k]] = start[k]
    carry = 0
    for t in f.d2h_order:
        carry = (
            d2h[t]
            if codes[t] == SWAP
            else max(carry, int(start[g.producer[t]] + fwd[g.producer[t]]))
        )
        val[f.d2h_done[t]] = carry
    carry = 0
    order = 0
    for t in f.h2d_order:
        carry = h2d[t] if codes[t] == SWAP else carry
        order = issue[t] if codes[t] == SWAP else order
        val[f.h2d_done[t]] = carry
        val[f.issue_order[t]] = order
    _propagate(m, val, f.units.get("cut"))
    return val


def _one_unknown(c, pending: set[int], val: dict[int, int]):
    """(variable, coefficient, value of the rest) when exactly one variable of ``c`` is pending."""
    free = [(v, a) for v, a in c.terms if v in pending]
    if len(free) != 1:
        return None
    v, a = free[0]
    return v, a, sum(coef * val[w] for w, coef in c.terms if w != v)


def _propagate(m, val: dict[int, int], cut=None) -> None:
    """Give every other variable the value its defining constraints force: equalities with one
    unknown in order, then lower bounds raised to a fixed point; the lane-capacity cut's fluid
    amounts are set explicitly (as much departed as the lane allows, as little arrived as the
    uses need)."""
    unknown = [v.index for v in m.vars if v.index not in val]
    for v in unknown:
        val[v] = m.vars[v].lb
    pending = set(unknown)
    for c in m.constraints:
        if c.enforce or c.lo is None or c.lo != c.hi:
            continue
        found = _one_unknown(c, pending, val)
        if found is None:
            continue
        v, a, rest = found
        if (c.lo - rest) % a == 0:
            val[v] = (c.lo - rest) // a
            pending.discard(v)
    if cut is not None:
        dep, arr, produced, needed = cut["dep"], cut["arr"], cut["produced"], cut["needed"]
        kappa, bw_d, bw_h = cut["kappa"], cut["bw_d"], cut["bw_h"]
        start = [v for v in range(len(m.vars)) if m.vars[v].name.startswith("start[")]
        S = len(dep)
        val[dep[0]] = 0
        for k in range(1, S):
            step = val[start[k]] - val[start[k - 1]]
            val[dep[k]] = min(val[dep[k - 1]] + bw_d * step, kappa * val[produced[k - 1]])
        val[arr[S - 1]] = kappa * val[needed[S - 1]]
        for k in range(S - 2, -1, -1):
            step = val[start[k + 1]] - val[start[k]]
            val[arr[k]] = max(kappa * val[needed[k]], val[arr[k + 1]] - bw_h * step, 0)
        for v in dep + arr:
            pending.discard(v)
    for _ in range(50):
        changed = False
        for c in m.constraints:
            if c.enforce and not all(val[v] == 1 for v in c.enforce):
                continue
            found = _one_unknown(c, pending, val)
            if found is None:
                continue
            v, a, rest = found
            if c.lo is not None and c.hi is not None and c.lo == c.hi:
                new = (c.lo - rest) // a if (c.lo - rest) % a == 0 else val[v]
            elif c.lo is not None and a > 0:
                need = -(-(c.lo - rest) // a)
                new = max(val[v], need)
            elif c.hi is not None and a < 0:
                need = -(-(rest - c.hi) // (-a))
                new = max(val[v], need)
            else:
                continue
            new = max(m.vars[v].lb, min(m.vars[v].ub, new))
            if new != val[v]:
                val[v] = new
                changed = True
        if not changed:
            break


def apply_hint(f: Formulation, hint) -> None:
    """The values of a known plan (codes, free, issue, rebuild) as the model's hint."""
    codes, free, issue, rebuild = hint
    m = f.model
    for t, v in f.keep.items():
        m.hint[v] = int(codes[t] == 0)
        m.hint[f.swap[t]] = int(codes[t] == 1)
        m.hint[f.recompute[t]] = int(codes[t] == 2)
        for k, w in f.free_after[t].items():
            m.hint[w] = int(codes[t] == 1 and free.get(t) == k)
        for k, w in f.issue_at[t].items():
            m.hint[w] = int(codes[t] == 1 and issue.get(t) == k)
        for k, w in f.rebuild_at[t].items():
            m.hint[w] = int(codes[t] == 2 and rebuild.get(t) == k)
