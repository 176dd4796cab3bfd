"""The one set of formatters for every table and line the project prints: numbers, durations, markdown tables.

Every figure prints with 2–3 significant digits at most: the machines that produce them are not more precise.
``None`` and non-finite values print as an en dash.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

DASH = "–"


def finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def sig(value: Any, digits: int = 3, suffix: str = "") -> str:
    """A number to ``digits`` significant digits, with thousands separators and no scientific notation."""
    v = finite(value)
    if v is None:
        return DASH
    if v == 0:
        return f"0{suffix}"
    decimals = digits - 1 - math.floor(math.log10(abs(v)))
    if abs(round(v, decimals)) >= 10 ** (digits - decimals):  # 0.9996 rounds up to 1.00: one decimal fewer
        decimals -= 1
    return f"{round(v, decimals):,.{max(0, decimals)}f}{suffix}"


def ratio(value: Any, digits: int = 2) -> str:
    """A ratio as ``0.56×``."""
    return sig(value, digits, "×")


def pct(fraction: Any, digits: int = 2, signed: bool = False) -> str:
    """A fraction as a percentage to ``digits`` significant digits: ``0.873`` → ``87%``."""
    v = finite(fraction)
    if v is None:
        return DASH
    text = sig(100 * v, digits, "%")
    return f"+{text}" if signed and v > 0 else text


def count(n: Any) -> str:
    """A large count with a unit prefix: ``11.2 M``, ``426 B``."""
    v = finite(n)
    if v is None:
        return DASH
    for scale, prefix in ((1e12, " T"), (1e9, " B"), (1e6, " M"), (1e3, " k")):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{prefix}"
    return f"{v:.0f}"


def duration(seconds: Any) -> str:
    """Seconds in the largest fitting unit, three significant digits: ``850 ms``, ``2.5 min``, ``3.1 days``."""
    v = finite(seconds)
    if v is None:
        return DASH
    for limit, scale, unit in ((1, 1e-3, "ms"), (120, 1, "s"), (7200, 60, "min"), (172800, 3600, "h")):
        if v < limit:
            return f"{v / scale:.3g} {unit}"
    return f"{v / 86400:.3g} days"


def usd(value: Any) -> str:
    v = finite(value)
    if v is None:
        return DASH
    return f"${v:,.2f}" if v < 100 else f"${v:,.0f}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A markdown table; ``align`` is one of ``l``/``r``/``c`` per column (default: first left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    marks = {"l": ":--", "r": "--:", "c": ":-:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks[a] for a in align) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |" for cells in rows]
    return "\n".join(lines)
