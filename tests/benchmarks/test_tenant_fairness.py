"""The fair-share benchmark: a real `pagedserve up` on the tiny model, the working tree and a revision of it."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import tenant_fairness


def test_the_benchmark_measures_both_keys_on_the_working_tree_and_a_revision(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    payload = tenant_fairness.main([
        "--model", str(tiny_model_dir), "--max-num-seqs", "2", "--backlog", "12", "--light-jobs", "2",
        "--light-interval-s", "0.1", "--max-tokens", "2", "--base", "HEAD",
        "--pagedserve-flags", "--dtype float32 --kv-cache-memory 32MiB --swap-space 32MiB", "--out", str(tmp_path)])
    rows = payload["rows"]
    assert [row["side"] for row in rows] == ["head", f"base {payload['base_commit'][:12]}"]
    for row in rows:
        assert row["light_finished"] == 2 and row["heavy_started"] >= 1, row
        assert row["light_wait_p50_s"] >= 0 and row["heavy_wait_p50_s"] >= 0, row
    assert json.loads((tmp_path / "tenant_fairness.json").read_text())["rows"] == rows
    assert (tmp_path / "tenant_fairness.png").stat().st_size > 0
    assert payload["machine"]["cpu_model"]
