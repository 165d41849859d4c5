"""benchmarks.step_revisions times the decode step of a git revision's engine against the working tree's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import step_revisions


def test_a_revision_and_the_working_tree_are_each_timed_in_their_own_process(tmp_path: Path,
                                                                            tiny_model_dir: Path) -> None:
    step_revisions.main(["--base", "HEAD", "--model", str(tiny_model_dir), "--batches", "1", "3", "--tokens", "4",
                         "--repeats", "1", "--rounds", "1", "--temperature", "0.8", "--out", str(tmp_path),
                         "--name", "steps"])
    payload = json.loads((tmp_path / "steps.json").read_text())
    assert (tmp_path / "steps.png").stat().st_size > 0
    assert sorted(r["side"] for r in payload["rounds"]) == ["base", "head"]
    assert payload["args"]["temperature"] == 0.8
    assert [r["batch"] for r in payload["results"]] == [1, 3]
    for row in payload["results"]:
        assert row["base_ms"] > 0 and row["head_ms"] > 0
        assert row["head_over_base"] == pytest.approx(row["head_ms"] / row["base_ms"])


@pytest.mark.parametrize(("flags", "named"), [(["--base", "no-such-revision"], "--base"),
                                              (["--batches", "0"], "--batches"), (["--tokens", "1"], "--tokens"),
                                              (["--rounds", "0"], "--rounds"),
                                              (["--temperature", "-1"], "--temperature")])
def test_bad_arguments_are_refused_naming_the_flag(flags: list[str], named: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        step_revisions.main(flags)
    assert named in str(refused.value) or named in capsys.readouterr().err
