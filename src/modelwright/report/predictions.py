"""Each study run's peak as predicted before it ran (``prediction`` in its record), beside what it measured,
category by category."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from modelwright.fmt import pct, sig, table
from modelwright.measure.rehearsal import CATEGORIES
from modelwright.record import get_path
from modelwright.study_rows import Row, median

#: A predicted category counts as right within 5% of the measured one or 2 MiB, whichever is larger.
TOLERANCE_SHARE = 0.05
TOLERANCE_MIB = 2.0


def tolerance_mib(measured: float) -> float:
    return max(TOLERANCE_SHARE * measured, TOLERANCE_MIB)


class CategoryError(NamedTuple):
    """One category's predicted and measured MiB."""

    category: str
    predicted: float
    measured: float

    @property
    def over_tolerance(self) -> float:
        """The error over its tolerance: within at 1 or less."""
        return abs(self.predicted - self.measured) / tolerance_mib(self.measured)

    @property
    def within(self) -> bool:
        return self.over_tolerance <= 1

    def text(self) -> str:
        """``temporaries 39.0 vs 39.0 MiB (+0.0 MiB)``: the category, predicted vs measured, the error."""
        difference = self.predicted - self.measured
        sign = "+" if difference >= 0 else "-"
        return (f"{self.category.replace('_', ' ')} {sig(self.predicted)} vs {sig(self.measured)} MiB "
                f"({sign}{sig(abs(difference), 2)} MiB)")


def category_errors(predicted: Mapping[str, float], measured: Mapping[str, float]) -> list[CategoryError]:
    """Every category both sides have, in the planner's order."""
    return [CategoryError(category, predicted[category], measured[category])
            for category in CATEGORIES if category in predicted and category in measured]


def worst(errors: Sequence[CategoryError]) -> CategoryError:
    """The category furthest outside (or least inside) its tolerance."""
    return max(errors, key=lambda error: error.over_tolerance)


def verdict_text(errors: Sequence[CategoryError]) -> str:
    missed = [error.category.replace("_", " ") for error in errors if not error.within]
    return "misses: " + ", ".join(missed) if missed else "within"


@dataclass(frozen=True)
class PredictionCheck:
    """One row's prediction, recorded before its first run, and what its runs measured (medians)."""

    run: str
    machine: str
    predicted: Mapping[str, float]
    measured: Mapping[str, float]
    measured_peak: float

    def errors(self) -> list[CategoryError]:
        return category_errors(self.predicted, self.measured)


def measured_categories(row: Row) -> dict[str, float]:
    """The row's anatomy by the planner's categories: medians over its repeats."""
    found = {category: median([get_path(record, f"memory.anatomy_mib.{category}") for record in row.records])
             for category in CATEGORIES}
    return {category: value for category, value in found.items() if value is not None}


def prediction_checks(studies: Sequence[Any]) -> list[PredictionCheck]:
    """Every ``ok`` row of the studies (:class:`modelwright.report.readme.ResultsFolder`) with a measured peak
    and a recorded prediction."""
    checks = []
    for study in studies:
        for row in study.rows:
            predicted_record = next((record for record in row.records if record.get("prediction")), None)
            if not row.ok or row.figures.peak_mib is None or predicted_record is None:
                continue
            predicted = get_path(predicted_record, "prediction.predicted_mib") or {}
            if not isinstance(predicted.get("total"), (int, float)):
                continue
            checks.append(PredictionCheck(row.name, study.slug, predicted, measured_categories(row),
                                          row.figures.peak_mib))
    return checks


def check_cells(check: PredictionCheck) -> list[str]:
    errors = check.errors()
    total_error = check.predicted["total"] / check.measured_peak - 1
    cells = [check.run, check.machine, sig(check.predicted["total"]), sig(check.measured_peak),
             pct(total_error, signed=True)]
    if errors:
        cells += [worst(errors).text(), verdict_text(errors)]
    else:  # no categories on one side: the total only
        cells += ["not by category", "total within" if abs(total_error) <= TOLERANCE_SHARE else "misses"]
    return cells


def prediction_table(studies: Sequence[Any]) -> str | None:
    """Per run of the studies recorded with a prediction, the peak predicted before it ran beside the measured
    one, its worst category, and whether every category is within tolerance."""
    checks = prediction_checks(studies)
    if not checks:
        return None
    rule = f"{pct(TOLERANCE_SHARE)} or {TOLERANCE_MIB:g} MiB"
    header = ["run", "machine", "predicted peak MiB", "measured peak MiB (median)", "error",
              "worst category: predicted vs measured", f"every category within {rule}"]
    return table(header, [check_cells(check) for check in checks], "llrrrll")
