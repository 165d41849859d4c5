"""Engine liveness: the last step's time, and the stall gauge that grows only while the engine holds work."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from engine import LLMEngine, SamplingParams
from worker.metrics import WorkerMetrics

MODEL_NAME = "tiny-llama"


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    """A tiny engine."""
    return LLMEngine.from_kwargs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="64KiB",
                                 max_num_seqs=4, block_size=16)


def _sample(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(name, {"model_name": MODEL_NAME})
    assert value is not None, f"{name} is not exported"
    return value


def test_a_step_sets_the_last_step_time(engine: LLMEngine) -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(MODEL_NAME, registry)
    before = time.time()
    engine.add_request("step", "Liveness says hello", SamplingParams(max_tokens=2, temperature=0.0))
    started = time.perf_counter()
    outputs = engine.step()
    metrics.observe_step(time.perf_counter() - started, outputs)
    assert _sample(registry, "pagedserve_engine_last_step_timestamp_seconds") >= before
    while engine.has_unfinished_requests():
        engine.step()


def test_an_idle_engine_is_not_stalled_however_long_ago_it_stepped(engine: LLMEngine) -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(MODEL_NAME, registry)
    metrics.observe_stats(asdict(engine.stats()))
    metrics._last_step_s -= 3600  # an hour without a step, and nothing to do
    assert _sample(registry, "pagedserve_engine_stalled_seconds") == 0


def test_an_engine_holding_work_without_stepping_is_stalled_for_the_time_since_its_last_step(
    engine: LLMEngine,
) -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(MODEL_NAME, registry)
    engine.add_request("held", "A request the engine holds", SamplingParams(max_tokens=2, temperature=0.0))
    metrics.observe_stats(asdict(engine.stats()))  # waiting: 1
    metrics._last_step_s -= 600
    assert _sample(registry, "pagedserve_engine_stalled_seconds") >= 600
    outputs = engine.step()
    metrics.observe_step(0.01, outputs)
    assert _sample(registry, "pagedserve_engine_stalled_seconds") < 600
    while engine.has_unfinished_requests():
        engine.step()
