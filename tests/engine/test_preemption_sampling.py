"""Seeded sampling gives the same tokens whether or not its requests were preempted (swapped or recomputed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.agreement import Sample, assert_agree_up_to_rounding
from tests.conftest import tiny_block_bytes

BLOCK_BYTES = tiny_block_bytes(dtype="float32")
PROMPTS = [f"Pressure number {i} on the cache" for i in range(4)]


def seeded_samples(llm: LLM) -> list[Sample]:
    params = [SamplingParams(n=2, seed=i, temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=0)
              for i in range(len(PROMPTS))]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(c.token_ids, [step[token] for step, token in zip(c.logprobs, c.token_ids)])
            for output in outputs for c in output.outputs]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_seeded_samples_of_preempted_requests_match_an_unpressured_run(tiny_model_dir: Path, mode: str) -> None:
    unpressured = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB")
    tight = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=8 * BLOCK_BYTES,
                swap_space=16 * BLOCK_BYTES, watermark=0.0, preemption_mode=mode)
    samples = seeded_samples(tight)
    stats = tight.stats()
    assert (stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute) > 0
    assert_agree_up_to_rounding(samples, seeded_samples(unpressured))
