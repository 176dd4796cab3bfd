"""Time the main job as a user runs it and write the README's statement of it from the measurement.

To run: ``uv run python benchmarks/main_job.py`` (runs ``main.py fit --config configs/amp.yaml`` once, in a
fresh process, with the default settings; about 5 minutes on a 2-core CPU).

Writes ``results/<hardware>/main_job.json`` (command, wall time of the whole process, the fit's measured epoch
and median step, final val/acc, hardware, versions, the run record's id), then the README's sections
(``python -m modelwright report``; ``--no-report`` leaves them). ``--readme-only`` rewrites the README from the
existing JSON without running; ``--logs DIR`` keeps the run's logs (TensorBoard events) in DIR.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from modelwright.record import read_record  # noqa: E402
from modelwright.report import report  # noqa: E402
from modelwright.study import hardware_slug  # noqa: E402

CONFIG = "configs/amp.yaml"


def run(config: str, logs: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        tmp = logs or scratch
        command = [sys.executable, "main.py", "fit", "--config", config]
        t0 = time.perf_counter()
        proc = subprocess.run(
            [*command, "--trainer.logger.init_args.save_dir", tmp, "--trainer.enable_progress_bar", "false"],
            cwd=REPO, capture_output=True, text=True,
        )
        wall_s = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"error: {config}: the main job failed (exit {proc.returncode}): "
                             f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}")
        (record_path,) = Path(tmp).glob("*/version_*/record.json")
        record = read_record(record_path)
    return {
        "command": f"uv run main.py fit --config {config}",
        "process_wall_time_s": round(wall_s, 1),
        "fit_wall_time_s": record["timing"]["wall_time_s"],
        "epoch_time_s": record["timing"]["epoch_time_s"],
        "step_time_median_ms": record["timing"]["step_time_median_ms"],
        "step_cpu_utilization": record["timing"].get("step_cpu_utilization"),
        "data": record["config"]["data"]["dataset"],
        "val_acc": record["metrics"]["val/acc"],
        "val_loss": record["metrics"]["val/loss"],
        "precision": record["techniques"]["precision"],
        "hardware": record["hardware"],
        "versions": record["versions"],
        "run_id": record["run_id"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--readme-only", action="store_true", help="rewrite the README from the existing JSON")
    parser.add_argument("--no-report", action="store_true", help="write the JSON only, not the README")
    parser.add_argument("--logs", default=None, help="keep the run's logs in this folder (default: discarded)")
    args = parser.parse_args(argv)
    out = REPO / "results" / hardware_slug() / "main_job.json"
    if args.readme_only:
        if not out.is_file():
            raise SystemExit(f"error: {out.relative_to(REPO)}: not found; run without --readme-only first")
        result = json.loads(out.read_text())
    else:
        result = run(args.config, args.logs)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(out)
    return 0 if args.no_report else report(plots=False)


if __name__ == "__main__":
    raise SystemExit(main())
