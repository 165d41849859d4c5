"""The worker healthcheck (`python -m worker.heartbeat`) and /readyz's live-worker lookup, on a real Redis."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from core import streams
from core.settings import Settings, configure
from tests.service.procs import free_port
from worker import heartbeat
from worker.metrics import WorkerMetrics, serve_metrics

REDIS_URL = "redis://127.0.0.1:6379/11"
MODEL = "tiny-llama"
ENGINE_STATS = {"num_running": 1, "num_waiting": 0, "num_swapped": 0, "num_cached_blocks": 0, "kv_cache_usage": 0.5,
                "cpu_cache_usage": 0.0, "kv_cache_waste_ratio": 0.1, "num_total_blocks": 8, "num_free_blocks": 4,
                "num_preemptions_swap": 0, "num_preemptions_recompute": 0, "num_blocks_swapped_out": 0,
                "num_blocks_swapped_in": 0, "prompt_tokens": 0, "generation_tokens": 0,
                "prefix_cache_queries": 0, "prefix_cache_hits": 0}


@pytest.fixture
def settings() -> Iterator[Settings]:
    """Settings on a Redis namespace of this test's own, and a free metrics port."""
    prefix = f"pstest:{uuid.uuid4().hex[:8]}:"
    installed = Settings(redis_url=REDIS_URL, redis_key_prefix=prefix, model=MODEL, metrics_port=free_port(),
                         engine_stall_timeout_s=60.0)
    configure(installed)
    yield installed
    client = streams.redis_client()
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)
    configure(None)


@pytest.fixture
def metrics(settings: Settings) -> WorkerMetrics:
    """A worker's metrics served on the settings' port, holding one running request."""
    registry = CollectorRegistry()
    served = WorkerMetrics(MODEL, registry)
    serve_metrics(settings.metrics_port, "127.0.0.1", registry=registry)
    served.observe_stats(ENGINE_STATS)
    return served


def test_a_worker_that_answers_steps_and_beats_is_healthy(metrics: WorkerMetrics) -> None:
    heartbeat.beat()
    assert heartbeat.unhealthy_reason() is None


def test_a_worker_whose_metrics_do_not_answer_is_unhealthy(settings: Settings) -> None:
    heartbeat.beat()
    assert "do not answer" in (heartbeat.unhealthy_reason() or "")


def test_an_engine_holding_work_without_a_step_past_the_timeout_is_unhealthy(metrics: WorkerMetrics) -> None:
    heartbeat.beat()
    metrics._last_step_s -= 61  # the timeout is 60 s
    assert "has not stepped for" in (heartbeat.unhealthy_reason() or "")


def test_a_worker_without_a_fresh_heartbeat_is_unhealthy(metrics: WorkerMetrics) -> None:
    assert "no fresh heartbeat" in (heartbeat.unhealthy_reason() or "")


def test_live_workers_are_those_beating_for_the_model(settings: Settings) -> None:
    assert heartbeat.live_workers(MODEL) == []
    heartbeat.beat()
    assert heartbeat.live_workers(MODEL) == [heartbeat.worker_id()]
    assert heartbeat.live_workers("another-model") == []
    heartbeat.forget()
    assert heartbeat.live_workers(MODEL) == []
