"""Decision codes: a plan's decisions as one small integer per tensor (KEEP, SWAP, RECOMPUTE;
UNSAVED for a tensor no backward reads), the form every planner, the step model and the
simulator compute on. Decisions are checked on the way in: every saved tensor has one, a
recomputed tensor can be recomputed, an RNG group is recomputed whole.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .errors import PlanError
from .graph import ActivationGraph
from .plan import DECISIONS, KEEP, RECOMPUTE, UNSAVED, Plan


def keep_all_codes(graph: ActivationGraph) -> np.ndarray:
    """Decision codes with every saved tensor kept (UNSAVED for the others)."""
    return np.where(graph.is_saved, KEEP, UNSAVED).astype(np.int8)


def decision_codes(graph: ActivationGraph, decisions: Mapping[str, str] | Plan) -> np.ndarray:
    """Decision code per tensor (-1 for tensors not saved); refuses incomplete or wrong decisions."""
    if isinstance(decisions, Plan):
        decisions = decisions.decisions
    codes = np.full(len(graph.tensors), UNSAVED, dtype=np.int8)
    index = graph.tensor_index
    for name, decision in decisions.items():
        if name not in index:
            raise PlanError(f"plan: tensor {name!r} is not in graph {graph.name!r}")
        t = index[name]
        if not graph.is_saved[t]:
            raise PlanError(
                f"plan: tensor {name!r} is not saved for backward; it takes no decision"
            )
        if decision not in DECISIONS:
            raise PlanError(
                f"plan: tensor {name!r} has decision {decision!r}; expected one of {DECISIONS}"
            )
        codes[t] = DECISIONS.index(decision)
    missing = [graph.tensors[t].name for t in graph.saved if codes[t] == UNSAVED]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise PlanError(
            f"plan: no decision for saved tensor(s) {', '.join(map(repr, missing[:3]))}{more}"
        )
    bad = np.flatnonzero((codes == RECOMPUTE) & ~graph.can_recompute)
    if bad.size:
        t = int(bad[0])
        raise PlanError(
            f"plan: tensor {graph.tensors[t].name!r} cannot be recomputed: "
            f"{graph.recompute_blocker(t)}"
        )
    for g, members in graph.rng_groups.items():
        if len({bool(codes[t] == RECOMPUTE) for t in members}) > 1:
            raise PlanError(
                f"plan: tensors of group {g!r} must be recomputed all together or not at all"
            )
    return codes


def codes_to_decisions(graph: ActivationGraph, codes: np.ndarray) -> dict[str, str]:
    """The plan's decisions (tensor name -> keep|swap|recompute) from decision codes."""
    return {graph.tensors[t].name: DECISIONS[int(codes[t])] for t in graph.saved}
