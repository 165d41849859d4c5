"""Prompt logprobs (vLLM's ``prompt_logprobs``): each prompt token's logprob given the tokens before it, as
transformers computes it over the whole prompt, whatever chunking, prefix caching or batching the engine used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.hf_reference import hf_logprobs

PROMPT = "The quick brown fox jumps over the lazy dog because it wanted to see the other side of the river"


def _reference(folder: Path, prompt_ids: list[int]) -> torch.Tensor:
    """Row i: log-softmax of the logits predicting prompt token i + 1."""
    return hf_logprobs(folder, prompt_ids[:1], prompt_ids[1:])


def _check(prompt_logprobs: list[dict[int, float] | None] | None, prompt_ids: list[int], top: int,
           reference: torch.Tensor) -> None:
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for position, entry in enumerate(prompt_logprobs[1:], start=1):
        assert entry is not None
        expected = reference[position - 1]
        alternatives = set(expected.topk(top).indices.tolist()) if top else set()
        assert set(entry) == alternatives | {prompt_ids[position]}
        for token, value in entry.items():
            assert value == pytest.approx(float(expected[token]), abs=1e-4)


@pytest.mark.parametrize("top", [0, 2])
def test_prompt_logprobs_match_transformers(tiny_model_dir: Path, top: int) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float32", cpu_weight_packing="exact", kv_cache_memory="8MiB")
    prompt_ids = llm.tokenizer.encode(PROMPT)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=top), use_tqdm=False)[0]
    _check(out.prompt_logprobs, prompt_ids, top, _reference(tiny_model_dir, prompt_ids))
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_chunked_prefill_a_cached_prefix_and_n_samples_give_the_same_prompt_logprobs(tiny_model_dir: Path) -> None:
    # chunks of 8 tokens; the prompt's blocks are cached by the first request, which the second must not reuse
    llm = LLM(model=str(tiny_model_dir), dtype="float32", cpu_weight_packing="exact", kv_cache_memory="8MiB",
              max_num_batched_tokens=8, max_num_seqs=4, block_size=4, enable_prefix_caching=True)
    prompt_ids = llm.tokenizer.encode(PROMPT)
    reference = _reference(tiny_model_dir, prompt_ids)
    llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)  # fills the prefix cache
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=3, prompt_logprobs=1, n=2, seed=1),
                                           SamplingParams(max_tokens=3, prompt_logprobs=1)], use_tqdm=False)
    for out in outs:
        _check(out.prompt_logprobs, prompt_ids, 1, reference)


def test_prompt_logprobs_are_bounded_like_logprobs(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be None or an integer between 0 and 20"):
        SamplingParams(prompt_logprobs=21)
