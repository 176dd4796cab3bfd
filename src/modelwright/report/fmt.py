"""The formatters moved to :mod:`modelwright.fmt` (below the planner and the report, which both use them);
this name stays for the importers outside ``report/`` until they import ``modelwright.fmt`` themselves."""

from modelwright.fmt import DASH, count, duration, finite, pct, ratio, sig, table, usd

__all__ = ["DASH", "count", "duration", "finite", "pct", "ratio", "sig", "table", "usd"]
