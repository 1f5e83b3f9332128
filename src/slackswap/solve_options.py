"""What solve() takes, checked before any planner runs: its options (a switch is a bool, a count
an integer), its time limit, and the restrictions (``allowed``, ``pins``, the hardware's own)
as a decision mask. A bad value is refused here by name, never passed to a solver.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from .core.errors import PlanError
from .core.graph import ActivationGraph
from .core.hardware import Hardware
from .core.restrict import decision_mask, parse_allowed


def restriction_mask(graph: ActivationGraph, hw: Hardware, allowed, pins) -> np.ndarray | None:
    """The decisions each tensor may take under ``allowed``, ``pins`` and the hardware's
    ``min_swap_bytes``; None where nothing is restricted."""
    saved_bytes = graph.tensor_bytes[graph.saved]
    small = hw.min_swap_bytes > 0 and bool((saved_bytes < hw.min_swap_bytes).any())
    if allowed is None and not pins and not small:
        return None
    return decision_mask(graph, allowed, pins, hw.min_swap_bytes)


def host_allowed(hw: Hardware, allowed) -> tuple[Any, bool]:
    """The decisions to allow on ``hw`` and whether the hardware, not the caller, chose them: a
    device whose memory is the host's has no host to swap to, so plans there keep or recompute
    (a swap would copy within the same memory on the compute thread and free nothing)."""
    if not hw.host_is_device:
        return allowed, False
    if allowed is None:
        return ("keep", "recompute"), True
    if "swap" in parse_allowed(allowed):
        raise PlanError(
            f"allowed={parse_allowed(allowed)}: hardware {hw.name!r} has no host to "
            "swap to (its device memory is host memory, a swap frees nothing); "
            "allow keep and recompute only, or plan for another hardware"
        )
    return allowed, False


# the planners' on/off options (``full`` may also be None: the planner decides)
BOOLEAN_OPTIONS = (
    "warm_start",
    "polish",
    "coarse",
    "departure",
    "full",
    "bundle_reruns",
    "unfit_polish",
    "log",
    "anytime",
)
STRATEGIES = ("auto", "whole", "lp-guided")  # the exact planners' (planners/exact/strategy.py)


def check_options(options: Mapping[str, Any]) -> None:
    """A switch is True or False, a count an integer, a gap a number: a truthy string like
    "False" would otherwise turn an option on, and a string seed fail deep in the solver."""
    for name in BOOLEAN_OPTIONS:
        if name in options:
            value = options[name]
            if not isinstance(value, (bool, np.bool_)) and not (name == "full" and value is None):
                raise TypeError(f"solve: option {name} must be True or False, got {value!r}")
    for name, least in (("seed", 0), ("workers", 1), ("linearization_level", 0)):
        if name in options:
            value = options[name]
            if (
                isinstance(value, (bool, np.bool_))
                or not isinstance(value, numbers.Integral)
                or value < least
            ):
                raise TypeError(
                    f"solve: option {name} must be an integer >= {least}, got {value!r}"
                )
    if "gap" in options:
        value = options["gap"]
        if (
            isinstance(value, (bool, np.bool_))
            or not isinstance(value, numbers.Real)
            or not math.isfinite(value)
            or value < 0
        ):
            raise ValueError(f"solve: option gap must be a finite number >= 0, got {value!r}")
    if options.get("work_s") is not None:
        value = options["work_s"]
        if (
            isinstance(value, (bool, np.bool_))
            or not isinstance(value, numbers.Real)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ValueError(
                f"solve: option work_s must be a finite number of seconds > 0, got {value!r}"
            )
    if "strategy" in options and options["strategy"] not in STRATEGIES:
        raise ValueError(
            f"solve: option strategy must be one of {', '.join(STRATEGIES)}, got "
            f"{options['strategy']!r}"
        )


def check_time_limit(time_limit_s: float | None) -> float | None:
    """None (the planner's default) or a finite number of seconds >= 0."""
    if time_limit_s is None:
        return None
    if (
        isinstance(time_limit_s, bool)
        or not isinstance(time_limit_s, numbers.Real)
        or not math.isfinite(time_limit_s)
        or time_limit_s < 0
    ):
        raise ValueError(
            f"time_limit_s must be a finite number of seconds >= 0, got {time_limit_s!r}"
        )
    return float(time_limit_s)
