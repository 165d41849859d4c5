"""The engine service: one thread steps one engine for many concurrent requests."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib

from core import streams
from core.settings import Settings
from engine import LLMEngine, SamplingParams
from engine.outputs import CompletionOutput, RequestOutput
from tests.engine.test_fault_isolation import PoisonedModel
from worker.engine_service import EngineService, RequestFailed, RequestHandle
from worker.token_stream import TokenPublisher


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
    last = _collect(handle)  # the request's last output, with what it generated before the abort
    assert last.finished and last.outputs[0].finish_reason == "abort" and last.outputs[0].token_ids


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


def test_with_a_token_sink_a_handle_gets_its_first_tokens_and_its_end_after_the_sink_saw_them(
    service_model_dir: Path,
) -> None:
    sunk: list[tuple[str, int, bool]] = []  # (request id, tokens so far, finished) per output the sink got
    engine = LLMEngine.from_kwargs(model=str(service_model_dir), dtype="float32", kv_cache_memory="4MiB",
                                   max_num_seqs=4)
    sink = EngineService(engine, token_sink=lambda outputs: sunk.extend(
        (o.request_id, len(o.outputs[0].token_ids), o.finished) for o in outputs)).start()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    try:
        handles = [sink.submit(f"sink-{i}", f"Request number {i}", params) for i in range(2)]
        for handle in handles:
            first, last = handle.outputs.get(timeout=60), handle.outputs.get(timeout=60)
            assert len(first.outputs[0].token_ids) == 1 and not first.finished
            assert last.finished and len(last.outputs[0].token_ids) == 6
            assert (handle.request_id, 6, True) in sunk  # published before its job could record the end
            assert [n for rid, n, _ in sunk if rid == handle.request_id] == [1, 2, 3, 4, 5, 6]
            assert handle.outputs.empty()
    finally:
        sink.stop()


def test_token_publisher_sends_every_jobs_new_tokens_and_survives_a_redis_outage(
    service_settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def output(request_id: str, text: str, token_ids: list[int], finished: bool = False) -> RequestOutput:
        return RequestOutput(request_id, None, [1], [CompletionOutput(0, text, token_ids)], finished)

    redis = streams.redis_client()
    jobs = ("job-a", "job-b")
    redis.delete(*(streams.events_key(job) for job in jobs))
    publish = TokenPublisher()
    publish([output("job-a#1", "He", [5]), output("job-b#2", "Hi", [7])])
    publish([output("job-a#1", "Hello", [5, 6], finished=True), output("job-b#2", "Hi", [7])])
    events = {job: [json.loads(f["data"]) for _, f in redis.xrange(streams.events_key(job))] for job in jobs}
    assert events["job-a"] == [{"index": 0, "text": "He", "token_ids": [5], "text_offset": 0, "token_offset": 0},
                               {"index": 0, "text": "llo", "token_ids": [6], "text_offset": 2, "token_offset": 1}]
    assert events["job-b"] == [{"index": 0, "text": "Hi", "token_ids": [7], "text_offset": 0, "token_offset": 0}]
    with monkeypatch.context() as outage:
        outage.setattr(streams, "redis_client", lambda: redis_lib.Redis(port=1, socket_connect_timeout=0.2))
        publish([output("job-b#2", "Hi!", [7, 8])])  # logged, not raised: the engine thread goes on
    publish([output("job-b#2", "Hi!?", [7, 8, 9])])  # Redis is back: the step the outage lost goes with this one
    (_, retried) = [json.loads(f["data"]) for _, f in redis.xrange(streams.events_key("job-b"))]
    assert retried == {"index": 0, "text": "!?", "token_ids": [8, 9], "text_offset": 2, "token_offset": 1}


def test_token_publisher_sends_the_logprobs_of_the_new_tokens_where_asked_for(service_settings: Settings) -> None:
    def output(token_ids: list[int], logprobs: list[dict[int, float]]) -> RequestOutput:
        completion = CompletionOutput(0, "x" * len(token_ids), token_ids, logprobs=logprobs)
        return RequestOutput("job-lp#1", None, [1], [completion], False)

    redis = streams.redis_client()
    redis.delete(streams.events_key("job-lp"))
    publish = TokenPublisher()
    publish([output([5], [{5: -0.5, 9: -1.5}])])
    publish([output([5, 6, 7], [{5: -0.5, 9: -1.5}, {6: -0.25}, {7: -2.0, 5: -0.75}])])
    events = [json.loads(f["data"]) for _, f in redis.xrange(streams.events_key("job-lp"))]
    assert [e["logprobs"] for e in events] == [[{"5": -0.5, "9": -1.5}], [{"6": -0.25}, {"7": -2.0, "5": -0.75}]]


def test_start_building_loads_the_engine_on_the_thread_that_steps_it_and_raises_what_the_build_raised(
    service_model_dir: Path,
) -> None:
    builders: list[threading.Thread] = []

    def build() -> LLMEngine:
        builders.append(threading.current_thread())
        return LLMEngine.from_kwargs(model=str(service_model_dir), dtype="float32", kv_cache_memory="4MiB")

    built = EngineService.start_building(build)
    try:
        output = _collect(built.submit("built", "Hello", SamplingParams(max_tokens=3, temperature=0.0)))
        assert len(output.outputs[0].token_ids) == 3
        assert builders == [built._thread] and builders[0] is not threading.main_thread()
    finally:
        built.stop()

    def broken() -> LLMEngine:
        raise ValueError("max_num_seqs must be an integer >= 1, got 0")

    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineService.start_building(broken)


def test_a_structured_request_compiles_on_the_submitting_thread_not_the_engines(tiny_model_dir: Path) -> None:
    # the service is not started: nothing but submit itself can have compiled the grammar
    engine = LLMEngine.from_kwargs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB")
    service = EngineService(engine)
    date = {"regex": "20[0-9]{2}-[01][0-9]"}
    handle = service.submit("dated", "Today is", SamplingParams(max_tokens=16, structured_outputs=date))
    assert engine.grammars.is_compiled(date) and handle.outputs.empty()
    refused = service.submit("bad", "Today is", SamplingParams(max_tokens=4, structured_outputs={"regex": "[0-"}))
    error = refused.outputs.get_nowait()
    assert isinstance(error, ValueError) and "structured_outputs.regex" in str(error)
    service.start()
    try:
        output = _collect(handle)
        assert output.outputs[0].finish_reason == "stop" and len(output.outputs[0].text) == 7
    finally:
        service.stop()
