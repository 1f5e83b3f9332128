"""The lane-capacity cuts (formulations/milp.md, "lane_capacity_cuts"): the LP bound's valid
inequalities in the MILP's variables. Every plan satisfies them; they tighten the relaxation."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...core.plan import SWAP
from .formulation import Formulation
from .running_sum import running_sum


def lane_capacity_cuts(f: Formulation, build: Any) -> None:
    """Valid inequalities of the LP bound (formulations/lp-bound.md) in the MILP's variables:
    a lane moves at most bandwidth x elapsed time, offloads not yet moved are still resident,
    prefetches needed by now have landed and stay until their last use. Every plan satisfies
    them, so they cut no plan off; they only tighten the relaxation (lane_capacity_cuts).
    ``build``: the formulation's builder (formulate.py), whose memory rows they share.

    Where no tensor may swap nothing travels on the lanes: only the kept and rebuilt bytes' cut
    is stated. The lanes' running sums would all be zero, which CP-SAT's presolve finds one
    position per loop (seconds on a thousand positions)."""
    g, m, sc, hw = f.graph, f.model, f.scaling, f.hw
    n, S = g.n_ops, g.n_positions
    nbytes, budget_u, constant, u, lb = (
        build.nbytes,
        build.budget_u,
        build.constant,
        build.u,
        build.lb,
    )
    fwd_ws, bwd_ws, mask = build.fwd_ws, build.bwd_ws, build.mask
    if mask is not None and not mask[g.saved, SWAP].any():
        _kept_or_rebuilt_cut(f, nbytes, budget_u, constant, fwd_ws, bwd_ws, u, lb)
        return
    kappa = 1000
    bw_d = int(np.ceil(hw.d2h_bytes_per_s * sc.time_unit / sc.byte_unit * kappa))
    bw_h = int(np.ceil(hw.h2d_bytes_per_s * sc.time_unit / sc.byte_unit * kappa))
    saved = list(f.keep)
    prod, last_fwd = g.producer, g.last_forward_use
    total = int(nbytes[g.saved].sum()) + 1
    # (variable, bytes) starting or ending at each position, per running sum
    Rows = dict[int, list[tuple[int, int]]]
    q_st: Rows = {}
    f_st: Rows = {}
    f_en: Rows = {}
    need_st: Rows = {}
    free_st: Rows = {}
    g_st: Rows = {}
    g_en: Rows = {}

    def put(d: Rows, k, item: tuple[int, int]) -> None:
        d.setdefault(int(k), []).append(item)

    for t in saved:
        b = int(nbytes[t])
        put(q_st, prod[t], (f.swap[t], b))
        put(f_st, prod[t], (f.swap[t], b))
        put(f_en, last_fwd[t], (f.swap[t], b))
        put(need_st, u[t], (f.swap[t], b))
        if lb[t] + 1 < S:
            put(free_st, lb[t] + 1, (f.swap[t], b))
        put(g_st, prod[t], (f.keep[t], b))
        put(g_en, lb[t], (f.keep[t], b))
        put(g_st, prod[t], (f.recompute[t], b))
        put(g_en, last_fwd[t], (f.recompute[t], b))
        put(g_st, u[t], (f.recompute[t], b))
        put(g_en, lb[t], (f.recompute[t], b))
    produced = running_sum(m, "cut_offloaded_produced", S, q_st, {}, total)
    in_fwd_life = running_sum(m, "cut_offloaded_in_forward_life", S, f_st, f_en, total)
    needed = running_sum(m, "cut_offloaded_needed", S, need_st, {}, total)
    freed = running_sum(m, "cut_offloaded_freed", S, free_st, {}, total)
    least = running_sum(m, "cut_kept_or_rebuilt", S, g_st, g_en, total)
    big = total * kappa
    dep = [m.var(f"cut_departed[{k}]", 0, big) for k in range(S)]
    arr = [m.var(f"cut_arrived[{k}]", 0, big) for k in range(S)]
    f.units["cut"] = {
        "dep": dep,
        "arr": arr,
        "produced": produced,
        "needed": needed,
        "bw_d": bw_d,
        "bw_h": bw_h,
        "kappa": kappa,
    }
    for k in range(S):
        if k == 0:
            m.le("cut_departed_start", [(dep[0], 1)], 0)
            m.le("cut_arrived_start", [(arr[0], 1)], 0)
        else:
            step = [(f.start[k], 1), (f.start[k - 1], -1)]
            m.le(
                f"cut_d2h_rate[{k}]",
                [(dep[k], 1), (dep[k - 1], -1)] + [(v, -bw_d * c) for v, c in step],
                0,
            )
            m.le(
                f"cut_h2d_rate[{k}]",
                [(arr[k], 1), (arr[k - 1], -1)] + [(v, -bw_h * c) for v, c in step],
                0,
            )
            if not hw.duplex:
                m.le(
                    f"cut_link_rate[{k}]",
                    [(dep[k], 1), (arr[k], 1), (dep[k - 1], -1), (arr[k - 1], -1)]
                    + [(v, -bw_d * c) for v, c in step],
                    0,
                )
            m.le(f"cut_departed_produced[{k}]", [(dep[k], 1), (produced[k - 1], -kappa)], 0)
        m.le(f"cut_arrived_departed[{k}]", [(arr[k], 1), (dep[k], -1)], 0)
        m.ge(f"cut_arrived_needed[{k}]", [(arr[k], 1), (needed[k], -kappa)], 0)
        # M >= produced - departed, M >= forward life; A >= arrived - freed
        M = m.var(f"cut_not_departed[{k}]", 0, total)
        A = m.var(f"cut_landed[{k}]", 0, total)
        m.ge(f"cut_not_departed_def[{k}]", [(M, kappa), (produced[k], -kappa), (dep[k], 1)], 0)
        m.ge(f"cut_not_departed_life[{k}]", [(M, 1), (in_fwd_life[k], -1)], 0)
        m.ge(f"cut_landed_def[{k}]", [(A, kappa), (arr[k], -1), (freed[k], kappa)], 0)
        ws = int(fwd_ws[k]) if k < n else int(bwd_ws[S - 1 - k])
        m.le(f"cut_memory[{k}]", [(least[k], 1), (M, 1), (A, 1)], budget_u - int(constant[k]) - ws)


def _kept_or_rebuilt_cut(f: Formulation, nbytes, budget_u, constant, fwd_ws, bwd_ws, u, lb) -> None:
    """lane_capacity_cuts' memory row with no offloads (cut_memory): the bytes kept, or
    recomputed and not yet dropped or rebuilt, fit the budget at every position."""
    g, m = f.graph, f.model
    n, S = g.n_ops, g.n_positions
    prod, last_fwd = g.producer, g.last_forward_use
    total = int(nbytes[g.saved].sum()) + 1
    starts: dict[int, list[tuple[int, int]]] = {}
    ends: dict[int, list[tuple[int, int]]] = {}
    for t in f.keep:
        b = int(nbytes[t])
        for d, k, v in (
            (starts, prod[t], f.keep[t]),
            (ends, lb[t], f.keep[t]),
            (starts, prod[t], f.recompute[t]),
            (ends, last_fwd[t], f.recompute[t]),
            (starts, u[t], f.recompute[t]),
            (ends, lb[t], f.recompute[t]),
        ):
            d.setdefault(int(k), []).append((v, b))
    least = running_sum(m, "cut_kept_or_rebuilt", S, starts, ends, total)
    for k in range(S):
        ws = int(fwd_ws[k]) if k < n else int(bwd_ws[S - 1 - k])
        m.le(f"cut_memory[{k}]", [(least[k], 1)], budget_u - int(constant[k]) - ws)
