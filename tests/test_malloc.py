"""pipeline/malloc.py: glibc keeps freed host memory, so a step's allocations stop faulting pages in."""
import platform
import subprocess
import sys
import textwrap

import pytest

from pipeline.malloc import keep_freed_memory

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# In a fresh interpreter: a step's pattern, eight 16 MiB tensors made and all freed, twice; the
# minor page faults of the second step (its 128 MiB is 32768 pages of 4 KiB, each faulted in and
# zeroed when the memory is new to the process). The second step, not a later one: glibc's dynamic
# mmap threshold rises as such chunks are freed, so under its defaults this toy pattern stops
# faulting after two to four steps (a run's varied sizes keep faulting: 253-277 k faults against
# 80 k kept, bench/RESULTS.md 2026-11-28).
PROBE = textwrap.dedent("""
    import resource, sys, torch
    from pipeline.malloc import keep_freed_memory
    took = keep_freed_memory() if sys.argv[1] == "keep" else None
    for step in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        xs = [torch.ones(4 << 20) for _ in range(8)]
        del xs
    print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_kept_memory_is_reused_without_faulting_it_in_again() -> None:
    took, kept = _faults("keep")
    _, default = _faults("default")
    assert took == "True"
    assert default >= 16384, f"glibc's defaults: the second step faulted {default} pages (expected its 32768 anew)"
    assert kept <= default / 4, f"kept: {kept} page faults in the second step, glibc's defaults: {default}"


def test_where_there_is_no_mallopt_nothing_changes_and_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert keep_freed_memory() is False
