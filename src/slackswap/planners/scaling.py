"""How each model of the planners scales bytes and seconds to its units, in one place: the
MILP's integers (formulations/milp.md, "Scaling and rounding": ``Scaling``, ``scaling_for``),
the LP bound's floating point (lp-bound.md, "Scaling": ``lp_units``, ``relax_small``) and the
departure bound's integers (departure-bound.md, "Units": ``departure_units``). Each rounds the
way that keeps its model what it claims: a restriction whose plans fit, or a relaxation whose
optimum is a bound."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..core.graph import ActivationGraph
    from ..core.hardware import Hardware

# --- the MILP: integers ---
BYTE_RANGE = 10**6  # model units for the largest of the budget and the sizes, at most
# the same for a backend in exact integer arithmetic (CP-SAT): a byte unit that rounds each size
# by at most a billionth of the budget, so a plan at the budget's edge stays in the model
BYTE_RANGE_EXACT = 10**9
TIME_RANGE = 10**7  # model time units in the step plus every copy (Section "Scaling")
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


def scaling_for(
    graph: ActivationGraph, hw: Hardware, budget_bytes: int, full: bool, exact_arithmetic: bool
) -> Scaling:
    """Integers for the model (Section "Scaling"): the largest byte unit that divides every
    size (memory sums exact, only the budget rounded), at most BYTE_RANGE units for the largest
    of the budget and the sizes (BYTE_RANGE_EXACT with ``exact_arithmetic``); time in
    TIME_RANGE units of the step plus every copy (TIME_RANGE_FULL over every position with
    ``exact_arithmetic``)."""
    copies = sum(hw.d2h_time(b) + hw.h2d_time(b) for b in graph.tensor_bytes[graph.saved])
    if hw.collectives_on_link:
        copies += sum(
            hw.d2h_time(c.d2h_bytes) + hw.h2d_time(c.h2d_bytes) for c in graph.collectives
        )
    span = graph.ideal_step_time_s + copies
    sizes = np.concatenate(
        [graph.tensor_bytes, graph.forward_ws, graph.backward_ws, graph.rerun_ws]
    )
    unit = max(1, int(np.gcd.reduce(sizes[sizes > 0])) if (sizes > 0).any() else 1)
    # every backend sees coefficients of like magnitude. Sizes are then rounded: over windows up
    # (the model never under-counts memory, its plans fit, its bound proves nothing); over every
    # schedule position down, the budget up (a relaxation: its bound is a proof, and a plan that
    # fits only by the rounding is refused by the simulator)
    largest = int(max(budget_bytes, int(sizes.max()) if sizes.size else 0, 1))
    byte_range = BYTE_RANGE_EXACT if exact_arithmetic else BYTE_RANGE
    exact = largest // unit <= byte_range
    if not exact:
        unit = -(-largest // byte_range)
    return Scaling(
        byte_unit=unit,
        time_unit=max(span, 1e-12) / (TIME_RANGE_FULL if full and exact_arithmetic else TIME_RANGE),
        exact_bytes=exact,
        relaxed_bytes=bool(full) and not exact,
    )


# --- the LP bound: floating point, both the budget and the ideal step about MODEL_SCALE units
# (HiGHS's tolerances are absolute, and raw bytes beside seconds lose feasible points) ---
MODEL_SCALE = 1000.0
SMALLEST = 1e-6  # model units: smaller coefficients are rounded in the relaxing direction


def lp_units(graph: ActivationGraph, hw: Hardware, budget_bytes: int) -> tuple[float, float]:
    """The LP bound's byte unit and time unit: the larger of the budget and the largest tensor,
    and the ideal step, each MODEL_SCALE units. A step of no time or of denormal seconds: the
    copies set the time unit, never one so small that a copy's or a collective's seconds
    overflow to inf in units."""
    saved_bytes = float(graph.tensor_bytes[graph.saved].sum())
    copy_s = saved_bytes / min(hw.d2h_bytes_per_s, hw.h2d_bytes_per_s) + hw.latency_s * len(
        graph.saved
    )
    bu = max(budget_bytes, int(graph.tensor_bytes.max(initial=0)), 1) / MODEL_SCALE
    ideal_s = graph.ideal_step_time_s
    tu = (ideal_s if ideal_s >= 1e-12 else max(copy_s, 1e-12)) / MODEL_SCALE
    return bu, tu


def relax_small(values: np.ndarray) -> np.ndarray:
    """Sizes and durations below SMALLEST units become 0: less memory and less time relax the
    model, so its optimum stays a lower bound on every plan's step time."""
    return np.where(values < SMALLEST, 0.0, values)


# --- the departure bound: integers ---
DEPARTURE_TIME_RANGE = 1e7  # time unit: (ideal step + every copy) / DEPARTURE_TIME_RANGE
# byte unit: the larger of the budget and the largest tensor / DEPARTURE_BYTE_RANGE
DEPARTURE_BYTE_RANGE = 1e6


def departure_units(graph: ActivationGraph, hw: Hardware, budget_bytes: int) -> tuple[float, int]:
    """The departure bound's time unit (seconds) and byte unit (bytes)."""
    nbytes = graph.tensor_bytes
    copies = sum(hw.d2h_time(int(nbytes[t])) for t in graph.saved)
    tu = (graph.ideal_step_time_s + copies) / DEPARTURE_TIME_RANGE
    bu = max(1, math.ceil(max(budget_bytes, int(nbytes.max(initial=1))) / DEPARTURE_BYTE_RANGE))
    return tu, bu
