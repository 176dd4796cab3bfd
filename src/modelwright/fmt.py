"""The one set of formatters for every table and line the project prints: numbers, durations, markdown
tables. Figures get 2–3 significant digits (the machines are not more precise); ``None``, bools and non-finite
values a dash.
"""

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

DASH = "–"


def finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _dash_if_missing(fmt: Callable[..., str]) -> Callable[..., str]:
    # One place decides what a missing figure looks like; each formatter below sees a finite float only.
    @functools.wraps(fmt)
    def wrapper(value: Any, *args: Any, **kwargs: Any) -> str:
        number = finite(value)
        return DASH if number is None else fmt(number, *args, **kwargs)

    return wrapper


@_dash_if_missing
def sig(value: float, digits: int = 3, suffix: str = "") -> str:
    """A number to ``digits`` significant digits, with thousands separators and no scientific notation."""
    if value == 0:
        return f"0{suffix}"
    decimals = digits - 1 - math.floor(math.log10(abs(value)))
    # 0.9996 rounds up to 1.00: one decimal fewer.
    if abs(round(value, decimals)) >= 10 ** (digits - decimals):
        decimals -= 1
    return f"{round(value, decimals):,.{max(0, decimals)}f}{suffix}"


def ratio(value: Any, digits: int = 2) -> str:
    """A ratio as ``0.56×``; near 1 (but not 1) one digit more, ``1.04×``, so that a change the verdict calls
    slower or faster does not read as ``1.0×``."""
    number = finite(value)
    if number is not None and number != 1 and 0.995 <= number < 1.05:  # what two digits would show as 1.0
        digits += 1
    return sig(value, digits, "×")


@_dash_if_missing
def pct(fraction: float, digits: int = 2, signed: bool = False) -> str:
    """A fraction as a percentage to ``digits`` significant digits: ``0.873`` → ``87%``."""
    return ("+" if signed and fraction > 0 else "") + sig(100 * fraction, digits, "%")


@_dash_if_missing
def count(n: float) -> str:
    """A large count with a unit prefix: ``11.2 M``, ``426 B``."""
    units = ((1e12, " T"), (1e9, " B"), (1e6, " M"), (1e3, " k"))
    return next((f"{n / scale:.3g}{prefix}" for scale, prefix in units if abs(n) >= scale), f"{n:.0f}")


@_dash_if_missing
def flop_count(flops: float) -> str:
    """FLOPs with an SI prefix and the unit, three significant digits: ``426 GFLOP``, ``1.2 MFLOP``."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(flops) >= scale:
            return f"{flops / scale:.3g} {prefix}FLOP"
    return f"{flops:.0f} FLOP"


@_dash_if_missing
def duration(seconds: float) -> str:
    """Seconds in the largest fitting unit, three significant digits: ``850 ms``, ``2.5 min``, ``3.1
    days``."""
    # (below this many seconds, seconds per unit, unit)
    units = ((1, 1e-3, "ms"), (120, 1, "s"), (7200, 60, "min"), (172800, 3600, "h"),
             (math.inf, 86400, "days"))
    return next(f"{seconds / scale:.3g} {unit}" for limit, scale, unit in units if seconds < limit)


@_dash_if_missing
def usd(value: float) -> str:
    """Dollars: two significant digits below $1 (a CPU minute costs a fraction of a cent), cents below $100,
    whole dollars above."""
    if value < 1:
        return f"${sig(value, 2)}"
    return f"${value:,.2f}" if value < 100 else f"${value:,.0f}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A markdown table; ``align`` is one of ``l``/``r``/``c`` per column (default: first left, the rest
    right)."""
    marks = {"l": ":--", "r": "--:", "c": ":-:"}
    align = align or "l" + "r" * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks[column] for column in align) + "|"]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |" for cells in rows]
    return "\n".join(lines)
