"""Beam search, priority scheduling and prefix caching on the paged engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.llm_engine import CPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET, default_token_budget
from tests.conftest import tiny_block_bytes
from tests.engine.hf_reference import hf_beam

PROMPTS = ["The quick brown fox", "Hello, my name is", "In the beginning there was"]


def tiny_llm(folder: Path, **kwargs: object) -> LLM:
    return LLM(model=str(folder), dtype="float32", **{"kv_cache_memory": "8MiB", **kwargs})


@pytest.mark.parametrize("beam_width", [2, 4])
def test_beam_search_best_matches_transformers(tiny_model_dir: Path, beam_width: int) -> None:
    llm = tiny_llm(tiny_model_dir)
    outputs = llm.beam_search(PROMPTS, beam_width=beam_width, max_tokens=10, ignore_eos=True, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert len(output.outputs) == beam_width
        scores = [o.cumulative_logprob for o in output.outputs]
        assert scores == sorted(scores, reverse=True)
        assert output.outputs[0].token_ids == hf_beam(tiny_model_dir, prompt, beam_width, 10)
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


def peak_used_blocks(llm: LLM, requests: list[tuple[str, SamplingParams]]) -> int:
    for i, (prompt, params) in enumerate(requests):
        llm.engine.add_request(str(i), prompt, params)
    peak = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        stats = llm.stats()
        peak = max(peak, stats.num_total_blocks - stats.num_free_blocks)
    return peak


def test_beam_search_shares_blocks_between_beams(tiny_model_dir: Path) -> None:
    prompt = " ".join(["token"] * 80)
    beams = SamplingParams(beam_width=4, max_tokens=12, temperature=0.0, ignore_eos=True)
    single = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    shared = peak_used_blocks(tiny_llm(tiny_model_dir, enable_prefix_caching=False), [(prompt, beams)])
    separate = peak_used_blocks(tiny_llm(tiny_model_dir, enable_prefix_caching=False), [(prompt, single)] * 4)
    assert shared < separate * 0.6


def test_high_priority_request_overtakes_a_full_batch(tiny_model_dir: Path) -> None:
    llm = tiny_llm(tiny_model_dir, scheduling_policy="priority", max_num_seqs=2)
    engine = llm.engine
    slow = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"low-{i}", PROMPTS[i], slow, priority=5)
    engine.step()
    engine.step()
    engine.add_request("urgent", PROMPTS[0], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order[0] == "urgent"
    assert llm.stats().num_preemptions >= 1


def test_prefix_cache_reuses_blocks_and_keeps_outputs(tiny_model_dir: Path) -> None:
    prefix = "You are a helpful assistant. " * 12
    prompts = [prefix + "Question one?", prefix + "Question two?"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cached = tiny_llm(tiny_model_dir)
    first = cached.generate(prompts[:1], params, use_tqdm=False)
    prompt_tokens_before = cached.stats().prompt_tokens
    second = cached.generate(prompts[1:], params, use_tqdm=False)
    stats = cached.stats()
    computed = stats.prompt_tokens - prompt_tokens_before
    assert stats.prefix_cache_hits > 0
    assert computed < len(second[0].prompt_token_ids) // 2
    # each output says how many of its prompt's tokens the cache served: those the engine did not compute
    assert first[0].num_cached_tokens == 0
    assert second[0].num_cached_tokens == len(second[0].prompt_token_ids) - computed
    assert second[0].num_cached_tokens % cached.engine.config.block_size == 0
    uncached = tiny_llm(tiny_model_dir, enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    assert [first[0].outputs[0].token_ids, second[0].outputs[0].token_ids] == [o.outputs[0].token_ids for o in uncached]
    assert [output.num_cached_tokens for output in uncached] == [0, 0]


def test_prefix_cache_hits_evicts_under_pressure_and_hits_again_with_unchanged_outputs(tiny_model_dir: Path) -> None:
    block_bytes = tiny_block_bytes(dtype="float32")
    # 50 tokens: 3 full blocks the cache can serve (the last token is always computed), 4 blocks with the output
    cached_prompt = list(range(1000, 1050))
    fillers = [list(range(2000 + 100 * i, 2050 + 100 * i)) for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = tiny_llm(tiny_model_dir, enable_prefix_caching=False).generate(cached_prompt, params, use_tqdm=False)
    small = tiny_llm(tiny_model_dir, kv_cache_memory=10 * block_bytes, watermark=0.0)
    assert small.stats().num_total_blocks == 10

    def new_hits_generating_the_cached_prompt() -> int:
        hits_before = small.stats().prefix_cache_hits
        output = small.generate(cached_prompt, params, use_tqdm=False)
        assert output[0].outputs[0].token_ids == reference[0].outputs[0].token_ids
        return small.stats().prefix_cache_hits - hits_before

    assert new_hits_generating_the_cached_prompt() == 0  # cold cache
    assert new_hits_generating_the_cached_prompt() == 3
    for filler in fillers:  # 12 blocks through a 10-block cache: the oldest cached prefix goes first
        small.generate(filler, params, use_tqdm=False)
    assert new_hits_generating_the_cached_prompt() == 0  # evicted, recomputed and cached again
    assert new_hits_generating_the_cached_prompt() == 3
    small.engine.block_manager.gpu.check_invariants()


def test_running_sequences_decode_every_step_during_a_long_chunked_prefill(tiny_model_dir: Path) -> None:
    llm = tiny_llm(tiny_model_dir, max_num_batched_tokens=32, max_num_seqs=4)
    engine = llm.engine
    engine.add_request("running", PROMPTS[0], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    engine.step()
    long_prompt = list(range(1000, 1300))
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    prefill_steps = 0
    while True:
        outputs = {o.request_id: o for o in engine.step()}
        assert "running" in outputs  # a token for the running request in every step
        if outputs.get("long") and outputs["long"].outputs[0].token_ids:
            break
        prefill_steps += 1
    assert prefill_steps >= len(long_prompt) // 32 - 1  # the prompt really was spread over many steps


@pytest.mark.parametrize(
    ("kwargs", "budget"),
    [
        ({}, CPU_TOKEN_BUDGET),  # the CPU's own default
        ({"max_num_seqs": CPU_TOKEN_BUDGET + 8}, CPU_TOKEN_BUDGET + 8),  # every running sequence decodes each step
        ({"max_num_batched_tokens": 100}, 100),  # asked for
        ({"enable_chunked_prefill": False, "max_model_len": 512}, GPU_TOKEN_BUDGET),  # prompts computed whole
    ],
)
def test_a_cpu_engine_steps_its_default_token_budget(tiny_model_dir: Path, kwargs: dict, budget: int,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="engine.llm_engine"):
        llm = tiny_llm(tiny_model_dir, device="cpu", **kwargs)
    assert llm.engine.scheduler.token_budget == budget
    assert f"max_num_batched_tokens={budget} " in caplog.text  # the operator sees the budget in effect
    if budget == CPU_TOKEN_BUDGET:  # a prompt longer than the budget is prefilled over several steps
        llm.engine.add_request("long", list(range(1000, 1000 + 2 * CPU_TOKEN_BUDGET - 8)),
                               SamplingParams(max_tokens=1, ignore_eos=True))
        steps = 0
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            steps += 1
        assert steps == 2


def test_the_default_token_budget_follows_the_device_and_chunked_prefill() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert default_token_budget(cuda, True, 4096) == GPU_TOKEN_BUDGET
    assert default_token_budget(cpu, True, 4096) == CPU_TOKEN_BUDGET
    assert default_token_budget(torch.device("meta"), True, 4096) == CPU_TOKEN_BUDGET  # any device but CUDA
    assert default_token_budget(cpu, False, 512) == GPU_TOKEN_BUDGET
    assert default_token_budget(cpu, False, 8192) == default_token_budget(cuda, False, 8192) == 8192


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, "max_num_batched_tokens"),
        ({"preemption_mode": "drop"}, "preemption_mode"),
        ({"scheduling_policy": "random"}, "scheduling_policy"),
        ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
        ({"block_size": 0}, "block_size"),
        ({"kv_cache_memory": 1000}, "kv_cache_memory"),
        ({"num_threads": 0}, "num_threads"),
    ],
)
def test_bad_engine_arguments_name_the_argument(tiny_model_dir: Path, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        tiny_llm(tiny_model_dir, **kwargs)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_beam_search_survives_preemption(tiny_model_dir: Path, mode: str) -> None:
    block_bytes = tiny_block_bytes(dtype="float32")
    reference = tiny_llm(tiny_model_dir).beam_search(PROMPTS, beam_width=3, max_tokens=24, ignore_eos=True,
                                                     use_tqdm=False)
    tight = tiny_llm(tiny_model_dir, kv_cache_memory=10 * block_bytes, watermark=0.0, preemption_mode=mode,
                     max_num_batched_tokens=8, max_num_seqs=8)
    outputs = tight.beam_search(PROMPTS, beam_width=3, max_tokens=24, ignore_eos=True, use_tqdm=False)
    assert tight.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    assert tight.stats().num_free_blocks == tight.stats().num_total_blocks


def test_abort_frees_blocks_of_running_waiting_and_swapped_requests(tiny_model_dir: Path) -> None:
    block_bytes = tiny_block_bytes(dtype="float32")
    llm = tiny_llm(tiny_model_dir, kv_cache_memory=8 * block_bytes, watermark=0.0, max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", PROMPTS[i % 3] * 2, params)
    while not engine.scheduler.swapped:
        engine.step()
    states = {"running": engine.scheduler.running[0], "swapped": engine.scheduler.swapped[0],
              "waiting": engine.scheduler.waiting[0]}
    for group in states.values():
        engine.abort_request(group.request_id)
    aborted = {o.request_id: o for o in engine.step() if o.finished}
    assert {g.request_id for g in states.values()} <= set(aborted)
    assert all(o.outputs[0].finish_reason == "abort" for o in aborted.values())
    while engine.has_unfinished_requests():
        engine.step()
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_free_cpu_blocks == stats.num_cpu_blocks


@pytest.mark.parametrize(("field", "params"), [
    ("n", SamplingParams(n=3, max_tokens=2)),
    ("beam_width", SamplingParams(beam_width=3, max_tokens=2)),
])
def test_a_request_wider_than_one_step_is_refused_and_blocks_no_one(
    tiny_model_dir: Path, field: str, params: SamplingParams
) -> None:
    llm = tiny_llm(tiny_model_dir, max_num_seqs=2)
    with pytest.raises(ValueError, match=rf"^{field} \(3\) exceeds max_num_seqs \(2\)"):
        llm.engine.add_request("wide", "Hello there", params)
    (fits,) = llm.generate(["Hello there"], SamplingParams(n=2, max_tokens=2, temperature=1.0, seed=1))
    assert [len(c.token_ids) for c in fits.outputs] == [2, 2]
