"""The kernels' build survives a process killed in the middle of it, as a worker stopped during its first start is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paged_kernels.cpu_extension import build_directory

NAME = "pagedserve_build_lock_test"
BUILD = ("from paged_kernels.cpu_extension import build_kernels; "
         f"print(build_kernels({NAME!r}, ['int answer() {{ return 42; }}'], functions=['answer']).answer())")


def _build() -> subprocess.Popen:
    # a session of its own, so that killing it kills the compiler it started too, as stopping a container does
    return subprocess.Popen([sys.executable, "-c", BUILD], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path} after {timeout_s} s"
        time.sleep(0.05)


def test_a_build_killed_midway_leaves_nothing_that_stops_the_next(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # the builds' processes inherit it
    torch_lock = build_directory(NAME) / "lock"
    killed = _build()
    try:
        _wait_for(torch_lock, 120)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    assert torch_lock.exists()  # what a killed build leaves behind, and torch's next build would wait on forever
    again = _build()
    try:
        output, _ = again.communicate(timeout=300)
    finally:
        if again.poll() is None:
            os.killpg(again.pid, signal.SIGKILL)
    assert again.returncode == 0, output
    assert output.strip().endswith("42")
