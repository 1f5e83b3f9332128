"""Running sums over positions: one variable per position equal to the sum of the intervals
that cover it (memory_running_sum), a row per position rather than one per interval and
position."""

from __future__ import annotations

from .model import Model


def running_sum(
    m: Model, name: str, S: int, starts, ends, ub: int, constraint: str | None = None
) -> list[int]:
    """Variables V_k = sum of coef*x over the intervals covering position k."""
    out: list[int] = []
    for k in range(S):
        v = m.var(f"{name}[{k}]", 0, ub)
        terms = [(v, 1)]
        if k:
            terms.append((out[k - 1], -1))
        terms += [(w, -b) for w, b in starts.get(k, ())]
        terms += [(w, b) for w, b in ends.get(k - 1, ())]
        m.eq(f"{constraint or name + '_running_sum'}[{k}]", terms, 0)
        out.append(v)
    return out
