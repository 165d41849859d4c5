"""benchmarks/kernels.py needs a GPU to measure; its recorded runs are read back, tabled and plotted anywhere."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "kernels.py"
RECORDED = REPO / "benchmarks" / "results" / "gpu-h200-1204" / "kernels-graphs.json"


def test_a_recorded_run_is_tabled_and_plotted_without_a_gpu(tmp_path: Path) -> None:
    recorded = shutil.copy(RECORDED, tmp_path / "kernels.json")
    result = subprocess.run([sys.executable, str(SCRIPT), "--from-json", str(recorded)],
                            capture_output=True, text=True, check=True)
    assert (tmp_path / "kernels.png").stat().st_size > 0
    table = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(table) == 4
    for batch, context, _, paged_ms, sdpa_ms, ratio, *_ in table:
        assert int(batch) in (1, 32) and int(context) in (1024, 8192)
        assert abs(float(ratio) - float(paged_ms) / float(sdpa_ms)) < 0.02  # the rounded times' ratio


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures on a GPU")
def test_without_a_gpu_it_measures_nothing_and_says_so(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "k.json")],
                            capture_output=True, text=True, check=True)
    assert "needs a CUDA GPU" in result.stdout and not (tmp_path / "k.json").exists()


def test_a_missing_recorded_run_is_refused_naming_the_flag(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--from-json", str(tmp_path / "none.json")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "--from-json" in result.stderr and "none.json" in result.stderr


def test_tables_too_small_for_a_context_are_refused_naming_both_flags(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--table-tokens", "1000", "--context-lens", "1024"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "--table-tokens" in result.stderr and "--context-lens" in result.stderr
