"""modelwright.train.runtime: glibc malloc keeps freed memory with ``retain`` (counted in page faults, not
time)."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

from modelwright.train.runtime import set_cpu_malloc

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# A training step's pattern: tensors of a step's sizes (4 to 64 MiB, over glibc's largest mmap threshold)
# allocated, written and freed together, eight times after the mode is set; prints the minor page faults of
# the last three steps (the heap settles in the first ones).
PROBE = textwrap.dedent("""
    import resource, sys
    import torch
    from modelwright.train.runtime import set_cpu_malloc
    applied = set_cpu_malloc(sys.argv[1])
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    def step():
        held = [torch.ones(mib * 2**18) for mib in (8, 64, 16, 32, 64, 4, 48, 64)]
        return sum(float(t[0]) for t in held)
    for _ in range(5):
        step()
    before = faults()
    for _ in range(3):
        step()
    print(applied, faults() - before)
""")
STEP_PAGES = 3 * 300 * 2**20 // 4096  # three steps of 300 MiB in 4 KiB pages


def _faults(mode: str) -> tuple[str, int]:
    proc = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    applied, faults = proc.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(not GLIBC, reason="glibc malloc only")
def test_retain_reuses_freed_memory_instead_of_faulting_it_in_again():
    applied, retained = _faults("retain")
    assert applied == "True"
    not_applied, system = _faults("system")
    assert not_applied == "False"  # system leaves malloc as it is
    # glibc maps each large block afresh: its pages fault in again every step
    assert system > 0.5 * STEP_PAGES
    # kept in the heap and reused; the heap may still grow by a block or two as it settles (seen: 0 to 32,768
    # faults)
    assert retained < 0.25 * system


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="cpu_malloc: 'fast'; valid: retain, system"):
        set_cpu_malloc("fast")
