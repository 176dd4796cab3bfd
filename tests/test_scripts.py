"""scripts/gpu_run.sh: its dry run lists the parts, and its check (imports, config, one step) passes here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "gpu_run.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_dry_run_lists_the_three_parts():
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    for part in ("== study resnet18", "== study vit", "== overhead resnet18", "--plan configs/study/plan_vit.yaml"):
        assert part in proc.stdout


def test_check_imports_parses_and_trains_one_step():
    proc = _run("--check")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "imports: ok" in proc.stdout and "one-step fit: ok" in proc.stdout and "check: ok" in proc.stdout
