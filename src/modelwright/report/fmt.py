"""The one set of formatters for every table and line the project prints: numbers, durations, markdown tables.
Figures get 2–3 significant digits (the machines are not more precise); ``None``, bools and non-finite values a dash.
"""

import math
from collections.abc import Sequence
from typing import Any

DASH = "–"  # every formatter's figure for what is missing: None, a bool, NaN or infinity


def finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def sig(value: Any, digits: int = 3, suffix: str = "") -> str:
    """A number to ``digits`` significant digits, with thousands separators and no scientific notation."""
    if (v := finite(value)) is None or v == 0:
        return DASH if v is None else f"0{suffix}"
    decimals = digits - 1 - math.floor(math.log10(abs(v)))
    if abs(round(v, decimals)) >= 10 ** (digits - decimals):  # 0.9996 rounds up to 1.00: one decimal fewer
        decimals -= 1
    return f"{round(v, decimals):,.{max(0, decimals)}f}{suffix}"


def ratio(value: Any, digits: int = 2) -> str:
    """A ratio as ``0.56×``."""
    return sig(value, digits, "×")


def pct(fraction: Any, digits: int = 2, signed: bool = False) -> str:
    """A fraction as a percentage to ``digits`` significant digits: ``0.873`` → ``87%``."""
    f = finite(fraction)
    return DASH if f is None else ("+" if signed and f > 0 else "") + sig(100 * f, digits, "%")


def count(n: Any) -> str:
    """A large count with a unit prefix: ``11.2 M``, ``426 B``."""
    if (n := finite(n)) is None:
        return DASH
    units = ((1e12, " T"), (1e9, " B"), (1e6, " M"), (1e3, " k"))
    return next((f"{n / scale:.3g}{prefix}" for scale, prefix in units if abs(n) >= scale), f"{n:.0f}")


def duration(seconds: Any) -> str:
    """Seconds in the largest fitting unit, three significant digits: ``850 ms``, ``2.5 min``, ``3.1 days``."""
    if (seconds := finite(seconds)) is None:
        return DASH
    units = ((1, 1e-3, "ms"), (120, 1, "s"), (7200, 60, "min"), (172800, 3600, "h"), (math.inf, 86400, "days"))
    return next(f"{seconds / scale:.3g} {unit}" for limit, scale, unit in units if seconds < limit)


def usd(value: Any) -> str:
    """Dollars: cents below $100, whole dollars above."""
    v = finite(value)
    return DASH if v is None else f"${v:,.2f}" if v < 100 else f"${v:,.0f}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A markdown table; ``align`` is one of ``l``/``r``/``c`` per column (default: first left, the rest right)."""
    marks = {"l": ":--", "r": "--:", "c": ":-:"}
    align = align or "l" + "r" * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks[a] for a in align) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |" for cells in rows]
    return "\n".join(lines)
