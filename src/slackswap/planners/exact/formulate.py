"""Build the MILP of formulations/milp.md, one method per section of it, cited by the comments
and constraint names. Sets: saved tensors x; positions k = 0..2n-1. Candidates per tensor
(candidates.py, Section "Candidates"): F(x) positions after which an offloaded x may leave, G(x)
positions at which its prefetch may be issued, Rc(x) positions at which it may be rebuilt. Bytes
and seconds are scaled to integers, rounded so the model never claims a plan fits that does not
(planners/scaling.py; milp.md, Section "Scaling").
"""

from __future__ import annotations

import numpy as np

from ...core.graph import ActivationGraph
from ...core.hardware import Hardware
from ...core.plan import SWAP
from ..limits import FULL_CELLS
from ..scaling import scaling_for
from .candidates import candidates
from .formulation import Formulation
from .hint import apply_hint
from .host_row import host_memory_row
from .lane_cuts import lane_capacity_cuts
from .model import Model
from .running_sum import running_sum
from .start_domains import start_domains


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
    exact_arithmetic: bool = False,
    every_rebuild: bool | None = None,
    earliest: bool = True,
) -> Formulation:
    """The MILP for ``graph`` under ``budget_bytes``, built section by section: a
    :class:`Formulation`, the model and its variables by tensor and position.

    Args:
        full: every candidate position (exact over all schedules; default for graphs of at most
            16 ops or FULL_CELLS positions x saved tensors), else windows (Section "Candidates").
        hint: (codes, free, issue, rebuild) of a known plan, added to the candidates and hinted.
        extra_candidates: more positions per tensor ({"free", "issue", "rebuild"}).
        cuts: add the lane-capacity cuts (lane_cuts.py).
        mask: allowed decisions per tensor (core/restrict.py), fixed in the model.
        exact_arithmetic: a backend in exact integer arithmetic (CP-SAT): finer byte and time
            units (Section "Scaling and rounding").
        every_rebuild: every backward position a rebuild candidate (default ``full``); False:
            where a rebuild is due, a restriction (``Formulation.full`` False: no proof).
        earliest: where nothing may swap, the earliest schedule (milp.md, start_earliest).
    """
    build = MilpBuilder(
        graph,
        hw,
        budget_bytes,
        full=full,
        hint=hint,
        extra=extra_candidates,
        mask=mask,
        cuts=cuts,
        exact_arithmetic=exact_arithmetic,
        every_rebuild=every_rebuild,
        earliest=earliest,
    )
    build.decisions()
    host_memory_row(build.f, build.saved)
    build.reruns()
    build.rebuild_dependencies()
    build.memory()
    build.compute_order()
    build.d2h_lane()
    build.h2d_lane()
    build.objective()
    return build.f


class MilpBuilder:
    """The model under construction and what its sections share: the scaled sizes and times,
    the candidates, and the variables made so far (on ``f``, the Formulation)."""

    def __init__(
        self,
        graph: ActivationGraph,
        hw: Hardware,
        budget_bytes: int,
        *,
        full,
        hint,
        extra,
        mask,
        cuts: bool,
        exact_arithmetic: bool,
        every_rebuild: bool | None = None,
        earliest: bool = True,
    ) -> None:
        n = graph.n_ops
        S = graph.n_positions
        if full is None:  # every position where the model stays small (Section "Candidates")
            full = n <= 16 or S * len(graph.saved) <= FULL_CELLS
        sc = scaling_for(graph, hw, budget_bytes, bool(full), exact_arithmetic)
        self.graph, self.hw, self.n, self.S, self.sc = graph, hw, n, S, sc
        self.hint, self.mask, self.cuts = hint, mask, cuts
        self.nbytes = sc.bytes_of(graph.tensor_bytes)
        self.budget_u = sc.budget_of(budget_bytes)
        self.fwd_u = sc.time_up(graph.forward_s)
        bwd_u = sc.time_up(graph.backward_s)
        self.base_dur = np.concatenate([self.fwd_u, bwd_u[::-1]])
        self.d2h_u = {
            int(t): int(sc.time_up(hw.d2h_time(graph.tensor_bytes[t]))) for t in graph.saved
        }
        self.h2d_u = {
            int(t): int(sc.time_up(hw.h2d_time(graph.tensor_bytes[t]))) for t in graph.saved
        }
        found = candidates(graph, hw, full, extra, every_rebuild=every_rebuild)
        self.F, self.G, self.RC, self.frontier, self.coproduced, self.u, self.lb = found
        self.saved = [int(t) for t in graph.saved]
        no_swap = mask is not None and not mask[graph.saved, SWAP].any()  # (start_earliest)
        self.earliest = earliest and no_swap
        self.m = Model()
        self.f = Formulation(
            self.m,
            graph,
            hw,
            budget_bytes,
            sc,
            objective_offset_s=graph.optimizer_s,
            full=bool(full) and every_rebuild is not False,  # a proof needs every rebuild too
        )

    def decisions(self) -> None:
        """keep / swap / recompute, exactly one (one_decision), their schedule positions
        (swap_free_once, swap_issue_once, issue_after_free, rebuild_once), random groups."""
        graph, m, f = self.graph, self.m, self.f
        F, G, RC, mask, saved = self.F, self.G, self.RC, self.mask, self.saved
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

    def reruns(self) -> None:
        """An op reruns at position r if any rebuild there needs it (rerun_cover); a rebuild
        keeps its frontier alive until it runs (life_extension)."""
        graph, m, f = self.graph, self.m, self.f
        frontier, lb, nbytes, saved = self.frontier, self.lb, self.nbytes, self.saved
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
        self.ext_main_at = ext_main_at
        self.ext_rerun_at = ext_rerun_at
        self.reruns_at = reruns_at

    def rebuild_dependencies(self) -> None:
        """A rebuild's inputs are resident when it runs (rebuild_inputs_resident,
        prefetch_before_rebuild, coproduced_rebuilt_with)."""
        graph, m, f = self.graph, self.m, self.f
        coproduced, frontier, saved = self.coproduced, self.frontier, self.saved
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

    def memory(self) -> None:
        """The running sum of lives (memory_running_sum), then the budget at every point:
        forward ops, backward ops, and each rerun before a backward op (memory_budget,
        memory_budget_rerun, transient_alive, transient_held)."""
        graph, m, f = self.graph, self.m, self.f
        S, budget_u, lb = self.S, self.budget_u, self.lb
        ext_main_at, ext_rerun_at = self.ext_main_at, self.ext_rerun_at
        n, nbytes, reruns_at, saved, sc = self.n, self.nbytes, self.reruns_at, self.saved, self.sc
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
        for unsaved in np.flatnonzero(~graph.is_saved):
            constant[prod[unsaved] : last_fwd[unsaved] + 1] += nbytes[unsaved]
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
        f.resident = running_sum(
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
                        # continuous for an LP-based solver: the rows below press it to 0 or 1
                        y = m.var(
                            f"transient[{graph.tensors[o].name},{graph.ops[q].name},{k}]",
                            0,
                            1,
                            lp_integral=False,
                        )
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
        self.bwd_ws = bwd_ws
        self.constant = constant
        self.fwd_ws = fwd_ws
        self.prod = prod

    def compute_order(self) -> None:
        """The compute stream (compute_order) and each position's start."""
        graph, m, f = self.graph, self.m, self.f
        S, base_dur, d2h_u, fwd_u, h2d_u = self.S, self.base_dur, self.d2h_u, self.fwd_u, self.h2d_u
        hw, reruns_at, sc = self.hw, self.reruns_at, self.sc
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
        rerun_cost = None
        if self.earliest:  # start_earliest
            rerun_cost = np.zeros(S, dtype=np.int64)
            for q, r in f.rerun:
                rerun_cost[r] += int(fwd_u[q])
        before, latest = start_domains(base_dur, rerun_cost, T_ub)  # start_bounds
        for k in range(S):
            f.start.append(m.var(f"start[{k}]", int(before[k]), int(latest[k])))
        order = m.eq if self.earliest else m.ge  # (start_earliest: nothing waits)
        for k in range(1, S):
            order(
                f"compute_order[{k}]",
                [(f.start[k], 1), (f.start[k - 1], -1)] + [(z, -c) for z, c in rerun_time[k - 1]],
                int(base_dur[k - 1]),
            )

        def arrive(k):
            """terms and constant of the time position k is reached (before any wait)."""
            if k == 0:
                return [], 0
            return [(f.start[k - 1], 1)] + rerun_time[k - 1], int(base_dur[k - 1])

        self.T_ub = T_ub
        self.arrive = arrive
        self.rerun_time = rerun_time

    def d2h_lane(self) -> None:
        """The D2H lane, first in first out in production order, with the collectives that
        share it (d2h_lane_fifo, d2h_release, d2h_before_free, collective_d2h)."""
        graph, m, f = self.graph, self.m, self.f
        T_ub, d2h_u, fwd_u, hw, prod = self.T_ub, self.d2h_u, self.fwd_u, self.hw, self.prod
        saved = [] if self.earliest else self.saved  # (start_earliest: collectives alone)
        d2h_order = sorted(saved, key=lambda t: (prod[t], t))
        # collectives on the lanes (collective_d2h, collective_h2d): jobs of fixed length, released
        # when their position is reached, in each lane's FIFO chain (Section "Collectives")
        charged = bool(hw.collectives_on_link and graph.collectives)
        f.collectives_charged = charged
        comms = (
            [(graph.collective_position(c), j, c) for j, c in enumerate(graph.collectives)]
            if charged
            else []
        )

        d2h_items = sorted(
            [((prod[t], 1, t), t, None) for t in d2h_order]
            + [((k, 0, j), None, c) for k, j, c in comms if c.d2h_bytes],
            key=lambda item: item[0],
        )
        lane_d: dict[int, int] = {}
        prev = None
        for _, t, c in d2h_items:
            if c is not None:
                prev = self.collective_job(
                    "d2h", graph.collective_position(c), c, c.d2h_bytes, prev
                )
                continue
            assert t is not None  # (an item is a collective or a tensor)
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
                m.ge(
                    f"d2h_before_free[{name},{k}]", [(f.start[k + 1], 1), (L, -1)], 0, enforce=(w,)
                )
            prev = L
        self.charged, self.comms, self.lane_d, self.last_d2h = charged, comms, lane_d, prev
        self.prev, self.d2h_order = prev, d2h_order

    def h2d_lane(self) -> None:
        """The H2D lane, first in first out in first-use order (h2d_lane_fifo, h2d_issue_order,
        issue_position, h2d_release, h2d_after_d2h, shared_link, prefetch_arrives,
        prefetch_arrives_for_rebuild, collective_h2d)."""
        graph, m, f = self.graph, self.m, self.f
        S, T_ub, arrive, base_dur, d2h_u = self.S, self.T_ub, self.arrive, self.base_dur, self.d2h_u
        frontier, fwd_u, h2d_u, hw = self.frontier, self.fwd_u, self.h2d_u, self.hw
        saved, u, comms = self.saved, self.u, self.comms
        lane_d, last_d2h = self.lane_d, self.last_d2h
        d2h_order = self.d2h_order
        h2d_order = [] if self.earliest else sorted(saved, key=lambda t: (u[t], t))
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
                prev_l = self.collective_job(
                    "h2d", graph.collective_position(c), c, c.h2d_bytes, prev_l
                )
                continue
            assert t is not None  # (an item is a collective or a tensor)
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
            m.ge(
                f"prefetch_arrives[{name}]", [(f.start[u[t]], 1), (L, -1)], 0, enforce=(f.swap[t],)
            )
            prev_l, prev_j = L, J
        # offloaded inputs of a rebuild arrive before it runs (prefetch_arrives_for_rebuild)
        for y in [] if self.earliest else saved:
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
        self.prev_l = prev_l

    def collective_job(self, lane: str, k: int, c, nbytes_c: int, prev_var):
        """A collective on a lane: a job of fixed length, released when its position is
        reached, after the lane's previous job (collective_d2h, collective_h2d)."""
        m, sc, hw, T_ub = self.m, self.sc, self.hw, self.T_ub
        p_c = int(sc.time_up(hw.d2h_time(nbytes_c) if lane == "d2h" else hw.h2d_time(nbytes_c)))
        L = m.var(f"collective_{lane}[{c.name}]", 0, T_ub)
        terms, const = self.arrive(k)
        m.ge(
            f"collective_{lane}_release[{c.name}]",
            [(L, 1)] + [(v, -q) for v, q in terms],
            const + p_c,
        )
        if prev_var is not None:
            m.ge(f"collective_{lane}_fifo[{c.name}]", [(L, 1), (prev_var, -1)], p_c)
        return L

    def objective(self) -> Formulation:
        """The lane-capacity cuts, the objective (the end of the last backward op, or with
        collectives on the lanes the last lane job: step_end), and the hint."""
        m, f, S, T_ub, base_dur = self.m, self.f, self.S, self.T_ub, self.base_dur
        charged, rerun_time = self.charged, self.rerun_time
        if self.cuts and not charged:  # the cuts count activation copies alone on the lanes
            lane_capacity_cuts(f, self)

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
            for lane_end in (self.prev, self.prev_l):
                if lane_end is not None:
                    m.ge("step_end_lanes", [(end, 1), (lane_end, -1)], 0)
            m.objective = [(end, 1)]
            m.objective_offset = 0
        if self.hint is not None:
            apply_hint(f, self.hint)
        return f
