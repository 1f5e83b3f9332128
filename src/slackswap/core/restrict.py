"""Restricted decisions: which of keep / swap / recompute each saved tensor may take.

``allowed`` (any non-empty subset of the three, for every tensor) and ``pins`` (one decision for
a named tensor) become one mask, a row of three booleans per tensor in decision-code order, that
every planner and the LP bound honour; the plan records both, and the checker verifies them from
the plan alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from .errors import PlanError
from .graph import ActivationGraph
from .plan import KEEP, RECOMPUTE, SWAP

DECISIONS = ("keep", "swap", "recompute")
CODE = {"keep": KEEP, "swap": SWAP, "recompute": RECOMPUTE}


def parse_allowed(allowed: Iterable[str] | str | None) -> tuple[str, ...]:
    """The allowed decisions as a tuple in canonical order; a string may list them with commas."""
    if allowed is None:
        return DECISIONS
    if isinstance(allowed, str):
        allowed = [a.strip() for a in allowed.split(",") if a.strip()]
    try:
        chosen = set(allowed)
    except TypeError:
        raise ValueError(
            f"allowed: expected decisions among {DECISIONS}, got {allowed!r}"
        ) from None
    unknown = sorted(str(a) for a in chosen - set(DECISIONS))
    if unknown:
        raise ValueError(
            f"allowed: unknown decision(s) {', '.join(map(repr, unknown))}; "
            f"choose among {', '.join(DECISIONS)}"
        )
    if not chosen:
        raise ValueError("allowed: at least one of keep, swap, recompute must be allowed")
    return tuple(d for d in DECISIONS if d in chosen)


def decision_mask(
    graph: ActivationGraph,
    allowed: Iterable[str] | str | None = None,
    pins: Mapping[str, str] | None = None,
    min_swap_bytes: int = 0,
) -> np.ndarray:
    """(tensors x 3) booleans: may tensor t take decision code c. Recompute only where the graph
    allows a rebuild, and for an RNG group only if every member may; swap only for tensors of at
    least ``min_swap_bytes`` (the hardware's). Raises on a pin that names no saved tensor, an
    unknown decision, or a pin the graph, ``allowed`` or the hardware forbids."""
    kinds = parse_allowed(allowed)
    mask = np.zeros((len(graph.tensors), 3), dtype=bool)
    saved = graph.saved
    for d in kinds:
        mask[saved, CODE[d]] = True
    mask[:, RECOMPUTE] &= graph.can_recompute
    mask[graph.tensor_bytes < min_swap_bytes, SWAP] = False
    if pins is not None:
        if not isinstance(pins, Mapping):
            raise ValueError(
                f"pins: expected a mapping of tensor name to decision, got {type(pins).__name__}"
            )
        index = graph.tensor_index
        for name, decision in pins.items():
            t = index.get(name)
            if t is None or not graph.is_saved[t]:
                raise PlanError(
                    f"pins: tensor {name!r} is not a saved tensor of graph {graph.name!r}"
                )
            if decision not in CODE:
                raise PlanError(
                    f"pins: tensor {name!r} pinned to {decision!r}; expected one of "
                    f"{', '.join(DECISIONS)}"
                )
            if decision not in kinds:
                raise PlanError(
                    f"pins: tensor {name!r} pinned to {decision!r}, which allowed={kinds} forbids"
                )
            if decision == "swap" and graph.tensor_bytes[t] < min_swap_bytes:
                raise PlanError(
                    f"pins: tensor {name!r} ({int(graph.tensor_bytes[t])} bytes) is "
                    f"pinned to swap, but the hardware swaps no tensor under "
                    f"{min_swap_bytes} bytes (min_swap_bytes)"
                )
            if decision == "recompute" and not graph.can_recompute[t]:
                raise PlanError(
                    f"pins: tensor {name!r} cannot be recomputed: {graph.recompute_blocker(t)}"
                )
            row = np.zeros(3, dtype=bool)
            row[CODE[decision]] = True
            mask[t] = row
    for group, members in graph.rng_groups.items():
        together = bool(mask[list(members), RECOMPUTE].all())
        mask[list(members), RECOMPUTE] = together
        stuck = [graph.tensors[m].name for m in members if not mask[m].any()]
        if stuck:
            raise PlanError(
                f"pins: tensor {stuck[0]!r} is pinned to recompute, but RNG group "
                f"{group!r} cannot be recomputed together"
            )
    empty = [graph.tensors[int(t)].name for t in saved if not mask[t].any()]
    if empty:
        raise PlanError(
            f"allowed={kinds}: tensor {empty[0]!r} has no decision left (it cannot "
            "be recomputed"
            + (
                f", and it is under the hardware's min_swap_bytes ({min_swap_bytes})"
                if min_swap_bytes
                else ""
            )
            + ")"
        )
    return mask


def first_forbidden(
    graph: ActivationGraph, codes: np.ndarray, mask: np.ndarray | None
) -> str | None:
    """The first saved tensor whose decision the mask forbids, in words, or None."""
    if mask is None:
        return None
    for t in graph.saved:
        c = int(codes[t])
        if not mask[t, c]:
            return f"tensor {graph.tensors[int(t)].name!r} got {DECISIONS[c]!r}"
    return None


def restricted(mask: np.ndarray | None, graph: ActivationGraph) -> bool:
    """Whether the mask forbids anything the graph itself allows."""
    if mask is None:
        return False
    full = np.zeros_like(mask)
    full[graph.saved, KEEP] = full[graph.saved, SWAP] = True
    full[:, RECOMPUTE] = graph.can_recompute & graph.is_saved
    return bool((full & ~mask).any())
