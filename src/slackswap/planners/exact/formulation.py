"""The MILP's data (formulations/milp.md): the Formulation, the model with its variables by
tensor and position and the scaling it was built with (planners/scaling.py, Section "Scaling"),
which the backends solve and decode.py reads back."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...core.graph import ActivationGraph
from ...core.hardware import Hardware
from ..scaling import Scaling
from .model import Model


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
