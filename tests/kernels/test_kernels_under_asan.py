"""The CPU's kernels (linear layers, decode attention, the cache write) read and write only inside their tensors: their
sweep (asan_sweep.py) runs under AddressSanitizer in a process of its own, which a stray access aborts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def asan_runtime() -> str:
    """The C++ compiler's AddressSanitizer runtime (gcc installs it with the compiler)."""
    path = subprocess.run(["c++", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True)
    runtime = path.stdout.strip()
    assert os.path.isabs(runtime), f"the C++ compiler has no AddressSanitizer runtime: {runtime!r}"
    return runtime


def test_the_kernels_stay_inside_their_tensors() -> None:
    env = {**os.environ, "LD_PRELOAD": asan_runtime(), "PYTHONPATH": str(REPO_ROOT),
           # torch and Python keep memory until exit on purpose; the sweep is about out-of-bounds accesses
           "ASAN_OPTIONS": "detect_leaks=0"}
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("asan_sweep.py"))], env=env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "checked" in result.stdout
