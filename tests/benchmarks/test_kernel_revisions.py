"""benchmarks.kernel_revisions builds the CPU kernels of a git revision beside the working tree's and times both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import kernel_revisions


def test_a_revision_is_timed_against_the_working_tree_on_the_same_inputs(tmp_path: Path) -> None:
    kernel_revisions.main(["--base", "HEAD", "--dtypes", "float32", "bfloat16", "--rows", "2", "--contexts", "20",
                           "--layers", "2", "--repeats", "2", "--out", str(tmp_path), "--name", "revisions"])
    payload = json.loads((tmp_path / "revisions.json").read_text())
    assert (tmp_path / "revisions.png").stat().st_size > 0
    assert [(r["dtype"], r["rows"], r["context"]) for r in payload["results"]] == [("float32", 2, 20),
                                                                                   ("bfloat16", 2, 20)]
    for row in payload["results"]:
        assert row["head_over_base"] == pytest.approx(row["head_us"] / row["base_us"])
        if payload["same_source"]:  # HEAD's kernels are the working tree's: one build, the same outputs
            assert row["max_abs_difference"] == 0.0


@pytest.mark.parametrize("revision", ["no-such-revision", "HEAD~100000"])
def test_an_unknown_base_revision_is_refused_naming_the_flag(revision: str) -> None:
    with pytest.raises(SystemExit, match="--base"):
        kernel_revisions.main(["--base", revision])

