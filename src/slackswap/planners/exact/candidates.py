"""The MILP's candidate positions per saved tensor (formulations/milp.md, "Candidates"): F(x)
where an offloaded x may leave, G(x) where its prefetch may be issued, Rc(x) where it may be
rebuilt; every position over the whole schedule (``full``), else windows around the heuristic's
choices."""

from __future__ import annotations

import numpy as np

from ...core.graph import ActivationGraph
from ...core.hardware import Hardware
from ...core.schedule_rules import HookPositions
from ...core.stepmodel import nominal_position_times


def candidates(
    graph: ActivationGraph,
    hw: Hardware,
    full: bool,
    extra=None,
    window: int = 6,
    every_rebuild: bool | None = None,
):
    """F(x), G(x), Rc(x) for every saved tensor (Section "Candidates"). ``every_rebuild``
    (default: ``full``): every backward position up to the latest in Rc(x), as a model over
    every schedule needs for its bound to be a proof; without it Rc(x) holds the positions where
    a rebuild is due (a restriction: fewer variables for the same search)."""
    n = graph.n_ops
    saved = [int(t) for t in graph.saved]
    last_fwd = graph.last_forward_use
    u = {t: graph.bwd_position(int(graph.first_backward_use[t])) for t in saved}
    lb = {t: graph.bwd_position(int(graph.last_backward_use[t])) for t in saved}
    frontier = {t: [int(f) for f in graph.rerun_frontier[t]] for t in saved}
    coproduced = {}
    for t in saved:
        outs = {int(o) for q in graph.rerun_ops[t] for o in graph.op_outputs[q]}
        coproduced[t] = [o for o in sorted(outs) if o != t and graph.is_saved[o]]
    can_r = {t: bool(graph.can_recompute[t]) for t in saved}
    # Rc: the first use (or the latest rebuild position a graph gives, rebuilt_before), plus
    # earlier positions where a dependent's rebuild may need x
    latest = {
        t: int(graph.rebuild_position[t]) if graph.rebuild_position[t] >= 0 else u[t] for t in saved
    }
    rc = {t: {latest[t]} if can_r[t] else set() for t in saved}
    if full if every_rebuild is None else every_rebuild:
        # over every schedule, every backward position up to the latest: a rebuild moved earlier
        # can share its reruns with another's there, or run before memory peaks (a model without
        # them is a restriction, whose bound proves nothing)
        for t in saved:
            if can_r[t]:
                rc[t] |= set(range(n, latest[t] + 1))
    else:
        # where a rebuild that reruns the same op is due, however far: there one rerun can serve
        # both (formulations/milp.md, "Candidates"; few pairs share an op)
        users: dict[int, list[int]] = {}
        for t in saved:
            if can_r[t]:
                for q in graph.rerun_ops[t]:
                    users.setdefault(int(q), []).append(t)
        for sharing in users.values():
            for x in sharing:
                for y in sharing:
                    if latest[x] < latest[y]:
                        rc[y].add(latest[x])
    changed = True
    while changed:
        changed = False
        for y in saved:
            for r in list(rc[y]):
                for x in frontier[y] + coproduced[y]:
                    if (
                        can_r[x]
                        and r < latest[x]
                        and (full or latest[x] - r <= window)
                        and r not in rc[x]
                    ):
                        rc[x].add(r)
                        changed = True
    if extra is not None:
        for t, r in extra.get("rebuild", {}).items():
            if can_r[t] and r <= latest[t]:
                rc[t].add(int(r))
    earliest_need = {t: u[t] for t in saved}
    for y in saved:
        for r in rc[y]:
            for x in frontier[y]:
                earliest_need[x] = min(earliest_need[x], r)
    F, G = {}, {}
    start, end = nominal_position_times(graph, [()] * graph.n_positions)
    # only where the executor can act (step-model.md, "Hook positions"): a tensor leaves after a
    # position a hook runs after, a prefetch and a rebuild start where a hook runs
    at = graph.hook_positions
    hooks = HookPositions(graph)
    can_free = np.append(at[1:], True)
    for t in saved:
        rc[t] = {r for r in rc[t] if at[r]}
    for t in saved:
        lo, hi = int(last_fwd[t]), u[t] - 1
        if full:
            F[t] = list(range(lo, hi + 1))
            G[t] = list(range(lo + 1, u[t] + 1))
        else:
            # leave at the last forward reader (waiting for the copy if needed), or when a copy
            # started at production on an idle lane would be done
            done = end[graph.producer[t]] + hw.d2h_time(graph.tensor_bytes[t])
            k_done = int(np.searchsorted(end, done - 1e-15))
            first = hooks.free_later(np.array([lo, min(max(k_done, lo), hi)]))
            F[t] = sorted({int(x) for x in first if x <= hi} or {hi})
            # issue just in time for each possible first use, or early enough to arrive in time
            g = set()
            for need in {earliest_need[t], u[t]}:
                g.add(need)
                begin = start[need] - hw.h2d_time(graph.tensor_bytes[t])
                k_begin = int(np.searchsorted(start, begin + 1e-15, side="right")) - 1
                g.add(max(k_begin, lo + 1))
            g = {int(x) for x in hooks.start_earlier(np.array(sorted(g)))} | {u[t]}
            G[t] = sorted(x for x in g if lo < x <= u[t])
        if extra is not None:
            if t in extra.get("free", {}) and lo <= extra["free"][t] <= hi:
                F[t] = sorted(set(F[t]) | {int(extra["free"][t])})
            if t in extra.get("issue", {}) and lo < extra["issue"][t] <= u[t]:
                G[t] = sorted(set(G[t]) | {int(extra["issue"][t])})
        if not hw.duplex:
            G[t] = [g for g in G[t] if g >= n] or [u[t]]
        F[t] = [k for k in F[t] if can_free[k]]
        G[t] = [k for k in G[t] if at[k]]
    return F, G, {t: sorted(v) for t, v in rc.items()}, frontier, coproduced, u, lb
