"""What a budget means, as data: a fraction of the keep-all peak, bytes, or a string.

Pure parsing, no step model: the checker resolves budgets with it and its own keep-all peak.
One rule for the API and the CLI: an int, or a string of digits without a unit, is bytes; a float
in (0, 1] (any numpy real), a string with a decimal point and no unit ("0.5") or a percentage
("50%") is a fraction; a string with a unit ("12GiB", "500 MB") is bytes, and so is a number
above 1 in exponent form ("4e10"). A bare letter ("40G") is refused: GB and GiB differ by 7%.
"smallest" asks for the smallest budget any plan reaches (``SMALLEST``; slackswap.solve).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


SMALLEST = "smallest"
_FORMS = (
    "a fraction in (0, 1] (0.5), a percentage (50%), bytes (an int, 4e10, or a size with a "
    'unit: 12GiB, 500MB), or "smallest"'
)
_LETTERS = {"k": "KB", "m": "MB", "g": "GB", "t": "TB"}


def _bad(budget: object) -> ValueError:
    return ValueError(f"budget: cannot read {budget!r}; use {_FORMS}")


def is_smallest(budget: object) -> bool:
    """Whether ``budget`` asks for the smallest budget any plan reaches."""
    return isinstance(budget, str) and budget.strip().lower() == SMALLEST


def check_budget(budget: object, where: str) -> object:
    """``budget`` as given, once its form is one of the accepted ones (raises ValueError naming
    ``where`` otherwise): what takes a budget and plans later checks it when it is made."""
    if is_smallest(budget):
        return budget
    try:
        budget_bytes_from(budget, lambda: 1)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return budget


def budget_bytes_from(budget: object, keep_all_peak: Callable[[], int]) -> int:
    """Bytes for ``budget``; ``keep_all_peak()`` is called only when it is a fraction."""
    if isinstance(budget, bool):
        raise _bad(budget)
    if isinstance(budget, str):
        text = budget.strip().lower().replace(" ", "")
        if text.endswith("%"):
            try:
                value = float(text[:-1])
            except ValueError:
                raise _bad(budget) from None
            if not math.isfinite(value) or not 0 < value <= 100:
                raise ValueError(f"budget: a percentage must be in (0, 100], got {budget!r}")
            return budget_bytes_from(value / 100.0, keep_all_peak)
        if text == SMALLEST:
            raise ValueError(
                'budget: "smallest" is resolved by the planner (slackswap.solve), not as bytes'
            )
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)([a-z]*)", text)
        if m and m.group(2) in ("k", "m", "g", "t", "ki", "mi", "gi", "ti"):
            unit = m.group(2)
            si, binary = _LETTERS[unit[0]], _LETTERS[unit[0]][0] + "iB"
            raise ValueError(
                f"budget: {budget!r} does not say which unit: write {m.group(1)}{si} "
                f"(10^{3 * (1 + 'kmgt'.index(unit[0]))} bytes) or {m.group(1)}{binary} "
                f"(2^{10 * (1 + 'kmgt'.index(unit[0]))} bytes)"
            )
        if not m or m.group(2) not in _UNITS:
            raise _bad(budget)
        number, unit = m.group(1), m.group(2)
        if unit == "" and "e" in number and float(number) > 1:
            value = float(number)  # bytes in exponent form: 4e10
            if not math.isfinite(value) or value != int(value):
                raise _bad(budget)
            return budget_bytes_from(int(value), keep_all_peak)
        if unit == "" and ("." in number or "e" in number):
            return budget_bytes_from(float(number), keep_all_peak)
        value = float(number) * _UNITS[unit]
        if not math.isfinite(value):
            raise _bad(budget)
        return budget_bytes_from(int(value), keep_all_peak)
    if isinstance(budget, numbers.Integral):
        if budget < 0:
            raise ValueError(f"budget: bytes must be >= 0, got {budget}")
        return int(budget)
    if isinstance(budget, numbers.Real):
        value = float(budget)
        if not math.isfinite(value) or not 0 < value <= 1:
            raise ValueError(
                f"budget: a fraction must be in (0, 1], got {budget!r}; pass bytes "
                "as an int or a string like '12GiB'"
            )
        return int(value * keep_all_peak())
    raise _bad(budget)
