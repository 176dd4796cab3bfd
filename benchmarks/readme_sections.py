"""Write the README's benchmark statements from the results files, never by hand.

To run: ``uv run python benchmarks/readme_sections.py`` (after ``benchmarks/main_job.py``,
``benchmarks/callback_overhead.py`` and ``benchmarks/overhead.py`` have written ``results/<hardware>/``).

Each section lives between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``; a results file that is missing
leaves its section saying so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _where(result: dict) -> str:
    hw, v = result.get("hardware") or {}, result.get("versions") or {}
    device = hw.get("device_name") or hw.get("cpu_model")
    cores = f", {hw.get('cpu_cores')} cores" if hw.get("accelerator") == "cpu" else ""
    return (
        f"{device}{cores}; torch {v.get('torch')}, lightning {v.get('lightning')}, "
        f"accelerate {v.get('accelerate')}, Python {v.get('python')}"
    )


def main_job_text(result: dict) -> str:
    return (
        f"Measured (`uv run python benchmarks/main_job.py`): `{result['command']}` with the default settings took "
        f"**{result['process_wall_time_s'] / 60:.1f} minutes** from start to exit and ended with "
        f"**val/acc {result['val_acc']:.3f}** (chance: 0.100), in `{result['precision']}`, on {_where(result)}.\n"
    )


def _ratios(values: list[float]) -> str:
    return ", ".join(f"{r:.3f}" for r in values)


def overhead_text(callback: dict | None, loops: dict | None, epoch: dict | None = None) -> str:
    lines = []
    if callback:
        on, off = callback["median_step_ms"]["on"], callback["median_step_ms"]["off"]
        s = callback["settings"]
        direct = ""
        if callback.get("hooks_ms_per_step"):
            hooks = callback["hooks_ms_per_step"]
            direct = (
                f"Timed directly, the callbacks' hooks take **{hooks['median']:.2f} ms per step** (median over "
                f"{hooks['steps']} steps; at most {hooks['max']:.2f} ms), **{callback['hooks_fraction_of_step']:.3%}** "
                f"of the median step: this figure does not depend on the machine's noise. "
            )
        lines.append(
            f"**What measuring costs.** {direct}Side by side, the median step of the default job took "
            f"{on:.0f} ms with the measurement callbacks on and {off:.0f} ms with them off; the median over "
            f"{s['repeats']} back-to-back pairs of runs of the on/off ratio is "
            f"**{(callback['ratio_on_off'] - 1) * 100:+.1f}%** (pairs: {_ratios(callback.get('pair_ratios', []))}; "
            f"{s['steps']} steps per run, the first {s['warmup']} and the measuring ones left out). The spread of "
            f"the pairs is the machine's step-to-step noise, larger than the cost being measured. "
            f"`{callback['command']}`; {_where(callback)}."
        )
    for result in (loops, epoch):
        if not result:
            continue
        s, parts = result["settings"], []
        is_epoch = result.get("mode") == "epoch"
        for name in ("raw", "accelerate", "lightning"):
            summary = result["loops"].get(name)
            if summary is None:
                continue
            if is_epoch:
                text = f"{name} {summary['epoch_time_s']:.2f} s per epoch"
                if name != "raw":
                    text += (f", **{summary['epoch_ratio_to_raw']:.3f}× raw** ({summary['epoch_overhead_s']:+.2f} s; "
                             f"repeats: {_ratios(summary.get('repeat_epoch_ratios_to_raw', []))})")
            else:
                text = f"{name} {summary['median_step_ms']:.0f} ms"
                if name != "raw":
                    text += (f", **{summary['ratio_to_raw']:.3f}× raw** "
                             f"(repeats: {_ratios(summary.get('repeat_ratios_to_raw', []))})")
            parts.append(text)
        what = (f"time per epoch of {s['steps_per_epoch']} steps" if is_epoch
                else f"median step over {s['measured_steps']} timed steps")
        lines.append(
            f"**Lightning and Accelerate against a raw PyTorch loop** ({s['model']}, batch {s['batch_size']}, "
            f"{s['precision']}, {s['optimizer']}; {what}, {s['repeats']} interleaved repeats, each loop's ratio "
            f"taken within a repeat, the median over repeats shown): " + "; ".join(parts)
            + f". `{result['command']}`; {_where(result)}."
        )
    if not lines:
        return "No overhead measurement recorded yet: run `uv run python benchmarks/callback_overhead.py`.\n"
    return "\n\n".join(lines) + "\n"


def cpu_defaults_text(result: dict | None) -> str:
    if not result:
        return "No CPU-defaults measurement recorded yet: run `uv run python benchmarks/cpu_defaults.py`.\n"
    s = result["settings"]
    rows = ["| setting | option | median step | vs first option | MFU | warm-up steps |", "|---|---|---|---|---|---|"]
    for group in result["groups"]:
        for o in group["options"]:
            option = o["option"].split("=", 1)[1] + (" **(default)**" if o["default"] else "")
            mfu = f"{o['mfu']:.0%}" if o.get("mfu") is not None else "n/a"
            warm = f"{o['warmup_s']:.1f} s" if o.get("warmup_s") is not None else "n/a"
            rows.append(f"| {group['group']} | {option} | {o['median_step_ms']:.0f} ms | "
                        f"{o['ratio_to_reference']:.2f}× | {mfu} | {warm} |")
    faults = [
        f"{o['option'].split('=', 1)[1]} {o['minor_faults_per_step']:,.0f}"
        for g in result["groups"] for o in g["options"] if o.get("minor_faults_per_step") is not None
    ]
    if faults:
        rows.append(f"\nMinor page faults per step (the cpu_malloc children, median): {', '.join(faults)}.")
    return (
        f"Measured (`{result['command']}`; {s['model']}, batch {s['batch_size']}, {s['precision']}, "
        f"{s['optimizer']}; each option's step taken in turn with the others, {s['rounds']} rounds, the figure the "
        f"median over rounds of its ratio to the first option; MFU against the measured peak of "
        f"{result['peak_flops_per_s'] / 1e9:.0f} GFLOP/s; warm-up: the {s['warmup']} unmeasured first steps, "
        f"compilation included; {_where(result)}):\n\n" + "\n".join(rows) + "\n"
    )


def replace_section(text: str, name: str, body: str) -> str:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise SystemExit(f"error: README.md: needs {start} ... {end} markers")
    return text[: i + len(start)] + "\n" + body + text[j:]


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(REPO / "src"))
    from modelwright.study import hardware_slug

    results = REPO / "results" / hardware_slug()
    readme = REPO / "README.md"
    text = readme.read_text()
    main_job = _load(results / "main_job.json")
    if main_job:
        text = replace_section(text, "mainjob", main_job_text(main_job))
    overhead = overhead_text(
        _load(results / "callback_overhead.json"),
        _load(results / "overhead-resnet18.json"),
        _load(results / "overhead-smallcnn-epoch.json"),
    )
    text = replace_section(text, "overhead", overhead)
    if "<!-- cpudefaults:start -->" in text:
        text = replace_section(text, "cpudefaults", cpu_defaults_text(_load(results / "cpu_defaults.json")))
    tmp = readme.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(readme)
    print(f"README.md: sections written from {results.relative_to(REPO)}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
