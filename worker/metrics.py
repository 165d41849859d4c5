"""A worker's Prometheus metrics: KV cache usage and waste, queues, preemption/swap, tokens, latencies, liveness.

Every series carries a `model_name` label, so dashboards and alerts can tell the engines of several models apart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.metrics import MetricWrapperBase

from core.logging import log_event

logger = logging.getLogger("pagedserve.metrics")
PREFIX = "pagedserve_"
PORT_ATTEMPTS = 100
# up to an hour: long generations and long queue waits must not all land in +Inf
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)
TOKEN_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
FINISH_REASONS = ("stop", "length", "abort")
# engine counter (cumulative in EngineStats) → (Prometheus counter attribute, label values or None)
_COUNTER_SOURCES: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "num_preemptions_swap": ("preemptions", ("swap",)),
    "num_preemptions_recompute": ("preemptions", ("recompute",)),
    "num_blocks_swapped_out": ("swapped_blocks", ("out",)),
    "num_blocks_swapped_in": ("swapped_blocks", ("in",)),
    "prompt_tokens": ("prompt_tokens", None),
    "generation_tokens": ("generation_tokens", None),
    "prefix_cache_queries": ("prefix_cache_queries", None),
    "prefix_cache_hits": ("prefix_cache_hits", None),
}


class WorkerMetrics:
    """The engine's metrics in one registry, fed by engine-stats snapshots and by each engine step."""

    def __init__(self, model_name: str, registry: CollectorRegistry = REGISTRY) -> None:
        self.model_name = model_name

        def gauge(name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
            return Gauge(PREFIX + name, doc, ["model_name", *labels], registry=registry)

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name", *labels], registry=registry)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=registry)

        self.cache_config = Info(PREFIX + "cache_config", "KV cache configuration of this worker", ["model_name"],
                                 registry=registry)
        self.kv_cache_usage = gauge("kv_cache_usage_ratio", "fraction of KV blocks in use per pool", ["pool"])
        self.kv_cache_waste = gauge("kv_cache_waste_ratio", "1 - filled token slots / slots in allocated blocks")
        self.kv_cache_blocks = gauge("kv_cache_blocks", "device KV blocks by state", ["state"])
        self.num_running = gauge("num_requests_running", "sequences running in the engine")
        self.num_waiting = gauge("num_requests_waiting", "sequences waiting for their first schedule")
        self.num_swapped = gauge("num_requests_swapped", "sequences preempted to the CPU swap pool")
        self.preemptions = counter("preemptions_total", "sequence preemptions by mode", ["mode"])
        self.swapped_blocks = counter("swapped_blocks_total", "KV blocks moved between pools", ["direction"])
        self.prompt_tokens = counter("prompt_tokens_total", "prompt tokens computed (prefill)")
        self.generation_tokens = counter("generation_tokens_total", "tokens generated")
        self.prefix_cache_queries = counter("prefix_cache_queries_total", "prompt blocks looked up in the prefix cache")
        self.prefix_cache_hits = counter("prefix_cache_hits_total", "prompt blocks found in the prefix cache")
        self.request_success = counter("request_success_total", "finished requests by finish reason", ["finish_reason"])
        self.time_to_first_token = histogram("time_to_first_token_seconds", "arrival to first token", LATENCY_BUCKETS_S)
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "mean time between output tokens of a request", TOKEN_LATENCY_BUCKETS_S)
        self.e2e_latency = histogram("e2e_request_latency_seconds", "arrival to finish", LATENCY_BUCKETS_S)
        self.queue_time = histogram("queue_time_seconds", "arrival to first schedule", LATENCY_BUCKETS_S)
        self.batch_size = histogram("batch_size", "sequences in one engine step", BATCH_SIZE_BUCKETS)
        self.step_duration = histogram("step_duration_seconds", "wall time of one engine step", TOKEN_LATENCY_BUCKETS_S)
        self.last_step_time = gauge("engine_last_step_timestamp_seconds", "Unix time of the engine's last step")
        self.stalled = gauge("engine_stalled_seconds", "seconds since the last engine step while the engine holds "
                             "work (0 when idle)")
        self._last_counts: dict[str, int] = {}
        self._last_step_s = time.time()  # the engine has not stepped yet, so it has not stalled yet either
        self._work_pending = False
        # computed at scrape time: a hung engine thread updates nothing, so only the scrape can see time pass
        self._labels(self.stalled).set_function(self.stalled_seconds)
        for pool in ("gpu", "cpu"):  # label children exist from the start, so every series shows at once
            self._labels(self.kv_cache_usage, pool)
        for state in ("free", "used", "cached"):
            self._labels(self.kv_cache_blocks, state)
        for attr, labels in _COUNTER_SOURCES.values():
            self._labels(getattr(self, attr), *(labels or ()))
        for reason in FINISH_REASONS:
            self._labels(self.request_success, reason)
        for metric in (self.kv_cache_waste, self.num_running, self.num_waiting, self.num_swapped,
                       self.time_to_first_token, self.time_per_output_token, self.e2e_latency, self.queue_time,
                       self.batch_size, self.step_duration, self.last_step_time):
            self._labels(metric)

    def _labels(self, metric: MetricWrapperBase, *values: str) -> Any:
        """The metric's child for this worker's model and the given label values."""
        return metric.labels(self.model_name, *values)

    def stalled_seconds(self) -> float:
        """Seconds since the last engine step while the last stats snapshot showed pending work; 0 when idle."""
        return max(0.0, time.time() - self._last_step_s) if self._work_pending else 0.0

    def set_cache_config(self, engine: Any) -> None:
        """Publish the engine's cache configuration as the info metric."""
        self._labels(self.cache_config).info({
            "model": str(engine.model_name),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(engine.kv_cache_dtype).removeprefix("torch."),
            "device": str(engine.device),
            "block_size": str(engine.config.block_size),
            "num_gpu_blocks": str(engine.num_gpu_blocks),
            "num_cpu_blocks": str(engine.num_cpu_blocks),
        })

    def observe_stats(self, stats: dict[str, Any]) -> None:
        """Set gauges from an engine-stats snapshot and advance counters by its cumulative deltas."""
        cached = stats["num_cached_blocks"]
        self._labels(self.kv_cache_usage, "gpu").set(stats["kv_cache_usage"])
        self._labels(self.kv_cache_usage, "cpu").set(stats["cpu_cache_usage"])
        self._labels(self.kv_cache_waste).set(stats["kv_cache_waste_ratio"])
        self._labels(self.kv_cache_blocks, "used").set(stats["num_total_blocks"] - stats["num_free_blocks"])
        # free blocks hold cached prefixes too
        self._labels(self.kv_cache_blocks, "free").set(stats["num_free_blocks"] - cached)
        self._labels(self.kv_cache_blocks, "cached").set(cached)
        self._labels(self.num_running).set(stats["num_running"])
        self._labels(self.num_waiting).set(stats["num_waiting"])
        self._labels(self.num_swapped).set(stats["num_swapped"])
        self._work_pending = stats["num_running"] + stats["num_waiting"] + stats["num_swapped"] > 0
        for source, (attr, labels) in _COUNTER_SOURCES.items():
            delta = stats[source] - self._last_counts.get(source, 0)
            self._last_counts[source] = stats[source]
            if delta > 0:
                self._labels(getattr(self, attr), *(labels or ())).inc(delta)

    def observe_step(self, duration_s: float, outputs: Sequence[Any]) -> None:
        """Record one engine step: its time, duration and batch size, and the latencies of requests it finished."""
        self._last_step_s = time.time()
        self._labels(self.last_step_time).set(self._last_step_s)
        for output in outputs:
            if output.finished:
                self._observe_finished(output)
        live = [o for o in outputs if not any(c.finish_reason == "abort" for c in o.outputs)]
        if live:  # a step that only reports aborted requests ran no batch
            self._labels(self.step_duration).observe(duration_s)
            self._labels(self.batch_size).observe(sum(len(o.outputs) for o in live))

    def _observe_finished(self, output: Any) -> None:
        reason = output.outputs[0].finish_reason or "stop"
        self._labels(self.request_success, reason).inc()
        m = output.metrics
        if reason == "abort" or m.finished_time is None:
            return
        self._labels(self.e2e_latency).observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self._labels(self.queue_time).observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is None:
            return
        self._labels(self.time_to_first_token).observe(m.first_token_time - m.arrival_time)
        num_tokens = max(len(c.token_ids) for c in output.outputs)
        if num_tokens > 1:
            self._labels(self.time_per_output_token).observe(
                (m.finished_time - m.first_token_time) / (num_tokens - 1))


def serve_metrics(port: int, host: str, registry: CollectorRegistry = REGISTRY) -> int:
    """Serve `registry` on /metrics at `host`:`port`, or the next free port after it; return the port used."""
    for candidate in range(port, port + PORT_ATTEMPTS):
        try:
            start_http_server(candidate, addr=host, registry=registry)
        except OSError:
            continue
        log_event(logger, "metrics.serving", host=host, port=candidate, requested_port=port)
        return candidate
    raise OSError(f"no free metrics port in {port}..{port + PORT_ATTEMPTS - 1}")
