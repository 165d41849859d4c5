"""Worker metrics follow a real tiny engine run through the engine service, under a tight KV budget."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig
from tests.conftest import tiny_block_bytes
from worker.engine_service import EngineService, RequestHandle
from worker.metrics import WorkerMetrics, serve_metrics

NUM_REQUESTS = 6
MAX_TOKENS = 40
MODEL_NAME = "tiny-llama"


@pytest.fixture(scope="module")
def registry() -> CollectorRegistry:
    """A registry of this module's own."""
    return CollectorRegistry()


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    """A tiny engine with room for about 8 blocks: six 40-token requests must preempt each other."""
    return LLMEngine.from_kwargs(
        model=str(tiny_model_dir), dtype="float32", kv_cache_memory=8 * tiny_block_bytes(dtype="float32"),
        swap_space="1MiB",
        max_num_seqs=8, block_size=16, preemption_mode="swap",
    )


def _final_output(handle: RequestHandle) -> object:
    item = handle.outputs.get(timeout=120)
    while not (isinstance(item, Exception) or item.finished):
        item = handle.outputs.get(timeout=120)
    return item


@pytest.fixture(scope="module")
def ran(engine: LLMEngine, registry: CollectorRegistry) -> Iterator[WorkerMetrics]:
    """Metrics after six requests ran to completion, with one more stats report after the last step."""
    metrics = WorkerMetrics(MODEL_NAME, registry)
    metrics.set_cache_config(engine)
    service = EngineService(engine, on_stats=metrics.observe_stats, on_step=metrics.observe_step).start()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    handles = [service.submit(f"r{i}", f"Request {i} says hello to the engine", params) for i in range(NUM_REQUESTS)]
    outputs = [_final_output(h) for h in handles]
    assert all(not isinstance(o, Exception) for o in outputs)
    service.stop()
    metrics.observe_stats(service.snapshot())  # the stepping thread has stopped: the engine is ours to read
    yield metrics


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, {"model_name": MODEL_NAME, **labels})
    assert value is not None, f"{name}{labels} is not exported"
    return value


def test_token_counters_count_every_prompt_and_generated_token(ran: WorkerMetrics, registry: CollectorRegistry) -> None:
    assert _value(registry, "pagedserve_generation_tokens_total") == NUM_REQUESTS * MAX_TOKENS
    assert _value(registry, "pagedserve_prompt_tokens_total") >= NUM_REQUESTS * 5


def test_tight_kv_budget_moves_preemption_and_swap_counters(ran: WorkerMetrics, registry: CollectorRegistry) -> None:
    preemptions = _value(registry, "pagedserve_preemptions_total", mode="swap")
    assert preemptions > 0
    assert _value(registry, "pagedserve_preemptions_total", mode="recompute") == 0
    assert _value(registry, "pagedserve_swapped_blocks_total", direction="out") >= preemptions
    assert _value(registry, "pagedserve_swapped_blocks_total", direction="in") > 0


def test_step_histograms_count_batches_larger_than_one(ran: WorkerMetrics, registry: CollectorRegistry) -> None:
    steps = _value(registry, "pagedserve_batch_size_count")
    assert steps >= MAX_TOKENS
    assert _value(registry, "pagedserve_step_duration_seconds_count") == steps
    assert _value(registry, "pagedserve_batch_size_sum") / steps > 1
    assert _value(registry, "pagedserve_batch_size_bucket", le="1.0") < steps


def test_request_latency_histograms_count_each_finished_request(
    ran: WorkerMetrics, registry: CollectorRegistry
) -> None:
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "queue_time_seconds"):
        assert _value(registry, f"pagedserve_{name}_count") == NUM_REQUESTS, name
    assert _value(registry, "pagedserve_request_success_total", finish_reason="length") == NUM_REQUESTS
    ttft = _value(registry, "pagedserve_time_to_first_token_seconds_sum")
    assert 0 < ttft <= _value(registry, "pagedserve_e2e_request_latency_seconds_sum")


def test_idle_engine_gauges_show_an_empty_cache(
    ran: WorkerMetrics, registry: CollectorRegistry, engine: LLMEngine
) -> None:
    assert _value(registry, "pagedserve_kv_cache_usage_ratio", pool="gpu") == 0.0
    assert 0.0 <= _value(registry, "pagedserve_kv_cache_waste_ratio") <= 1.0
    assert _value(registry, "pagedserve_kv_cache_blocks", state="used") == 0
    free = _value(registry, "pagedserve_kv_cache_blocks", state="free")
    assert free + _value(registry, "pagedserve_kv_cache_blocks", state="cached") == engine.num_gpu_blocks
    for queue in ("running", "waiting", "swapped"):
        assert _value(registry, f"pagedserve_num_requests_{queue}") == 0


def test_busy_engine_reports_kv_usage_and_waste_below_one_block_per_sequence(engine: LLMEngine) -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(MODEL_NAME, registry)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"busy{i}", f"A prompt of some length number {i}", params)
    engine.step()
    stats = engine.stats()
    metrics.observe_stats(asdict(stats))
    assert _value(registry, "pagedserve_kv_cache_usage_ratio", pool="gpu") > 0
    used_slots = _value(registry, "pagedserve_kv_cache_blocks", state="used") * stats.block_size
    wasted_slots = _value(registry, "pagedserve_kv_cache_waste_ratio") * used_slots
    assert stats.num_running == 3 and wasted_slots < stats.num_running * stats.block_size
    while engine.has_unfinished_requests():
        engine.step()


def test_cache_config_info_names_model_dtype_and_blocks(ran: WorkerMetrics, registry: CollectorRegistry,
                                                        engine: LLMEngine) -> None:
    # the cache's own dtype, as the configuration resolves it (an fp32 model's is fp16 where its weights are)
    expected = EngineConfig(model=str(engine.model_name), dtype="float32").kv_cache_torch_dtype()
    cache_dtype = str(expected).removeprefix("torch.")
    labels = {"model": str(engine.model_name), "dtype": "float32", "kv_cache_dtype": cache_dtype, "device": "cpu",
              "block_size": "16",
              "num_gpu_blocks": str(engine.num_gpu_blocks), "num_cpu_blocks": str(engine.num_cpu_blocks)}
    assert _value(registry, "pagedserve_cache_config_info", **labels) == 1.0


def test_metrics_server_moves_to_the_next_port_when_taken(registry: CollectorRegistry) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        served = serve_metrics(port, host="127.0.0.1", registry=registry)
    assert served > port
    body = urllib.request.urlopen(f"http://127.0.0.1:{served}/metrics", timeout=5).read().decode()
    assert "pagedserve_kv_cache_waste_ratio" in body
