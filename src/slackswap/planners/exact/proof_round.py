"""The proof round (formulations/milp.md, "The proof round"): where the search left its plan
unproven, the model over every schedule position, small graphs only, bounds every plan. A phase
of strategy.py."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ...core.status import Status
from ..limits import MIN_PROOF_S, PROOF_CELLS, PROOF_NONZEROS
from .formulate import formulate

if TYPE_CHECKING:
    from .strategy import SolveState


def prove(state: SolveState) -> None:
    """The proof round where the plan is not yet proven: the model over every schedule position
    bounds every plan; where it is small enough, it gets the time left, from the best plan so
    far."""
    best, warm_time = state.best, state.warm_time
    incumbent_s = min(warm_time, best.step_time_s) if best is not None else warm_time
    assert state.model is not None
    if state.settings.full is not None or state.model.full:
        return
    if state.within(incumbent_s, state.bound_s):
        return
    proof = _proof_round(state)
    if proof is None:
        return
    state.info_extra["proof_round"] = proof
    if proof.get("bound_s") is not None:
        bound_s = state.bound_s
        state.bound_s = proof["bound_s"] if bound_s is None else max(bound_s, proof["bound_s"])
    best = state.best
    if best is not None and state.within(best.step_time_s, state.bound_s):
        state.status = Status.OPTIMAL
    elif best is None and state.within(warm_time, state.bound_s):
        state.status = Status.OPTIMAL  # the warm start, proven (returned by the fallback)
    elif proof.get("clock_stopped"):
        state.status = Status.TIMEOUT
    if proof.get("clock_stopped"):
        state.clock.stop("proof_round")


def _proof_round(state: SolveState) -> dict[str, Any] | None:
    """The model over every schedule position (formulations/milp.md, "The proof round"), hinted
    with the best plan so far, for the time left; None when it is too large or not asked for.
    Its bound, less its rounding, joins the proof; a better plan it finds is considered like
    any."""
    from .hint import complete_hint

    problem, work, ws, best = state.problem, state.work, state.ws, state.best
    g, hw = problem.graph, problem.hardware
    if g.n_positions * len(g.saved) > PROOF_CELLS:
        return None
    if state.left() < (MIN_PROOF_S if work.anytime else 0.05):
        return {Status.SKIPPED: "no time left", "clock_stopped": True}
    if hw.collectives_on_link and g.collectives:
        return None  # its bound is no proof there (milp.md, "Collectives")
    if best is not None:
        index, schedule = g.tensor_index, best.schedule
        hint = (
            best.codes,
            {index[k]: v for k, v in schedule.d2h_free.items()},
            {index[k]: v for k, v in schedule.h2d_issue.items()},
            {index[k]: v for k, v in schedule.recompute_at.items()},
        )
        incumbent = min(best.step_time_s, ws.step_time_s)
    else:
        hint, incumbent = ws.hint, ws.step_time_s
    # without the lane-capacity cuts: the proof comes from search here, and their running sums
    # slow it (milp.md, "The proof round")
    exact = state.backend.exact_arithmetic
    pf = formulate(
        g,
        hw,
        problem.budget_bytes,
        full=True,
        hint=hint,
        mask=problem.mask,
        cuts=False,
        exact_arithmetic=exact,
    )
    size = pf.model.size()
    if size["nonzeros"] > PROOF_NONZEROS:
        return {Status.SKIPPED: f"{size['nonzeros']} nonzeros"}
    limit = state.backend.work_limit
    if limit == "deterministic_time" and not work.cpsat_round_runs(work.proof_s, size["nonzeros"]):
        # its size alone costs more than its work: CP-SAT's floor would run it for nothing
        # (VGG19 at 80% with swaps, 195,702 nonzeros against 2 s: 1.8-2.6 s, no bound)
        return {Status.SKIPPED: f"{size['nonzeros']} nonzeros for {work.proof_s:g} s of work"}
    # its work, fixed by the work allowed alone (the backend's own limit)
    options = {
        **state.options,
        **work.backend_options(limit, work.proof_s, size["nonzeros"]),
    }
    completed = complete_hint(pf, *hint) if state.backend.takes_complete_hint else None
    if completed:
        options["complete_hint"] = completed
    else:
        options.pop("complete_hint", None)
    began, remaining = time.perf_counter(), state.left()
    status, value, obj, bound = state.run_backend(remaining, pf, options=options)
    if value is not None:
        fitted = state.consider(value, obj, pf)  # its simulated step time, if it fits
        if fitted is not None:
            incumbent = min(incumbent, fitted)
    proven = None if bound is None else pf.proven_bound_s(bound, incumbent, exact)
    return {
        "model": size,
        "status": status,
        "bound_s": proven,
        "wall_s": time.perf_counter() - began,
        "clock_stopped": status not in (Status.OPTIMAL, Status.INFEASIBLE)
        and time.perf_counter() - began >= 0.95 * max(remaining, 0.0),
    }
