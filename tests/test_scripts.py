"""scripts/gpu_run.sh: its dry run lists the parts, and its check (imports, plans, one step) passes here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "gpu_run.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=420)


def test_dry_run_lists_every_part_with_the_current_command_line():
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    parts = ("== study resnet18", "== study extra", "== study vit", "== overhead resnet18",
             "-m modelwright study --accelerator cuda", "--budget_gib 40",
             "--plan configs/study/plan_vit.yaml")
    for part in parts:
        assert part in out, part
    assert ("== attention (at most" in out) == (REPO_ROOT / "benchmarks" / "attention.py").is_file()
    only = _run("--dry-run", "overhead")
    assert "== overhead resnet18" in only.stdout and "== study" not in only.stdout
    bad = _run("--dry-run", "nope")
    assert bad.returncode == 2 and "unknown part: nope" in bad.stderr


def test_check_imports_resolves_the_plans_and_trains_one_step():
    proc = _run("--check")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for line in ("imports: ok", "plans: ok", "one-step fit: ok", "check: ok"):
        assert line in proc.stdout, line
