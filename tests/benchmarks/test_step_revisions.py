"""benchmarks.step_revisions times the prefill and decode steps of a git revision's engine against the working
tree's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import step_revisions


def test_a_revision_and_the_working_tree_are_each_timed_in_their_own_process(tmp_path: Path,
                                                                            tiny_model_dir: Path) -> None:
    step_revisions.main(["--base", "HEAD", "--model", str(tiny_model_dir), "--batches", "1", "3", "--tokens", "4",
                         "--repeats", "1", "--rounds", "1", "--temperature", "0.8", "--prompt-tokens", "40",
                         "--out", str(tmp_path),
                         "--name", "steps"])
    payload = json.loads((tmp_path / "steps.json").read_text())
    assert (tmp_path / "steps.png").stat().st_size > 0
    assert sorted(r["side"] for r in payload["rounds"]) == ["base", "head"]
    assert payload["args"]["temperature"] == 0.8 and payload["args"]["prompt_tokens"] == 40
    assert [r["batch"] for r in payload["results"]] == [1, 3]
    for row in payload["results"]:
        for label in ("prefill", "decode"):
            assert row[f"{label}_base_ms"] > 0 and row[f"{label}_head_ms"] > 0
            assert row[f"{label}_head_over_base"] == pytest.approx(row[f"{label}_head_ms"] / row[f"{label}_base_ms"])


def test_a_prompt_of_n_tokens_is_the_sentence_repeated_to_n(tiny_model_dir: Path) -> None:
    from engine import LLM

    llm = LLM(model=str(tiny_model_dir))
    sentence = llm.engine.tokenizer.encode(step_revisions.PROMPT.format(2))
    prompt = step_revisions.prompt_of(llm, 2, 2 * len(sentence) + 3)
    assert prompt == sentence * 2 + sentence[:3]
    assert step_revisions.prompt_of(llm, 2, None) == step_revisions.PROMPT.format(2)


@pytest.mark.parametrize(("flags", "named"), [(["--base", "no-such-revision"], "--base"),
                                              (["--batches", "0"], "--batches"), (["--tokens", "1"], "--tokens"),
                                              (["--rounds", "0"], "--rounds"),
                                              (["--prompt-tokens", "0"], "--prompt-tokens"),
                                              (["--temperature", "-1"], "--temperature")])
def test_bad_arguments_are_refused_naming_the_flag(flags: list[str], named: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        step_revisions.main(flags)
    assert named in str(refused.value) or named in capsys.readouterr().err


def test_a_prefill_over_several_steps_is_timed_to_its_end(tiny_model_dir: Path) -> None:
    from engine import LLM, SamplingParams

    llm = LLM(model=str(tiny_model_dir), max_num_seqs=2, max_num_batched_tokens=16)
    ids = ["long", "short"]
    llm.engine.add_request("long", step_revisions.prompt_of(llm, 0, 40), SamplingParams(max_tokens=4))
    llm.engine.add_request("short", step_revisions.prompt_of(llm, 1, 6), SamplingParams(max_tokens=4))
    assert step_revisions.prefill(llm.engine, ids) == 3  # 46 prompt tokens, 16 a step
    assert all(seq.num_output_tokens == 1 for request_id in ids for seq in llm.engine.groups[request_id].seqs)
