"""A request that makes an engine step raise fails alone; every other request finishes with the
tokens it produces in a run without it (greedy, seeded sampling, n > 1 and beam search alike)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.outputs import RequestOutput

VICTIMS = {
    "greedy": ("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
    "seeded": ("Once upon a time", SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, seed=7,
                                                  ignore_eos=True, logprobs=2)),
    "parallel": ("In a small village", SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=11,
                                                      ignore_eos=True, repetition_penalty=1.2)),
    "beams": ("The weather today is", SamplingParams(beam_width=3, temperature=0.0, max_tokens=6, ignore_eos=True)),
}


class PoisonedModel:
    """The real model, except that a forward pass whose input holds ``poison`` raises."""

    def __init__(self, model: Any, poison: int) -> None:
        self.model, self.poison = model, poison

    def __call__(self, input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        if bool((input_ids == self.poison).any()):
            raise RuntimeError(f"poisoned token {self.poison} in the batch")
        return self.model(input_ids, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class PoisonedTokenizer:
    """The real tokenizer, except that decoding ``poison`` raises (after the step appended tokens)."""

    def __init__(self, tokenizer: Any, poison: int) -> None:
        self.tokenizer, self.poison = tokenizer, poison

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        if self.poison in token_ids:
            raise UnicodeDecodeError("utf-8", b"", 0, 1, f"poisoned token {self.poison}")
        return self.tokenizer.decode(token_ids, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB", seed=1)


@pytest.fixture(scope="module")
def small_budget_llm(tiny_model_dir: Path) -> LLM:
    """Prefills chunked 16 tokens a step, so a request's samples recompute in different steps."""
    return LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB", seed=1,
               max_num_batched_tokens=16, max_num_seqs=8)


def victim_tokens(llm: LLM) -> dict[str, list[list[int]]]:
    """Each victim's tokens in a run without the faulty request."""
    outputs = llm.generate([p for p, _ in VICTIMS.values()], [s for _, s in VICTIMS.values()], use_tqdm=False)
    return {name: [c.token_ids for c in out.outputs] for name, out in zip(VICTIMS, outputs)}


@pytest.fixture(scope="module")
def baseline(llm: LLM) -> dict[str, list[list[int]]]:
    """Each victim's tokens in a run without the faulty request."""
    return victim_tokens(llm)


def unused_token(llm: LLM, baseline: dict[str, list[list[int]]]) -> int:
    """A token id that no victim's prompt or output holds."""
    used = {t for outs in baseline.values() for out in outs for t in out}
    used |= {t for prompt, _ in VICTIMS.values() for t in llm.tokenizer.encode(prompt)}
    return next(t for t in range(1000, 2000) if t not in used)


@contextmanager
def poisoned(llm: LLM, site: str, poison: int) -> Iterator[None]:
    engine = llm.engine
    if site == "forward":
        engine.runner.model = PoisonedModel(engine.runner.model, poison)
    else:
        engine.tokenizer = PoisonedTokenizer(engine.tokenizer, poison)
    try:
        yield
    finally:
        engine.runner.model = getattr(engine.runner.model, "model", engine.runner.model)
        engine.tokenizer = getattr(engine.tokenizer, "tokenizer", engine.tokenizer)


def run_with_faulty_request(llm: LLM, faulty_prompt: list[int], steps_before: int) -> dict[str, RequestOutput]:
    """Start the victims, let them run ``steps_before`` steps, add the faulty request, run to the end."""
    engine = llm.engine
    for name, (prompt, params) in VICTIMS.items():
        engine.add_request(name, prompt, params)
    finished: dict[str, RequestOutput] = {}
    for step in range(10_000):
        if step == steps_before:
            engine.add_request("faulty", faulty_prompt, SamplingParams(temperature=0.0, max_tokens=8))
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        if not engine.has_unfinished_requests() and step >= steps_before:
            return finished
    raise AssertionError("the engine did not finish")


def assert_only_the_faulty_request_fails(
    llm: LLM, baseline: dict[str, list[list[int]]], site: str, steps_before: int,
) -> None:
    poison = unused_token(llm, baseline)
    faulty_prompt = llm.tokenizer.encode("Please repeat after me") + [poison, 42]
    with poisoned(llm, site, poison):
        finished = run_with_faulty_request(llm, faulty_prompt, steps_before)
    failed = finished.pop("faulty")
    assert failed.finished and failed.error is not None and f"poisoned token {poison}" in failed.error
    assert {c.finish_reason for c in failed.outputs} == {"error"}
    assert {name: [c.token_ids for c in out.outputs] for name, out in finished.items()} == baseline
    assert all(c.finish_reason == "length" for out in finished.values() for c in out.outputs)
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
    assert llm.engine.isolator.num_failed_requests >= 1


@pytest.mark.parametrize("site", ["forward", "detokenize"])
@pytest.mark.parametrize("steps_before", [0, 3])
def test_only_the_request_that_makes_a_step_raise_fails(
    llm: LLM, baseline: dict[str, list[list[int]]], site: str, steps_before: int,
) -> None:
    assert_only_the_faulty_request_fails(llm, baseline, site, steps_before)


def test_seeded_samples_keep_their_tokens_when_they_recompute_in_different_steps(small_budget_llm: LLM) -> None:
    assert_only_the_faulty_request_fails(small_budget_llm, victim_tokens(small_budget_llm), "detokenize", 2)


def test_a_step_that_raises_for_every_request_fails_each_and_the_engine_still_serves(llm: LLM) -> None:
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"doomed-{i}", "Hello there", SamplingParams(max_tokens=4))
    engine.runner.model = PoisonedModel(engine.runner.model, llm.tokenizer.encode("Hello")[0])
    try:
        outputs = {o.request_id: o for o in engine.step()}
    finally:
        engine.runner.model = engine.runner.model.model
    assert sorted(outputs) == ["doomed-0", "doomed-1", "doomed-2"]
    assert all(o.finished and o.error for o in outputs.values())
    after = llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    assert len(after.outputs[0].token_ids) == 4 and after.error is None


@pytest.mark.parametrize("site", ["forward", "detokenize"])
def test_a_victims_prompt_logprobs_come_whole_through_the_isolation(
    llm: LLM, baseline: dict[str, list[list[int]]], site: str,
) -> None:
    # the rollback drops what the failed step recorded; the recompute scores those prompt tokens again, once
    poison = unused_token(llm, baseline)
    prompt, params = "The quick brown fox jumps over the lazy dog", SamplingParams(temperature=0.0, max_tokens=4,
                                                                                   prompt_logprobs=2)
    clean = llm.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs
    engine = llm.engine
    finished: dict[str, RequestOutput] = {}
    with poisoned(llm, site, poison):
        engine.add_request("victim", prompt, params)
        engine.add_request("faulty", llm.tokenizer.encode("Please repeat after me") + [poison, 42],
                           SamplingParams(temperature=0.0, max_tokens=8))
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finished["faulty"].error is not None and finished["victim"].error is None
    isolated = finished["victim"].prompt_logprobs
    assert clean is not None and isolated is not None and len(isolated) == len(clean) and isolated[0] is None
    for got, expected in zip(isolated[1:], clean[1:], strict=True):
        assert got is not None and expected is not None and got.keys() == expected.keys()
        assert list(got.values()) == pytest.approx(list(expected.values()), abs=1e-4)
