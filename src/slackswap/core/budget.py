"""Budgets against the step model: the keep-all peak, the smallest feasible budget, parsing."""

from __future__ import annotations

import numpy as np

from .graph import ActivationGraph
from .hardware import Hardware, hardware
from .plan import SWAP, Schedule
from .stepmodel import expand, keep_all_codes
from .units import budget_bytes_from


def keep_all_peak(graph: ActivationGraph, hw: Hardware | str) -> int:
    """Peak activation memory with every saved tensor kept (rules 1-3 of the step model)."""
    hw = hardware(hw)
    return int(expand(graph, keep_all_codes(graph), None, hw).memory().max())


def min_budget(graph: ActivationGraph, hw: Hardware | str) -> int:
    """Smallest budget any plan fits: every saved tensor offloaded, leaving the device right after
    its last forward reader and coming back just before its first backward reader (waiting on the
    copies as long as it takes). Keeping or rebuilding a tensor never needs less memory."""
    hw = hardware(hw)
    codes = np.where(graph.is_saved, SWAP, -1).astype(np.int8)
    names = [t.name for t in graph.tensors]
    saved = graph.saved
    sched = Schedule(
        d2h_free={names[t]: int(graph.last_forward_use[t]) for t in saved},
        h2d_issue={names[t]: graph.bwd_slot(int(graph.first_backward_use[t])) for t in saved},
    )
    return int(expand(graph, codes, sched, hw).memory().max())


def parse_budget(budget: float | int | str, graph: ActivationGraph, hw: Hardware | str) -> int:
    """Budget in bytes (the rule is core/units.py's): a fraction of the keep-all peak, or bytes."""
    return budget_bytes_from(budget, lambda: keep_all_peak(graph, hw))
