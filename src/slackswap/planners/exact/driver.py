"""What every exact backend shares: the warm start, the solve strategy, the decode, and the
guarantee that the returned plan is never worse than the warm start (so never worse than the
heuristic's).

Strategy (formulations/milp.md, "Solving"): the LP bound first; the warm start (warmstart.py:
the heuristic, improved by local search from the integral relaxation's decisions) is returned at
once when it is within the gap target of the bound. Otherwise small models are solved whole;
large ones LP-guided: tensors the LP decides integrally are fixed to that decision (their
schedule positions stay free) and the MILP decides the rest. The proof is the best valid bound:
the LP's, the integral relaxation's, and the MILP's own for a model over every schedule position.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import numpy as np

from ...check.simulate import run_timeline
from ...core.plan import (
    KEEP,
    OVERHEAD_TARGET,
    RECOMPUTE,
    STEP_FLOOR,
    SWAP,
    SolveInfo,
    proof_tolerance_s,
)
from ...core.stepmodel import expand
from ..base import Problem, Solution
from .formulate import Formulation, formulate
from .limits import DEFAULT_TIME_LIMIT_S, Clock, WorkLimits
from .result import BackendResult, BackendStatus

log = logging.getLogger("slackswap")

MIN_SEARCH_S = 0.3  # anytime: below this much time left, no MILP is built
# anytime: the LP bound's share of the time left, and what a phase costs before it can stop on
# its own, per position (a phase is started only when the time left covers it)
LP_SHARE = 0.8
LP_S_PER_SLOT = 4e-4  # building the LP bound (GPT-2 XL: 1,160 positions, 0.45 s)
FORMULATE_S_PER_SLOT = 4e-4  # building the MILP (GPT-2 XL: 0.4 s)
CLOSE_S_PER_SLOT = 5e-5  # solve()'s closing, checking and simulating (640 layers: about 0.6 s)


WHOLE_MODEL_BINARIES = 2500
# the proof round (milp.md, "The proof round"): the model over every position, when a plan is
# not proven, on graphs of at most this many positions x saved tensors (SegNet: 176 x 65) and
# nonzeros, with at least this much time left
PROOF_CELLS = 12_000
PROOF_NONZEROS = 400_000
MIN_PROOF_S = 1.0  # anytime: less time left than this, no proof round
# status "optimal": proven within 1% of the plan's overhead, or 1e-5 of its step (core/plan.py)


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
        best = max(values, key=values.get)
        if values[best] < threshold:
            continue
        if best == RECOMPUTE and not f.rebuild_at[t]:
            continue
        if agree_with is not None and agree_with[t] != best:
            continue
        for code, var in ((KEEP, f.keep[t]), (SWAP, f.swap[t]), (RECOMPUTE, f.recompute[t])):
            fixed[var] = int(code == best)
    return fixed


def _skipped_bound(graph, budget: int, why: str):
    """The trivial bound (no plan beats the ideal step), when the LP bound is not built."""
    from ..lpbound import LPBound

    ideal = graph.ideal_step_time_s
    return LPBound(1.0, ideal, ideal, budget, "skipped", 0.0, {}, {}, {}, note=why)


class ExactBackend:
    """Subclasses implement ``run(formulation, time_limit_s, seed, workers, options, fixed)``,
    returning a :class:`BackendResult` (result.py)."""

    name = "exact"
    honours_restrictions = True  # Problem.mask: fixed in the MILP, the bound and every start
    # integers solved exactly (CP-SAT), not in floating point with tolerances (HiGHS, CBC): the
    # model may then use a finer time unit (formulations/milp.md, "Scaling and rounding")
    exact_arithmetic = False
    options = frozenset(
        {
            "seed",
            "workers",
            "warm_start",
            "full",
            "strategy",
            "polish",
            "gap",
            "coarse",
            "log",
            "linearization_level",
            "deterministic",
            "departure",
            "anytime",
            "work_s",
        }
    )

    def is_available(self) -> bool:
        return True

    def run(
        self,
        f: Formulation,
        time_limit_s: float,
        seed: int,
        workers: int,
        options: dict[str, Any],
        fixed: dict[int, int] | None = None,
    ) -> BackendResult:
        raise NotImplementedError

    def solve(
        self,
        problem: Problem,
        time_limit_s: float | None = None,
        seed: int = 0,
        workers: int = 2,
        warm_start: bool = True,
        full: bool | None = None,
        strategy: str = "auto",
        polish: bool = True,
        deterministic: bool | None = None,
        coarse: bool = True,
        departure: bool = True,
        anytime: bool = False,
        work_s: float | None = None,
        **options: Any,
    ) -> Solution:
        """The best plan found within the work allowed (``work_s``, default the time limit;
        limits.py) and the time limit (a hard cap). By default a plan whose search the clock
        stopped anywhere is "timeout", whatever it proved: another machine, or this one idle,
        could return another plan (``extra["clock_stopped"]`` names the phases)."""
        solution = self._search(
            problem,
            time_limit_s,
            seed,
            workers,
            warm_start,
            full,
            strategy,
            polish,
            deterministic,
            coarse,
            departure,
            anytime,
            work_s,
            **options,
        )
        extra = solution.info.extra
        if (
            not extra.get("anytime")
            and extra.get("clock_stopped")
            and solution.info.status != "timeout"
        ):
            info = replace(
                solution.info,
                status="timeout",
                extra={**extra, "status_before_clock": solution.info.status},
            )
            solution = replace(solution, info=info)
        return solution

    def _search(
        self,
        problem: Problem,
        time_limit_s: float | None,
        seed: int,
        workers: int,
        warm_start: bool,
        full: bool | None,
        strategy: str,
        polish: bool,
        deterministic: bool | None,
        coarse: bool,
        departure: bool,
        anytime: bool,
        work_s: float | None,
        **options: Any,
    ) -> Solution:
        from ..lpbound import IPM_FROM_SLOTS, lp_bound
        from .decode import decode
        from .warmstart import heuristic_start
        from .warmstart import warm_start as build_warm_start

        start = time.perf_counter()
        limit = DEFAULT_TIME_LIMIT_S if time_limit_s is None else float(time_limit_s)
        if deterministic is not None:
            # the older switch: True is now the default, False the clock-shared search
            anytime = anytime or not deterministic
        # solve() closes, checks and simulates the plan after this returns, within the limit; the
        # limit counts from solve()'s entry (its first call in a process loads this planner: about
        # 0.5 s of OR-Tools' import, which put a 1 s limit at 1.15 s)
        clock_from = start if problem.began is None else min(start, problem.began)
        deadline = clock_from + limit - CLOSE_S_PER_SLOT * problem.graph.n_slots
        clock = Clock(deadline)
        work = WorkLimits.for_work(
            limit if work_s is None else float(work_s), anytime=anytime, time_limit_s=limit
        )

        def left() -> float:
            return deadline - time.perf_counter()

        g, hw, budget = problem.graph, problem.hardware, problem.budget_bytes
        # where the search stops: within ``gap`` of the overhead of a valid bound (default the
        # proof target; 0 searches to the end). The status says "optimal" only at the proof
        # target (core/plan.py: 1% of the overhead or 1e-5 of the step), whatever ``gap`` is
        gap_target = float(options.get("gap", OVERHEAD_TARGET))
        ideal = g.ideal_step_time_s

        def within(step: float, bound: float | None, target: float = OVERHEAD_TARGET) -> bool:
            return (
                bound is not None
                and np.isfinite(step)
                and step - bound <= proof_tolerance_s(step, ideal, target)
            )

        # the heuristic's plan first: a short limit on a loaded machine still returns at least
        # the plan of solve(solver="heuristic"); the LP bound gets its work (anytime: the time
        # left)
        heuristic = heuristic_start(problem, deadline if anytime else None)
        if anytime:
            run_lp = left() > 2 * LP_S_PER_SLOT * g.n_slots
        else:
            run_lp = work.solves_lp(g.n_slots, IPM_FROM_SLOTS) and not clock.passed()
            if not run_lp and clock.passed():
                clock.stop("lp_bound")
        if run_lp:
            lp = lp_bound(
                g,
                budget,
                hw,
                mask=problem.mask,
                max_iterations=work.lp_iterations if g.n_slots <= IPM_FROM_SLOTS else None,
                time_limit_s=max(0.01, (LP_SHARE if anytime else 1.0) * left()),
            )
        else:  # no time (anytime) or work to build it: no bound, and no proof
            lp = _skipped_bound(
                g,
                budget,
                "no time left to build the LP bound"
                if anytime
                else "the LP bound's model is too large for the work allowed",
            )
        lp_s = lp.step_time_s if lp.status == "optimal" else None
        ws = build_warm_start(
            problem,
            polish=polish and warm_start,
            bound_s=lp_s,
            gap=gap_target,
            work=work,
            clock=clock,
            lp=lp,
            heuristic=heuristic,
            solve_coarse=None
            if not coarse
            else lambda small, lim, wk: self.solve(
                small,
                time_limit_s=lim,
                work_s=wk,
                seed=seed,
                workers=workers,
                anytime=anytime,
                departure=departure,
            ),
            departure=departure,
        )
        heuristic_time = ws.heuristic_sim.step_time_s if ws.heuristic_sim.fits else float("inf")
        warm_time = ws.step_time_s
        bounds = [b for b in (lp_s, ws.bound_s) if b is not None]
        bound_s = max(bounds) if bounds else None
        hint = ws.hint if warm_start else None
        extra = {"free": ws.free, "issue": ws.issue, "rebuild": ws.rebuild} if warm_start else None
        base_extra: dict[str, Any] = {
            "lp_bound_s": lp.wall_s,
            "lp_bound_status": lp.status,
            "heuristic_step_time_s": heuristic_time,
            "work_limits": work.as_dict(),
            "warm_start": ws.source,
            "warm_start_step_time_s": warm_time,
            **ws.notes,
        }
        # the phases the wall clock ended (or skipped) rather than their work limits: empty means
        # the same input gives this plan and proof on any machine (milp.md, "Solving")
        clock_stopped = clock.stopped
        for name, note in ws.notes.items():
            if isinstance(note, dict) and note.get("clock_stopped"):
                clock.stop(name)
        if lp.clock_stopped or (anytime and lp.status in ("timeout", "skipped")):
            clock_stopped.insert(0, "lp_bound")
        base_extra["clock_stopped"] = clock_stopped
        base_extra["anytime"] = anytime

        # the backends stop on a gap relative to their objective (the step): the target in
        # those terms, at the warm start's step
        step_gap = (
            proof_tolerance_s(warm_time, ideal, gap_target) / warm_time
            if np.isfinite(warm_time) and warm_time > 0
            else min(gap_target, STEP_FLOOR)
        )
        options = {**options, "gap": step_gap}

        def proven(bound) -> bool:
            return np.isfinite(warm_time) and warm_time > 0 and within(warm_time, bound, gap_target)

        if warm_start and proven(bound_s):
            # the warm start is already within the target of a valid bound: nothing to search
            gap = max(0.0, (warm_time - bound_s) / warm_time)
            info = SolveInfo(
                solver=self.name,
                status="optimal" if within(warm_time, bound_s) else "feasible",
                objective=warm_time,
                bound=min(bound_s, warm_time),
                gap=gap,
                wall_s=time.perf_counter() - start,
                predicted_step_time_s=warm_time,
                extra={"strategy": "warm start proven by the bound", **base_extra},
            )
            return Solution(ws.codes, None, info, simulation=ws.sim)
        if hw.collectives_on_link and g.collectives and not hw.duplex and np.isfinite(warm_time):
            return self._fallback(
                ws,
                bound_s,
                warm_time,
                "feasible",
                start,
                {
                    **base_extra,
                    "reason": "the MILP does not model collectives on a half-duplex "
                    "link; the warm start's plan",
                },
                within,
            )
        if anytime:
            skip_milp = left() < MIN_SEARCH_S + 2 * FORMULATE_S_PER_SLOT * g.n_slots
        else:
            skip_milp = clock.passed(MIN_SEARCH_S)
            if not work.builds(g.n_slots) and np.isfinite(warm_time):
                return self._fallback(
                    ws,
                    bound_s,
                    warm_time,
                    "feasible",
                    start,
                    {**base_extra, "reason": "the MILP's model is too large for the work allowed"},
                    within,
                )
        if skip_milp and np.isfinite(warm_time):
            clock_stopped.append("milp_skipped")
            return self._fallback(
                ws,
                bound_s,
                warm_time,
                "timeout",
                start,
                {**base_extra, "reason": "no time left for the MILP"},
                within,
            )
        f = formulate(
            g,
            hw,
            budget,
            full=full,
            hint=hint,
            extra_candidates=extra,
            fine_time=self.exact_arithmetic,
            mask=problem.mask,
        )
        if warm_start:
            from .hint import complete_hint

            full_hint = complete_hint(f, *ws.hint)
            if full_hint:
                options = {**options, "complete_hint": full_hint}
        size = f.model.size()
        info_extra: dict[str, Any] = {
            "model": size,
            "build_s": time.perf_counter() - start,
            **base_extra,
        }
        if strategy == "auto":
            strategy = "whole" if size["binaries"] <= WHOLE_MODEL_BINARIES else "lp-guided"
        info_extra["strategy"] = strategy
        best = None  # (simulated time, codes, schedule, model objective in seconds)
        status = "timeout"

        def consider(value, obj_units, form: Formulation = f):
            nonlocal best
            try:
                codes, schedule = decode(form, value)
                sim = run_timeline(g, expand(g, codes, schedule, hw), hw, budget)
            except ValueError:
                return None  # an inconsistent solver answer is no solution; the simulator decides

            if sim.fits and (best is None or sim.step_time_s < best[0]):
                best = (sim.step_time_s, codes, schedule, form.seconds(obj_units))
            return sim.step_time_s if sim.fits else None

        # the MILP's work: in the default mode its rounds (two when LP-guided) share it
        rounds_share = 1 if anytime or strategy == "whole" else 2
        options = {
            **options,
            "deterministic_time_s": work.cpsat_dtime(work.milp_s / rounds_share, size["nonzeros"]),
            "max_nodes": work.milp_nodes(work.milp_s / rounds_share),
        }
        clock_runs = clock_stopped  # the same list, in info_extra too

        def run(remaining: float, fixed=None, form: Formulation = f, opts=None):
            """The backend on the model; notes when the clock, not its work limit, stopped it."""
            began = time.perf_counter()
            answer = self.run(form, remaining, seed, workers, opts or options, fixed=fixed)
            status = answer.status
            if (
                status not in (BackendStatus.OPTIMAL, BackendStatus.INFEASIBLE)
                and time.perf_counter() - began >= 0.95 * remaining
            ):
                clock_runs.append(f"{self.name}_round_{len(clock_runs) + 1}")
            elif status is BackendStatus.TIMEOUT:
                # its work limit ended the search, not the clock: "timeout" would say the time
                # limit stopped it (a longer limit, not the same one again, may do better)
                status = BackendStatus.FEASIBLE
            return status.value, answer.value, answer.objective, answer.bound

        if strategy == "whole":
            remaining = max(0.05, left())
            status, value, obj, bound = run(remaining)
            if value is not None:
                consider(value, obj)
            # the best of the valid bounds: the relaxations' and, for a model over every
            # schedule, the MILP's own (less its rounding)
            incumbent = min(warm_time, best[0]) if best is not None else warm_time
            milp_bound = (
                None if bound is None else f.proven_bound_s(bound, incumbent, self.exact_arithmetic)
            )
            if milp_bound is not None:
                info_extra["milp_bound_s"] = milp_bound
            candidates = [b for b in (milp_bound, bound_s) if b is not None]
            bound_s = max(candidates) if candidates else None
            if status != "optimal" and best is not None and within(best[0], bound_s):
                status = "optimal"
        else:
            # first round: free what the LP and the warm start disagree on (the warm start stays
            # a complete feasible hint); then trust the LP alone
            rounds = [(0.999, ws.codes if warm_start else None), (0.999, None)]
            clocked_before = len(clock_runs)
            for threshold, agree in rounds:
                remaining = left()
                if remaining <= (MIN_SEARCH_S if anytime else 0.05):
                    clock_runs.append("milp_rounds_skipped")
                    break
                fixed = lp_fixings(f, lp, threshold, agree) if lp.status == "optimal" else {}
                st, value, obj, _ = run(remaining, fixed=fixed)
                info_extra.setdefault("rounds", []).append(
                    {"threshold": threshold, "fixed_tensors": len(fixed) // 3, "status": st}
                )
                if value is not None:
                    consider(value, obj)
                if best is not None and within(best[0], bound_s, gap_target):
                    break
            # "timeout" only when the clock ended or skipped a round, else the rounds' work did
            clocked = len(clock_runs) > clocked_before
            if best is not None and bound_s is not None and within(best[0], bound_s):
                status = "optimal"
            else:
                status = "timeout" if clocked else "feasible"
        incumbent_s = min(warm_time, best[0]) if best is not None else warm_time
        if full is None and not f.full and not within(incumbent_s, bound_s):
            # the proof round: the model over every schedule position bounds every plan; where
            # it is small enough, it gets the time left, from the best plan so far
            proof = self._proof_round(problem, ws, best, left, work, options, run, consider)
            if proof is not None:
                info_extra["proof_round"] = proof
                if proof.get("bound_s") is not None:
                    bound_s = (
                        proof["bound_s"] if bound_s is None else max(bound_s, proof["bound_s"])
                    )
                if best is not None and within(best[0], bound_s):
                    status = "optimal"
                elif best is None and within(warm_time, bound_s):
                    status = "optimal"  # the warm start, proven (returned by the fallback)
                elif proof.get("clock_stopped"):
                    status = "timeout"
                if proof.get("clock_stopped"):
                    clock.stop("proof_round")
        wall = time.perf_counter() - start
        # relative only: an absolute slack swamps steps of tiny ops (3e-202 s each: a plan 33%
        # slower than the warm start passed 1e-12 s of slack)
        if best is not None and best[0] <= warm_time * (1 + 1e-9):
            # the plan's step time is the simulator's (exact); the model's objective, rounded up
            # per op and copy (milp.md, "Scaling"), is kept as the objective
            predicted, codes, schedule, objective = best
            bound = None if bound_s is None else min(bound_s, predicted)
            gap = (
                None
                if bound is None
                else (max(0.0, (predicted - bound) / predicted) if predicted > 0 else 0.0)
            )
            if status == "optimal" and not within(predicted, bound):
                # "optimal" is a proof against a valid bound, not the model's word: a model over
                # windows, or with rounded-up sizes, is a restriction of the problem
                status = "feasible"
            elif status not in ("optimal", "timeout"):
                status = "feasible"
            info = SolveInfo(
                solver=self.name,
                status=status,
                objective=objective,
                bound=bound,
                gap=gap,
                wall_s=wall,
                predicted_step_time_s=predicted,
                extra=info_extra,
            )
            return Solution(codes, schedule, info)
        # no solution, or none better than the warm start: the warm start's plan, said so
        info_extra.update(
            fallback=ws.source,
            reason="no solution within the time limit"
            if best is None
            else "solver's best was not better than the warm start",
        )
        if status == "infeasible" and np.isfinite(warm_time):
            # the warm start fits, so a plan exists: the backend's "infeasible" is its own
            # failure (tolerances, presolve); the warm start is returned under an honest status
            info_extra["backend_failure"] = (
                f"{self.name} reported the model infeasible, but the warm start is a valid plan"
            )
            log.warning("%s: %s", self.name, info_extra["backend_failure"])
        elif status == "infeasible":
            # nothing fits: with restricted decisions (keep and recompute only) the budget can be
            # below the smallest feasible one, which solve() computes with swaps allowed
            info_extra["reason"] = (
                f"{self.name} proved the model infeasible and no start fits: "
                "no plan within this budget with these decisions"
            )
        return self._fallback(ws, bound_s, warm_time, status, start, info_extra, within)

    def _proof_round(
        self, problem: Problem, ws, best, left, work: WorkLimits, options, run, consider
    ) -> dict[str, Any] | None:
        """The model over every schedule position (formulations/milp.md, "The proof round"),
        hinted with the best plan so far, for the time left; None when it is too large or no
        time is left. Its bound, less its rounding, joins the proof; a better plan it finds is
        considered like any."""
        from .hint import complete_hint

        g, hw = problem.graph, problem.hardware
        if g.n_slots * len(g.saved) > PROOF_CELLS:
            return None
        if left() < (MIN_PROOF_S if work.anytime else 0.05):
            return {"skipped": "no time left", "clock_stopped": True}
        if hw.collectives_on_link and g.collectives:
            return None  # its bound is no proof there (milp.md, "Collectives")
        if best is not None:
            codes, schedule = best[1], best[2]
            index = g.tensor_index
            hint = (
                codes,
                {index[k]: v for k, v in schedule.d2h_free.items()},
                {index[k]: v for k, v in schedule.h2d_issue.items()},
                {index[k]: v for k, v in schedule.recompute_at.items()},
            )
            incumbent = min(best[0], ws.step_time_s)
        else:
            hint, incumbent = ws.hint, ws.step_time_s
        # without the lane-capacity cuts: the proof comes from search here, and their running
        # sums slow it (VGG16 at 80%: closed in 7.7 s without them, 15.4 s with)
        pf = formulate(
            g,
            hw,
            problem.budget_bytes,
            full=True,
            hint=hint,
            mask=problem.mask,
            cuts=False,
            fine_time=self.exact_arithmetic,
        )
        size = pf.model.size()
        if size["nonzeros"] > PROOF_NONZEROS:
            return {"skipped": f"{size['nonzeros']} nonzeros"}
        # its work: CP-SAT's deterministic time, fixed by the work allowed alone
        opts = {
            **options,
            "deterministic_time_s": work.cpsat_dtime(work.proof_s, size["nonzeros"]),
            "max_nodes": work.milp_nodes(work.proof_s),
        }
        completed = complete_hint(pf, *hint)
        if completed:
            opts["complete_hint"] = completed
        else:
            opts.pop("complete_hint", None)
        began, remaining = time.perf_counter(), left()
        status, value, obj, bound = run(remaining, form=pf, opts=opts)
        if value is not None:
            fitted = consider(value, obj, pf)  # its simulated step time, if it fits
            if fitted is not None:
                incumbent = min(incumbent, fitted)
        proven = (
            None if bound is None else pf.proven_bound_s(bound, incumbent, self.exact_arithmetic)
        )
        return {
            "model": size,
            "status": status,
            "bound_s": proven,
            "wall_s": time.perf_counter() - began,
            "clock_stopped": status not in ("optimal", "infeasible")
            and time.perf_counter() - began >= 0.95 * max(remaining, 0.0),
        }

    def _fallback(
        self, ws, bound_s, warm_time, status: str, start: float, extra, within
    ) -> Solution:
        """The warm start's plan, under the status that is true of it."""
        gap = None
        if bound_s is not None and np.isfinite(warm_time):
            bound_s = min(bound_s, warm_time)
            gap = max(0.0, (warm_time - bound_s) / warm_time) if warm_time > 0 else 0.0
        if gap is not None and within(warm_time, bound_s):
            final = "optimal"  # the warm start is itself within the target of a valid bound
        elif status == "timeout":
            final = "timeout"  # the time limit stopped the search
        else:
            final = "feasible"  # the search ended without proving the warm start optimal
        info = SolveInfo(
            solver=self.name,
            status=final,
            objective=warm_time,
            bound=bound_s,
            gap=gap,
            wall_s=time.perf_counter() - start,
            predicted_step_time_s=warm_time,
            extra=extra,
        )
        return Solution(ws.codes, None, info, simulation=ws.sim)
