"""Budgets against the step model: the keep-all peak, the smallest feasible budget, parsing."""

from __future__ import annotations

import numpy as np

from .codes import keep_all_codes
from .graph import ActivationGraph
from .hardware import Hardware, hardware
from .plan import KEEP, RECOMPUTE, SWAP
from .schedule_rules import HookPositions
from .stepmodel import expand, expand_positions
from .units import budget_bytes_from


def keep_all_peak(graph: ActivationGraph, hw: Hardware | str) -> int:
    """Peak activation memory with every saved tensor kept (rules 1-3 of the step model).

    Args:
        graph: the step.
        hw: the hardware (or its preset name).

    Returns:
        The peak bytes of keeping every saved tensor: the budget a fraction refers to.
    """
    hw = hardware(hw)
    return int(expand(graph, keep_all_codes(graph), None, hw).memory().max())


def offload_floor(
    graph: ActivationGraph, hw: Hardware | str, mask: np.ndarray | None = None
) -> int:
    """No plan fits less: every saved tensor offloaded, leaving the device right after its last
    forward reader (at the first hook position after it) and coming back just before its first backward reader (waiting on the copies
    as long as it takes); keeping or rebuilding a tensor never needs less memory. ``mask``
    (core/restrict.py): tensors that may only be kept are kept. Where every other tensor may be
    offloaded a plan fits it (it is the smallest budget); where some may only be kept or
    recomputed it is a lower bound (planners/minpeak.py finds the minimum)."""
    hw = hardware(hw)
    codes = np.where(graph.is_saved, SWAP, -1).astype(np.int8)
    if mask is not None:
        saved = graph.saved
        only_keep = saved[mask[saved, KEEP] & ~mask[saved, SWAP] & ~mask[saved, RECOMPUTE]]
        codes[only_keep] = KEEP
    saved = graph.saved
    d2h = np.full(len(graph.tensors), -1, dtype=np.int64)
    h2d = np.full(len(graph.tensors), -1, dtype=np.int64)
    # the first position after its last forward reader where a hook runs (step-model.md, "Hook
    # positions"; the reader itself on an analytic graph)
    d2h[saved] = HookPositions(graph).free_later(graph.last_forward_use[saved])
    h2d[saved] = 2 * graph.n_ops - 1 - graph.first_backward_use[saved]  # its backward position
    d2h[codes != SWAP] = -1
    h2d[codes != SWAP] = -1
    rec = np.full(len(graph.tensors), -1, dtype=np.int64)
    return int(expand_positions(graph, codes, d2h, h2d, rec, hw).memory().max())


def min_budget(graph: ActivationGraph, hw: Hardware | str) -> int:
    """The smallest budget with every decision allowed (``offload_floor`` without a mask). With
    restrictions (allowed=, pins=, a CPU device) use ``slackswap.min_budget``."""
    return offload_floor(graph, hw)


def parse_budget(budget: float | int | str, graph: ActivationGraph, hw: Hardware | str) -> int:
    """Budget in bytes (the rule is core/units.py's): a fraction of the keep-all peak, or bytes.

    Args:
        budget: a fraction of the keep-all peak in (0, 1], bytes (int), or a string ("12GiB",
            "50%").
        graph: the step whose keep-all peak a fraction refers to.
        hw: the hardware.

    Returns:
        The budget in bytes.

    Raises:
        ValueError: a budget that is not one of those forms, or not positive.
    """
    return budget_bytes_from(budget, lambda: keep_all_peak(graph, hw))
