"""Build the MILP of formulations/milp.md. Names in comments and constraint names cite it.

Sets: saved tensors x; positions k = 0..2n-1. Candidates per tensor (Section "Candidates"):
F(x) positions after which an offloaded x may leave, G(x) positions at which its prefetch may be
issued, Rc(x) positions at which it may be rebuilt. Bytes and seconds are scaled to integers,
rounded so the model never claims a plan fits that does not (Section "Scaling").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...core.graph import ActivationGraph
from ...core.hardware import Hardware
from ...core.stepmodel import nominal_slot_times
from .model import Model

BYTE_RANGE = 10**6  # model units for the largest of the budget and the sizes, at most
TIME_RANGE = 10**7  # model time units in the step plus every copy (Section "Scaling")
# graphs of at most this many positions x saved tensors get every position by default (a
# 2-layer GPT-style step: 46 x 23)
FULL_CELLS = 1500
# finer where the bound is a proof (the rounding is taken off it), for CP-SAT alone: its
# arithmetic is exact, where HiGHS's big-M rows at this range returned a plan 1.2% off its
# optimum as "optimal"
TIME_RANGE_FULL = 10**8


@dataclass
class Scaling:
    """byte_unit bytes and time_unit seconds per model unit (Section "Scaling")."""

    byte_unit: int
    time_unit: float
    exact_bytes: bool = True  # the byte unit divides every size: memory sums are exact
    # sizes rounded down and the budget up (a relaxation, whose bound is a bound) rather than
    # sizes up and the budget down (a restriction, whose plans fit)
    relaxed_bytes: bool = False

    def bytes_of(self, value) -> np.ndarray:
        """Sizes in model units, rounded the way the scaling says (exact when they divide)."""
        value = np.asarray(value, dtype=np.int64)
        if self.relaxed_bytes:
            return value // self.byte_unit
        return -(-value // self.byte_unit)

    def budget_of(self, budget_bytes: int) -> int:
        if self.relaxed_bytes:
            return -(-int(budget_bytes) // self.byte_unit)
        return int(budget_bytes) // self.byte_unit

    def time_up(self, seconds) -> np.ndarray:
        return np.ceil(np.asarray(seconds, dtype=float) / self.time_unit - 1e-9).astype(np.int64)


@dataclass
class Formulation:
    model: Model
    graph: ActivationGraph
    hw: Hardware
    budget_bytes: int
    scaling: Scaling
    keep: dict[int, int] = field(default_factory=dict)
    swap: dict[int, int] = field(default_factory=dict)
    recompute: dict[int, int] = field(default_factory=dict)
    free_after: dict[int, dict[int, int]] = field(default_factory=dict)
    issue_at: dict[int, dict[int, int]] = field(default_factory=dict)
    rebuild_at: dict[int, dict[int, int]] = field(default_factory=dict)
    rerun: dict[tuple[int, int], int] = field(default_factory=dict)
    start: list[int] = field(default_factory=list)
    resident: list[int] = field(default_factory=list)
    d2h_done: dict[int, int] = field(default_factory=dict)
    h2d_done: dict[int, int] = field(default_factory=dict)
    issue_order: dict[int, int] = field(default_factory=dict)
    d2h_order: list[int] = field(default_factory=list)
    h2d_order: list[int] = field(default_factory=list)
    units: dict = field(default_factory=dict)
    objective_offset_s: float = 0.0
    full: bool = False  # every schedule position a candidate (Section "Candidates")
    collectives_charged: bool = False  # collectives share the copy lanes

    def seconds(self, objective_units: float) -> float:
        return objective_units * self.scaling.time_unit + self.objective_offset_s

    def proven_bound_s(
        self, bound_units: float, incumbent_s: float | None = None, exact_arithmetic: bool = True
    ) -> float | None:
        """A lower bound on the simulated step time of every plan, from the solver's bound, or
        None. Only a model with every candidate position bounds every schedule. Each op, copy
        and rerun on the critical path is rounded up by under one time unit (Section
        "Scaling"); what the rounding can add to a plan's model step time is taken off: the
        exact round-up of every position and copy, and of the reruns a plan at most as slow as
        ``incumbent_s`` (a simulated plan) can hold. A floating-point backend's bound (HiGHS,
        CBC: big-M rows within their tolerances) keeps the looser count of one whole unit per op,
        copy and rerun variable."""
        sc = self.scaling
        if not self.full or not (sc.exact_bytes or sc.relaxed_bytes) or self.collectives_charged:
            # windows bound only their schedules; rounded-up sizes, only their model; the H2D
            # lane's collectives sit in first-use order, not issue order (Section "Collectives")
            return None
        if not exact_arithmetic:
            loose = 2 * self.graph.n_ops + len(self.rerun) + 2 * len(self.keep)
            return self.seconds(bound_units) - loose * sc.time_unit
        return self.seconds(bound_units) - self.rounding_units(incumbent_s) * sc.time_unit

    def rounding_units(self, incumbent_s: float | None = None) -> float:
        """The most the rounding adds to a plan's model step time, in units: the longest path
        holds each position and copy at most once (their exact round-ups summed) and the
        plan's reruns. A plan no slower than ``incumbent_s`` reruns ops of at most
        ``incumbent_s - ideal`` seconds in all (compute is serial), so its reruns' round-up is
        at most the fractional knapsack of round-up per second over the rerun variables."""
        g, sc = self.graph, self.scaling

        def up(seconds) -> np.ndarray:
            exact = np.asarray(seconds, dtype=float) / sc.time_unit
            return np.maximum(0.0, np.ceil(exact - 1e-9) - exact)

        fixed = float(up(np.concatenate([g.forward_s, g.backward_s])).sum())
        sizes = g.tensor_bytes[g.saved]
        fixed += float(up([self.hw.d2h_time(b) for b in sizes]).sum())
        fixed += float(up([self.hw.h2d_time(b) for b in sizes]).sum())
        # the reruns: at most count[q] of op q; a plan no slower than the incumbent holds reruns
        # of at most ``slack`` seconds: the fractional knapsack of round-ups per second bounds
        # what they add
        count: dict[int, int] = {}
        for q, _ in self.rerun:
            count[q] = count.get(q, 0) + 1
        ops = sorted(count)
        seconds = np.asarray(g.forward_s[ops], dtype=float) if ops else np.zeros(0)
        per_rerun = up(seconds)
        every = float(sum(per_rerun[i] * count[q] for i, q in enumerate(ops)))
        if incumbent_s is not None and ops and np.isfinite(incumbent_s):
            slack = max(0.0, incumbent_s - g.ideal_step_time_s)
            rounded = [i for i in range(len(ops)) if per_rerun[i] > 0]  # so seconds > 0
            held = 0.0
            for i in sorted(rounded, key=lambda i: -per_rerun[i] / seconds[i]):
                runs = min(float(count[ops[i]]), slack / seconds[i])
                held += runs * per_rerun[i]
                slack -= runs * seconds[i]
                if slack <= 0:
                    break
            every = min(every, held)
        # one unit more: the 1e-9 of time_up and float sums
        return fixed + every + 1.0


def _candidates(graph: ActivationGraph, hw: Hardware, full: bool, extra=None, window: int = 6):
    """F(x), G(x), Rc(x) for every saved tensor (Section "Candidates")."""
    n = graph.n_ops
    saved = [int(t) for t in graph.saved]
    last_fwd = graph.last_forward_use
    u = {t: graph.bwd_slot(int(graph.first_backward_use[t])) for t in saved}
    lb = {t: graph.bwd_slot(int(graph.last_backward_use[t])) for t in saved}
    frontier = {t: [int(f) for f in graph.rerun_frontier[t]] for t in saved}
    coproduced = {}
    for t in saved:
        outs = {int(o) for q in graph.rerun_ops[t] for o in graph.op_outputs[q]}
        coproduced[t] = [o for o in sorted(outs) if o != t and graph.is_saved[o]]
    can_r = {t: bool(graph.can_recompute[t]) for t in saved}
    # Rc: the first use (or the latest rebuild position a graph gives, rebuilt_before), plus
    # earlier positions where a dependent's rebuild may need x
    latest = {t: int(graph.rebuild_slot[t]) if graph.rebuild_slot[t] >= 0 else u[t] for t in saved}
    rc = {t: {latest[t]} if can_r[t] else set() for t in saved}
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
    start, end = nominal_slot_times(graph, [()] * graph.n_slots)
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
            F[t] = sorted({lo, min(max(k_done, lo), hi)})
            # issue just in time for each possible first use, or early enough to arrive in time
            g = set()
            for need in {earliest_need[t], u[t]}:
                g.add(need)
                begin = start[need] - hw.h2d_time(graph.tensor_bytes[t])
                k_begin = int(np.searchsorted(start, begin + 1e-15, side="right")) - 1
                g.add(max(k_begin, lo + 1))
            G[t] = sorted(x for x in g if lo < x <= u[t])
        if extra is not None:
            if t in extra.get("free", {}) and lo <= extra["free"][t] <= hi:
                F[t] = sorted(set(F[t]) | {int(extra["free"][t])})
            if t in extra.get("issue", {}) and lo < extra["issue"][t] <= u[t]:
                G[t] = sorted(set(G[t]) | {int(extra["issue"][t])})
        if not hw.duplex:
            G[t] = [g for g in G[t] if g >= n] or [u[t]]
    return F, G, {t: sorted(v) for t, v in rc.items()}, frontier, coproduced, u, lb


def formulate(
    graph: ActivationGraph,
    hw: Hardware,
    budget_bytes: int,
    *,
    full: bool | None = None,
    hint=None,
    extra_candidates=None,
    cuts: bool = True,
    mask=None,
    fine_time: bool = False,
) -> Formulation:
    """The MILP for ``graph`` under ``budget_bytes``. ``full``: every candidate position (exact
    over all schedules; default for graphs of at most 16 ops), else windows (Section "Candidates").
    ``hint``: (codes, free, issue, rebuild) of a known plan, added to the candidates and hinted.
    ``fine_time``: over every position, time units of span / 1e8 rather than 1e7 (for a backend
    in exact integer arithmetic; Section "Scaling")."""
    n = graph.n_ops
    S = graph.n_slots
    if full is None:  # every position where the model stays small (Section "Candidates")
        full = n <= 16 or S * len(graph.saved) <= FULL_CELLS
    copies = sum(hw.d2h_time(b) + hw.h2d_time(b) for b in graph.tensor_bytes[graph.saved])
    if hw.collectives_on_link:
        copies += sum(
            hw.d2h_time(c.d2h_bytes) + hw.h2d_time(c.h2d_bytes) for c in graph.collectives
        )
    span = graph.ideal_step_time_s + copies
    # the largest unit that divides every size exactly: memory sums are then exact, and only the
    # budget is rounded (down)
    sizes = np.concatenate(
        [graph.tensor_bytes, graph.forward_ws, graph.backward_ws, graph.rerun_ws]
    )
    unit = max(1, int(np.gcd.reduce(sizes[sizes > 0])) if (sizes > 0).any() else 1)
    # at most BYTE_RANGE units for the largest of the budget and the sizes, so that every
    # backend sees coefficients of like magnitude. Sizes are then rounded: over windows up (the
    # model never under-counts memory, its plans fit, its bound proves nothing); over every
    # schedule position down, the budget up (a relaxation: its bound is a proof, and a plan that
    # fits only by the rounding is refused by the simulator) (Section "Scaling")
    largest = int(max(budget_bytes, int(sizes.max()) if sizes.size else 0, 1))
    exact = largest // unit <= BYTE_RANGE
    if not exact:
        unit = -(-largest // BYTE_RANGE)
    sc = Scaling(
        byte_unit=unit,
        time_unit=max(span, 1e-12) / (TIME_RANGE_FULL if full and fine_time else TIME_RANGE),
        exact_bytes=exact,
        relaxed_bytes=bool(full) and not exact,
    )
    nbytes = sc.bytes_of(graph.tensor_bytes)
    budget_u = sc.budget_of(budget_bytes)
    fwd_u = sc.time_up(graph.forward_s)
    bwd_u = sc.time_up(graph.backward_s)
    base_dur = np.concatenate([fwd_u, bwd_u[::-1]])
    d2h_u = {int(t): int(sc.time_up(hw.d2h_time(graph.tensor_bytes[t]))) for t in graph.saved}
    h2d_u = {int(t): int(sc.time_up(hw.h2d_time(graph.tensor_bytes[t]))) for t in graph.saved}
    F, G, RC, frontier, coproduced, u, lb = _candidates(graph, hw, full, extra_candidates)
    saved = [int(t) for t in graph.saved]
    m = Model()
    f = Formulation(
        m, graph, hw, budget_bytes, sc, objective_offset_s=graph.optimizer_s, full=bool(full)
    )

    # --- decisions: keep / swap / recompute, exactly one (one_decision)
    for t in saved:
        name = graph.tensors[t].name
        f.keep[t] = m.binary(f"keep[{name}]")
        f.swap[t] = m.binary(f"swap[{name}]")
        f.recompute[t] = m.binary(f"recompute[{name}]")
        m.eq(f"one_decision[{name}]", [(f.keep[t], 1), (f.swap[t], 1), (f.recompute[t], 1)], 1)
        if mask is not None:  # allowed= and pins= (allowed_decision)
            for var, code in ((f.keep[t], 0), (f.swap[t], 1), (f.recompute[t], 2)):
                if not mask[t, code]:
                    m.eq(f"allowed_decision[{name},{code}]", [(var, 1)], 0)
        f.free_after[t] = {k: m.binary(f"free_after[{name},{k}]") for k in F[t]}
        f.issue_at[t] = {k: m.binary(f"issue_at[{name},{k}]") for k in G[t]}
        f.rebuild_at[t] = {k: m.binary(f"rebuild_at[{name},{k}]") for k in RC[t]}
        # swap_schedule: one free position and one issue position per offloaded tensor
        m.eq(
            f"swap_free_once[{name}]",
            [(v, 1) for v in f.free_after[t].values()] + [(f.swap[t], -1)],
            0,
        )
        m.eq(
            f"swap_issue_once[{name}]",
            [(v, 1) for v in f.issue_at[t].values()] + [(f.swap[t], -1)],
            0,
        )
        # issue_after_free: sum g*issue - sum f*free >= swap
        m.ge(
            f"issue_after_free[{name}]",
            [(v, k) for k, v in f.issue_at[t].items()]
            + [(v, -k) for k, v in f.free_after[t].items()]
            + [(f.swap[t], -1)],
            0,
        )
        # rebuild_once
        m.eq(
            f"rebuild_once[{name}]",
            [(v, 1) for v in f.rebuild_at[t].values()] + [(f.recompute[t], -1)],
            0,
        )
    # random_groups: recomputed together or not at all
    for g, members in graph.rng_groups.items():
        for a, b in zip(members, members[1:]):
            m.eq(f"random_group[{g}]", [(f.recompute[a], 1), (f.recompute[b], -1)], 0)

    # --- reruns: an op reruns at position r if any rebuild there needs it (rerun_cover)
    for y in saved:
        for r, v in f.rebuild_at[y].items():
            for q in graph.rerun_ops[y]:
                key = (int(q), r)
                if key not in f.rerun:
                    f.rerun[key] = m.binary(f"rerun[{graph.ops[q].name},{r}]")
                m.le(
                    f"rerun_cover[{graph.tensors[y].name},{graph.ops[q].name},{r}]",
                    [(v, 1), (f.rerun[key], -1)],
                    0,
                )
    reruns_at: dict[int, list[int]] = {}
    for q, r in f.rerun:
        reruns_at.setdefault(r, []).append(q)

    # life_extension: a rebuild at r reads its frontier x there; if x's own last use came
    # earlier, x stays until r (whole positions between, and the rerun points at r)
    ext_full: dict[tuple[int, int], int] = {}
    ext_rerun: dict[tuple[int, int], int] = {}
    for y in saved:
        for r, v in f.rebuild_at[y].items():
            for x in frontier[y]:
                if r <= lb[x]:
                    continue
                xname = graph.tensors[x].name
                for k in range(lb[x] + 1, r + 1):
                    table = ext_full if k < r else ext_rerun
                    if (x, k) not in table:
                        kind = "life_extension" if k < r else "life_extension_rerun"
                        table[(x, k)] = m.binary(f"{kind}[{xname},{k}]")
                    m.ge(
                        f"life_extension[{graph.tensors[y].name},{xname},{k}]",
                        [(table[(x, k)], 1), (v, -1)],
                        0,
                    )
    for (x, k), w in ext_full.items():
        if (x, k) not in ext_rerun:
            ext_rerun[(x, k)] = m.binary(f"life_extension_rerun[{graph.tensors[x].name},{k}]")
        m.ge(
            f"life_extension_covers_reruns[{graph.tensors[x].name},{k}]",
            [(ext_rerun[(x, k)], 1), (w, -1)],
            0,
        )
    ext_main_at: dict[int, list[tuple[int, int]]] = {}
    ext_rerun_at: dict[int, list[tuple[int, int]]] = {}
    for (x, k), w in ext_full.items():
        ext_main_at.setdefault(k, []).append((w, int(nbytes[x])))
    for (x, k), w in ext_rerun.items():
        ext_rerun_at.setdefault(k, []).append((w, int(nbytes[x])))

    # --- recompute dependencies
    for y in saved:
        yname = graph.tensors[y].name
        for r, v in f.rebuild_at[y].items():
            for x in frontier[y]:
                xname = graph.tensors[x].name
                # rebuild_inputs_resident: kept (alive at r, by life_extension if needed),
                # offloaded (prefetched by r), or rebuilt by r
                m.le(
                    f"rebuild_inputs_resident[{yname},{xname},{r}]",
                    [(v, 1), (f.keep[x], -1), (f.swap[x], -1)]
                    + [(w, -1) for k, w in f.rebuild_at[x].items() if k <= r],
                    0,
                )
                # prefetch_before_rebuild: an offloaded input is issued by r
                late = [(w, 1) for k, w in f.issue_at[x].items() if k > r]
                if late:
                    m.le(f"prefetch_before_rebuild[{yname},{xname},{r}]", late + [(v, 1)], 1)
            for x in coproduced[y]:
                later = [(w, 1) for k, w in f.rebuild_at[x].items() if k > r]
                if later:
                    m.le(
                        f"coproduced_rebuilt_with[{yname},{graph.tensors[x].name},{r}]",
                        later + [(v, 1)],
                        1,
                    )

    # --- memory: running sum of lives (memory_running_sum), then the budget per position
    starts: dict[int, list[tuple[int, int]]] = {}
    ends: dict[int, list[tuple[int, int]]] = {}

    def life(var, b, s, e):
        starts.setdefault(int(s), []).append((var, int(b)))
        ends.setdefault(int(e), []).append((var, int(b)))

    prod = graph.producer
    last_fwd = graph.last_forward_use
    for t in saved:
        b = nbytes[t]
        life(f.keep[t], b, prod[t], lb[t])
        life(f.recompute[t], b, prod[t], last_fwd[t])
        for k, w in f.rebuild_at[t].items():
            starts.setdefault(k, []).append((w, int(b)))
        ends.setdefault(lb[t], []).append((f.recompute[t], int(b)))
        starts.setdefault(int(prod[t]), []).append((f.swap[t], int(b)))
        for k, w in f.free_after[t].items():
            ends.setdefault(k, []).append((w, int(b)))
        for k, w in f.issue_at[t].items():
            starts.setdefault(k, []).append((w, int(b)))
        ends.setdefault(lb[t], []).append((f.swap[t], int(b)))
    constant = np.zeros(S, dtype=np.int64)
    for t in np.flatnonzero(~graph.is_saved):
        constant[prod[t] : last_fwd[t] + 1] += nbytes[t]
    total = int(nbytes[graph.saved].sum()) + 1
    out_bytes = [int(nbytes[list(outs)].sum()) if outs else 0 for outs in graph.op_outputs]
    fwd_ws = sc.bytes_of(graph.forward_ws)
    bwd_ws = sc.bytes_of(graph.backward_ws)
    rerun_ws = graph.rerun_ws
    replays = graph.op_rerun_with
    rebuilt_here: dict[int, list[tuple[tuple[int, int], int]]] = {}
    for t in saved:
        for k, w in f.rebuild_at[t].items():
            rebuilt_here.setdefault(k, []).append(((w, -int(nbytes[t])), t))
    # memory_running_sum: resident[k] = resident[k-1] + lives starting at k - lives ended at k-1
    f.resident = _running_sum(
        m, "resident", S, starts, ends, total, constraint="memory_running_sum"
    )
    for k in range(S):
        v = f.resident[k]
        cap = budget_u - int(constant[k])
        if k < n:
            m.le(f"memory_budget[{k}]", [(v, 1)], cap - int(fwd_ws[k]))
            continue
        j = S - 1 - k
        # memory_budget_backward: the backward op itself (no rebuild transients are left then)
        m.le(f"memory_budget[{k}]", [(v, 1)] + ext_main_at.get(k, []), cap - int(bwd_ws[j]))
        # memory_budget_rerun: each rerun point before it, in forward order of the rerun ops
        ops_here = sorted(reruns_at.get(k, ()))
        rebuilt = rebuilt_here.get(k, [])
        for qi, q in enumerate(ops_here):
            z = f.rerun[(q, k)]
            terms = [(v, 1)] + ext_rerun_at.get(k, [])
            # rebuilt tensors whose producer reruns later are not there yet
            terms += [(w, b) for (w, b), t in rebuilt if graph.producer[t] > q]
            # this op's outputs, less those rebuilt here (already counted in resident)
            terms.append((z, int(out_bytes[q])))
            terms += [(w, b) for (w, b), t in rebuilt if graph.producer[t] == q]
            # unsaved outputs of earlier reruns still to be read by this or a later rerun
            for q0 in ops_here[:qi]:
                for o in graph.op_outputs[q0]:
                    if graph.is_saved[o]:
                        continue
                    readers = [q2 for q2 in ops_here[qi:] if o in graph.op_inputs[q2]]
                    # transient_held: a replayed region (Op.rerun_with) holds it while its
                    # forward did, at this op's rerun if both rerun
                    held = bool(replays[q0]) and q <= int(last_fwd[o])
                    if not readers and not held:
                        continue
                    y = m.var(f"transient[{graph.tensors[o].name},{graph.ops[q].name},{k}]", 0, 1)
                    for q2 in readers:
                        m.ge(
                            f"transient_alive[{graph.tensors[o].name},{graph.ops[q].name},{k}]",
                            [(y, 1), (f.rerun[(q2, k)], -1)],
                            0,
                        )
                    if held:
                        m.ge(
                            f"transient_held[{graph.tensors[o].name},{graph.ops[q].name},{k}]",
                            [(y, 1), (f.rerun[(q0, k)], -1), (z, -1)],
                            -1,
                        )
                    terms.append((y, int(nbytes[o])))
            # the rerun op's workspace and the gradients waiting for the backward op at k
            terms.append((z, int(sc.bytes_of(int(graph.forward_ws[q]) + int(rerun_ws[j])))))
            m.le(f"memory_budget_rerun[{graph.ops[q].name},{k}]", terms, cap)

    # --- time: compute stream (compute_order), lanes (d2h_lane, h2d_lane), waits
    rerun_time = {
        k: [(f.rerun[(q, k)], int(fwd_u[q])) for q in reruns_at.get(k, ())] for k in range(S)
    }
    horizon = int(
        base_dur.sum()
        + sum(fwd_u[q] for q, _ in f.rerun)
        + sum(d2h_u.values())
        + sum(h2d_u.values())
    )
    if hw.collectives_on_link:
        horizon += int(
            sum(
                sc.time_up(hw.d2h_time(c.d2h_bytes) + hw.h2d_time(c.h2d_bytes))
                for c in graph.collectives
            )
        )
    T_ub = 2 * horizon + 1000
    for k in range(S):
        f.start.append(m.var(f"start[{k}]", 0, T_ub))
    for k in range(1, S):
        m.ge(
            f"compute_order[{k}]",
            [(f.start[k], 1), (f.start[k - 1], -1)] + [(z, -c) for z, c in rerun_time[k - 1]],
            int(base_dur[k - 1]),
        )

    def arrive(k):
        """terms and constant of the time position k is reached (before any wait)."""
        if k == 0:
            return [], 0
        return [(f.start[k - 1], 1)] + rerun_time[k - 1], int(base_dur[k - 1])

    d2h_order = sorted(saved, key=lambda t: (prod[t], t))
    # collectives on the lanes (collective_d2h, collective_h2d): jobs of fixed length, released
    # when their position is reached, in each lane's FIFO chain (Section "Collectives")
    charged = bool(hw.collectives_on_link and graph.collectives)
    f.collectives_charged = charged
    comms = (
        [(graph.collective_slot(c), j, c) for j, c in enumerate(graph.collectives)]
        if charged
        else []
    )

    def collective_job(lane: str, k: int, c, nbytes_c: int, prev_var):
        p_c = int(sc.time_up(hw.d2h_time(nbytes_c) if lane == "d2h" else hw.h2d_time(nbytes_c)))
        L = m.var(f"collective_{lane}[{c.name}]", 0, T_ub)
        terms, const = arrive(k)
        m.ge(
            f"collective_{lane}_release[{c.name}]",
            [(L, 1)] + [(v, -q) for v, q in terms],
            const + p_c,
        )
        if prev_var is not None:
            m.ge(f"collective_{lane}_fifo[{c.name}]", [(L, 1), (prev_var, -1)], p_c)
        return L

    d2h_items = sorted(
        [((prod[t], 1, t), t, None) for t in d2h_order]
        + [((k, 0, j), None, c) for k, j, c in comms if c.d2h_bytes],
        key=lambda item: item[0],
    )
    lane_d: dict[int, int] = {}
    prev = None
    for _, t, c in d2h_items:
        if c is not None:
            prev = collective_job("d2h", graph.collective_slot(c), c, c.d2h_bytes, prev)
            continue
        name = graph.tensors[t].name
        L = m.var(f"d2h_done[{name}]", 0, T_ub)
        lane_d[t] = L
        f.d2h_done[t] = L
        p = d2h_u[t]
        if prev is not None:
            m.ge(f"d2h_lane_fifo[{name}]", [(L, 1), (prev, -1), (f.swap[t], -p)], 0)
        m.ge(
            f"d2h_release[{name}]",
            [(L, 1), (f.start[prod[t]], -1), (f.swap[t], -p)],
            int(fwd_u[prod[t]]),
        )
        for k, w in f.free_after[t].items():
            m.ge(f"d2h_before_free[{name},{k}]", [(f.start[k + 1], 1), (L, -1)], 0, enforce=(w,))
        prev = L
    last_d2h = prev
    h2d_order = sorted(saved, key=lambda t: (u[t], t))
    f.d2h_order, f.h2d_order = d2h_order, h2d_order
    f.units = {
        "fwd": fwd_u,
        "base_dur": base_dur,
        "d2h": d2h_u,
        "h2d": h2d_u,
        "u": u,
        "frontier": frontier,
    }
    lane_h: dict[int, int] = {}
    prev_l = prev_j = None
    h2d_items = sorted(
        [((u[t], 1, t), t, None) for t in h2d_order]
        + [((k, 0, j), None, c) for k, j, c in comms if c.h2d_bytes],
        key=lambda item: item[0],
    )
    for _, t, c in h2d_items:
        if c is not None:
            prev_l = collective_job("h2d", graph.collective_slot(c), c, c.h2d_bytes, prev_l)
            continue
        name = graph.tensors[t].name
        L = m.var(f"h2d_done[{name}]", 0, T_ub)
        lane_h[t] = L
        f.h2d_done[t] = L
        J = m.var(f"issue_order[{name}]", 0, S)
        f.issue_order[t] = J
        p = h2d_u[t]
        if prev_l is not None:
            m.ge(f"h2d_lane_fifo[{name}]", [(L, 1), (prev_l, -1), (f.swap[t], -p)], 0)
        if prev_j is not None:
            m.ge(f"h2d_issue_order[{name}]", [(J, 1), (prev_j, -1)], 0)
        m.eq(
            f"issue_position[{name}]",
            [(J, 1)] + [(w, -k) for k, w in f.issue_at[t].items()],
            0,
            enforce=(f.swap[t],),
        )
        for k, w in f.issue_at[t].items():
            terms, const = arrive(k)
            m.ge(
                f"h2d_release[{name},{k}]",
                [(L, 1)] + [(v, -c) for v, c in terms],
                const + p,
                enforce=(w,),
            )
        m.ge(f"h2d_after_d2h[{name}]", [(L, 1), (lane_d[t], -1)], p, enforce=(f.swap[t],))
        if not hw.duplex:
            m.ge(f"shared_link[{name}]", [(L, 1), (last_d2h, -1)], p, enforce=(f.swap[t],))
        m.ge(f"prefetch_arrives[{name}]", [(f.start[u[t]], 1), (L, -1)], 0, enforce=(f.swap[t],))
        prev_l, prev_j = L, J
    # offloaded inputs of a rebuild arrive before it runs (prefetch_arrives_for_rebuild)
    for y in saved:
        for r, v in f.rebuild_at[y].items():
            for x in frontier[y]:
                if r < u[x]:
                    Lx = lane_h[x]
                    m.ge(
                        f"prefetch_arrives_for_rebuild[{graph.tensors[y].name},{graph.tensors[x].name},{r}]",
                        [(f.start[r], 1), (Lx, -1)],
                        0,
                        enforce=(v, f.swap[x]),
                    )

    if cuts and not charged:  # the cuts count activation copies alone on the lanes
        _lane_capacity_cuts(f, nbytes, budget_u, constant, fwd_ws, bwd_ws, u, lb)

    # objective: end of the last backward op (step_time); with collectives on the lanes, the
    # optimizer also waits for the last lane job (step_end)
    m.objective = [(f.start[S - 1], 1)] + rerun_time[S - 1]
    m.objective_offset = int(base_dur[S - 1])
    if charged:
        end = m.var("step_end", 0, T_ub)
        m.ge(
            "step_end_compute",
            [(end, 1), (f.start[S - 1], -1)] + [(v, -q) for v, q in rerun_time[S - 1]],
            int(base_dur[S - 1]),
        )
        for lane_end in (prev, prev_l):
            if lane_end is not None:
                m.ge("step_end_lanes", [(end, 1), (lane_end, -1)], 0)
        m.objective = [(end, 1)]
        m.objective_offset = 0
    if hint is not None:
        _apply_hint(f, hint)
    return f


def _apply_hint(f: Formulation, hint) -> None:
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


def _running_sum(
    m: Model, name: str, S: int, starts, ends, ub: int, constraint: str | None = None
) -> list[int]:
    """Variables V_k = sum of coef*x over the intervals covering position k."""
    out: list[int] = []
    for k in range(S):
        v = m.var(f"{name}[{k}]", 0, ub)
        terms = [(v, 1)]
        if k:
            terms.append((out[k - 1], -1))
        terms += [(w, -b) for w, b in starts.get(k, ())]
        terms += [(w, b) for w, b in ends.get(k - 1, ())]
        m.eq(f"{constraint or name + '_running_sum'}[{k}]", terms, 0)
        out.append(v)
    return out


def _lane_capacity_cuts(f: Formulation, nbytes, budget_u, constant, fwd_ws, bwd_ws, u, lb) -> None:
    """Valid inequalities of the LP bound (formulations/lp-bound.md) in the MILP's variables:
    a lane moves at most bandwidth x elapsed time, offloads not yet moved are still resident,
    prefetches needed by now have landed and stay until their last use. Every plan satisfies
    them, so they cut no plan off; they only tighten the relaxation (lane_capacity_cuts)."""
    g, m, sc, hw = f.graph, f.model, f.scaling, f.hw
    n, S = g.n_ops, g.n_slots
    kappa = 1000
    bw_d = int(np.ceil(hw.d2h_bytes_per_s * sc.time_unit / sc.byte_unit * kappa))
    bw_h = int(np.ceil(hw.h2d_bytes_per_s * sc.time_unit / sc.byte_unit * kappa))
    saved = list(f.keep)
    prod, last_fwd = g.producer, g.last_forward_use
    total = int(nbytes[g.saved].sum()) + 1
    q_st, f_st, f_en, need_st, free_st, g_st, g_en = {}, {}, {}, {}, {}, {}, {}

    def put(d, k, item):
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
    produced = _running_sum(m, "cut_offloaded_produced", S, q_st, {}, total)
    in_fwd_life = _running_sum(m, "cut_offloaded_in_forward_life", S, f_st, f_en, total)
    needed = _running_sum(m, "cut_offloaded_needed", S, need_st, {}, total)
    freed = _running_sum(m, "cut_offloaded_freed", S, free_st, {}, total)
    least = _running_sum(m, "cut_kept_or_rebuilt", S, g_st, g_en, total)
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
