"""The engine service: one thread steps one engine for many concurrent requests."""

from __future__ import annotations

import time
from typing import Any

from engine import SamplingParams
from tests.engine.test_fault_isolation import PoisonedModel
from worker.engine_service import EngineService, RequestFailed, RequestHandle


def _collect(handle: RequestHandle, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        item = handle.outputs.get(timeout=max(0.0, deadline - time.monotonic()))
        if isinstance(item, Exception) or item.finished:
            return item


def test_concurrent_requests_share_engine_steps(service: EngineService) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0)
    handles = [service.submit(f"share-{i}", f"Request number {i}", params) for i in range(8)]
    outputs = [_collect(h) for h in handles]
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 12 for o in outputs)
    assert service.peak_num_running > 1


def test_bad_request_fails_on_its_handle_only(service: EngineService) -> None:
    too_long = service.submit("too-long", "word " * 600, SamplingParams(max_tokens=8))
    fine = service.submit("fine", "short", SamplingParams(max_tokens=2, temperature=0.0))
    error = _collect(too_long)
    assert isinstance(error, ValueError) and "context" in str(error)
    assert _collect(fine).outputs[0].finish_reason == "length"


def test_abort_frees_the_request_blocks_within_a_second(service: EngineService) -> None:
    engine = service.engine
    handle = service.submit("long", "Tell me everything", SamplingParams(max_tokens=400, ignore_eos=True))
    handle.outputs.get(timeout=30)
    assert engine.stats().num_free_blocks < engine.stats().num_total_blocks
    service.abort("long")
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and engine.stats().kv_cache_usage > 0.0:
        time.sleep(0.01)
    assert engine.stats().kv_cache_usage == 0.0 and engine.stats().num_running == 0


def test_a_request_that_breaks_a_step_fails_on_its_handle_only(service: EngineService) -> None:
    engine = service.engine
    poison = engine.tokenizer.encode("zebra")[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [f"Request number {i}" for i in range(3)]
    assert all(poison not in engine.tokenizer.encode(p) for p in prompts)
    expected = [_collect(service.submit(f"before-{i}", p, params)).outputs[0].token_ids for i, p in enumerate(prompts)]
    assert all(poison not in token_ids for token_ids in expected)
    engine.runner.model = PoisonedModel(engine.runner.model, poison)
    try:
        victims = [service.submit(f"victim-{i}", p, params) for i, p in enumerate(prompts[:2])]
        faulty = service.submit("faulty", "zebra zebra", params)
        victims.append(service.submit("victim-2", prompts[2], params))
        results = [_collect(h) for h in victims]
        error = _collect(faulty)
    finally:
        engine.runner.model = engine.runner.model.model
    assert isinstance(error, RequestFailed) and f"poisoned token {poison}" in str(error)
    assert [r.outputs[0].token_ids for r in results] == expected
