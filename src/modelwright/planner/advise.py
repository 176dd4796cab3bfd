"""The advisor: which precision × accumulation × checkpointing combinations fit a memory budget, and the cheapest.

Peaks are predicted from a profiled baseline step (:func:`modelwright.planner.memory.predict_peak_mib`); step times
from the slowdowns each technique showed in the study's records (measured, with their run ids) or "unknown".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from modelwright.planner.memory import MIB, _cfg, param_state_bytes, predict_peak_mib, state_bytes_per_rank
from modelwright.record import get_path
from modelwright.report.fmt import sig, table

#: The study run whose step time, over the baseline's, is each technique's slowdown.
TECHNIQUE_RUNS = {"bf16-mixed": "amp", "stage": "checkpointing-stage", "block": "checkpointing-block",
                  "accumulate": "accumulate"}


@dataclass(frozen=True)
class Option:
    precision: str
    accumulate: int
    checkpointing: str
    peak_mib: float
    step_ms: float | None

    @property
    def label(self) -> str:
        return f"{self.precision}, {self.accumulate} × {self.checkpointing}"


def slowdowns(records: Sequence[Mapping]) -> dict[str, tuple[float, str]]:
    """Each technique's measured step time over the baseline's, with the run id: ``{"block": (1.31, id)}``."""
    ms = {get_path(r, "study.name"): (get_path(r, "timing.step_time_median_ms"), r.get("run_id")) for r in records
          if r.get("status") == "ok" and get_path(r, "timing.step_time_median_ms")}
    if "baseline" not in ms:
        return {}
    base = ms["baseline"][0]
    return {t: (ms[run][0] / base, ms[run][1]) for t, run in TECHNIQUE_RUNS.items() if run in ms}


def options(profile_record: Mapping, config: Mapping, batch: int, budget_mib: float,
            slow: Mapping[str, tuple[float, str]], base_ms: float | None) -> list[Option]:
    """Every combination at ``batch`` samples per step, with its predicted peak and step time, fastest first."""
    prof = profile_record.get("profile", profile_record)
    granularities, profiled = ["off", *prof["segments"]], prof["batch_size"]
    out = []
    for precision in ("32-true", "bf16-mixed"):
        for acc in (a for a in (1, 2, 4, 8, 16, 32) if batch % a == 0):
            for ckpt in granularities:
                cfg = {**config, "trainer.precision": precision, "trainer.accumulate_grad_batches": acc,
                       "data.batch_size": batch // acc, "model.gradient_checkpointing": ckpt}
                peak = predict_peak_mib(profile_record, cfg)["total"]
                used = ([precision] if precision != "32-true" else []) + (["accumulate"] if acc > 1 else [])
                used += [ckpt] if ckpt != "off" else []
                step = base_ms * batch / profiled if base_ms else None
                for t in used:
                    step = step * slow[t][0] if step is not None and t in slow else None
                out.append(Option(precision, acc, ckpt, peak, step))
    # Fastest first; without times, fewest techniques first (each one costs time or precision).
    return sorted(out, key=lambda o: (o.step_ms is None, o.step_ms or 0, o.accumulate, o.checkpointing != "off",
                                      o.checkpointing == "block", o.precision != "32-true"))


def shardings(profile_record: Mapping, config: Mapping, batch: int, budget_mib: float) -> list[tuple[str, int, float]]:
    """The fewest ranks at which ZeRO-1, ZeRO-2 and FSDP2 fit ``budget_mib`` (per-rank batch = batch / N)."""
    psi = profile_record.get("profile", profile_record)["parameters"]
    state = param_state_bytes(str(_cfg(config, "trainer.precision", "32-true")),
                              str(_cfg(config, "model.optimizer", "adamw")))
    found = []
    for name in ("zero1", "zero2", "fsdp"):
        for n in (2, 4, 8, 16, 32, 64, 128, 256, 512):
            if batch % n:
                break
            cfg = {**config, "data.batch_size": batch // n}
            if name == "fsdp":
                fsdp = {**cfg, "trainer.strategy": "fsdp", "trainer.devices": n}
                peak = predict_peak_mib(profile_record, fsdp)["total"]
            else:
                one, sharded = predict_peak_mib(profile_record, cfg), state_bytes_per_rank(psi, state, name, n)
                full = state_bytes_per_rank(psi, state, "dp", 1)
                peak = one["total"] - sum(full[k] - sharded[k] for k in full) / MIB
            if peak <= budget_mib:
                found.append((name, n, peak))
                break
    return found


def _ranked(profile_record: Mapping, config: Mapping, batch: int, budget_mib: float, records: Sequence[Mapping]):
    slow = slowdowns(records)
    base = next((r for r in records if get_path(r, "study.name") == "baseline"), None)
    base_ms = get_path(base, "timing.step_time_median_ms") if base else None
    return options(profile_record, config, batch, budget_mib, slow, base_ms), slow


def advise(profile_record: Mapping, config: Mapping, batch: int, budget_mib: float,
           records: Sequence[Mapping] = (), budget_label: str = "") -> str:
    """Markdown: the combinations that fit, each with its predicted peak and step time, and the recommendation."""
    opts, slow = _ranked(profile_record, config, batch, budget_mib, records)
    fit = [o for o in opts if o.peak_mib <= budget_mib]
    pid = profile_record.get("run_id", "the profile")
    lines = [f"Budget {sig(budget_mib / 1024)} GiB{budget_label}; batch {batch}; peaks predicted from the profile of "
             f"run {pid}; step times " + ("predicted from measured slowdowns: " + ", ".join(
                 f"{t} {sig(f, 2)}× ({rid})" for t, (f, rid) in slow.items()) if slow else "unknown (no study records)"
             ),
             "", table(["precision", "accumulation", "checkpointing", "predicted peak (MiB)", "predicted step", "fits"],
                       [[o.precision, o.accumulate, o.checkpointing, sig(o.peak_mib),
                         sig(o.step_ms, 3, " ms") if o.step_ms else "unknown",
                         "yes" if o.peak_mib <= budget_mib else "no"]
                        for o in opts]), ""]
    if fit:
        lines.append(f"Recommended: {fit[0].label} — predicted peak {sig(fit[0].peak_mib)} MiB.")
    else:
        found = shardings(profile_record, config, batch, budget_mib)
        lines.append("Nothing fits one device. " + ("; ".join(
            f"{name} over {n} ranks fits ({sig(p)} MiB per rank)" for name, n, p in found) or "No sharding up to 512."))
    return "\n".join(lines)


def recommend(profile_record: Mapping, config: Mapping, batch: int, budget_mib: float,
              records: Sequence[Mapping] = ()) -> Option | None:
    """The advisor's choice: the first option that fits (fastest predicted, else fewest techniques), or None."""
    opts, _ = _ranked(profile_record, config, batch, budget_mib, records)
    return next((o for o in opts if o.peak_mib <= budget_mib), None)
