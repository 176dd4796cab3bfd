"""scripts/gpu_run.sh: its dry run lists the parts of the one GPU call within the deadline, and its rehearsal
(the carried wheels installed, every part imported, the plans resolved, one step trained) passes here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "gpu_run.sh"
PARTS = ("tests", "study", "attention", "batch2048", "repeats")


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO_ROOT, env=environment, capture_output=True,
                          text=True, timeout=420)


def test_dry_run_lists_every_part_within_the_deadline():
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    listed = re.findall(r"^== (\S+) \(at most (\d+)s\): (.*)$", out, re.M)
    assert [name for name, _, _ in listed] == list(PARTS)
    deadline = int(re.search(r"deadline (\d+)s", out).group(1))
    assert deadline <= 540, "the call must end inside a 10-minute command with the machine's start beside it"
    commands = {name: command for name, _, command in listed}
    study = commands["study"]
    assert "-m modelwright study --accelerator cuda" in study and "--budget_gib 40" in study
    assert "--steps 200" in study and "ddp" not in study  # ddp needs 2 GPUs
    assert "--repeats 3 --budget false" in commands["repeats"]
    assert '--overrides={"data.batch_size":2048}' in commands["batch2048"]
    assert "--device cuda" in commands["attention"] and "--seqs 1024 2048 4096 8192 16384 32768 65536" in \
        commands["attention"]
    assert "tests/test_cuda_memory.py" in commands["tests"]
    only = _run("--dry-run", "attention")
    assert re.findall(r"^== (\S+)", only.stdout, re.M) == ["attention"]
    bad = _run("--dry-run", "nope")
    assert bad.returncode == 2 and "unknown part: nope" in bad.stderr


def _probe_wheel(folder: Path) -> Path:
    """A wheel of one module, to see the rehearsal install what it is given."""
    wheel = folder / "gpu_run_probe-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("gpu_run_probe/__init__.py", "VALUE = 7\n")
        archive.writestr("gpu_run_probe-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: gpu-run-probe\n"
                                                                 "Version: 0.1\n")
        archive.writestr("gpu_run_probe-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                                              "Tag: py3-none-any\n")
        archive.writestr("gpu_run_probe-0.1.dist-info/RECORD", "")
    return wheel


def test_check_imports_resolves_the_plans_and_trains_one_step_in_the_rehearsal(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _probe_wheel(wheels)
    for carried in (REPO_ROOT / ".whl").glob("*.whl"):  # the real ones, where this checkout has them
        (wheels / carried.name).write_bytes(carried.read_bytes())
    before = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True)
    proc = _run("--rehearse", WHEELS=str(wheels))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"^wheels: installed from .*gpu_run_probe-0\.1", out, re.M), out
    assert len(re.findall(r"^plan resolved: study --accelerator cuda", out, re.M)) == 3
    for line in ("imports: ok", "predictions reproduced", "attention benchmark: ok", "GPU tests collected",
                 "one-step fit on the CPU: ok", "packing: ok", "rehearsal: ok"):
        assert line in out, line
    assert re.findall(r"^== (\S+)", out, re.M) == list(PARTS)
    after = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert after.stdout == before.stdout, "the rehearsal wrote into the working tree"
