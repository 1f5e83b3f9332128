"""Budgets: fractions of the keep-all peak, byte counts, or strings such as "12GiB"."""

from __future__ import annotations

import math
import re

import numpy as np

from .graph import ActivationGraph
from .hardware import Hardware, hardware
from .plan import KEEP, SWAP, Schedule
from .stepmodel import expand

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def keep_all_peak(graph: ActivationGraph, hw: Hardware | str) -> int:
    """Peak activation memory with every saved tensor kept (rules 1-3 of the step model)."""
    hw = hardware(hw)
    codes = np.where(graph.is_saved, KEEP, -1).astype(np.int8)
    return int(expand(graph, codes, None, hw).memory().max())


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


def parse_budget(budget: float | int | str, graph: ActivationGraph, hw: Hardware) -> int:
    """Budget in bytes. A float in (0, 1] (or "50%") is a fraction of the keep-all peak; an int
    or a string with a unit ("12GiB", "500 MB") is bytes."""
    if isinstance(budget, bool):
        raise ValueError(f"budget: expected a fraction, bytes or a string like '12GiB', got {budget!r}")
    if isinstance(budget, str):
        text = budget.strip().lower().replace(" ", "")
        if text.endswith("%"):
            try:
                return parse_budget(float(text[:-1]) / 100.0, graph, hw)
            except ValueError:
                raise ValueError(f"budget: cannot read {budget!r}") from None
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)([a-z]*)", text)
        if not m or m.group(2) not in _UNITS:
            raise ValueError(f"budget: cannot read {budget!r}; use a fraction (0.5), a percentage "
                             "(50%) or bytes with a unit (12GiB, 500MB)")
        value = float(m.group(1))
        if m.group(2) == "" and value <= 1.0 and "." in m.group(1):
            return parse_budget(value, graph, hw)
        return parse_budget(int(value * _UNITS[m.group(2)]), graph, hw)
    if isinstance(budget, (int, np.integer)):
        if budget <= 0:
            raise ValueError(f"budget: bytes must be > 0, got {budget}")
        return int(budget)
    if isinstance(budget, float):
        if math.isnan(budget) or not 0 < budget <= 1:
            raise ValueError(f"budget: a fraction must be in (0, 1], got {budget!r}; pass bytes "
                             "as an int or a string like '12GiB'")
        return int(budget * keep_all_peak(graph, hw))
    raise ValueError(f"budget: expected a fraction, bytes or a string like '12GiB', got {budget!r}")
