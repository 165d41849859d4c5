"""The process-wide engine service, built once from the settings (this is where torch gets imported)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from core.logging import log_event
from core.settings import Settings, get_settings
from worker import heartbeat
from worker.engine_service import EngineService
from worker.metrics import WorkerMetrics
from worker.token_stream import TokenPublisher

logger = logging.getLogger("pagedserve.worker")
_lock = threading.Lock()
_service: EngineService | None = None


def engine_kwargs(settings: Settings) -> dict[str, Any]:
    """LLMEngine keyword arguments from the service settings (unset ones keep the engine's defaults)."""
    kwargs: dict[str, Any] = {
        "model": settings.model,
        "dtype": settings.dtype,
        "kv_cache_dtype": settings.kv_cache_dtype,
        "block_size": settings.block_size,
        "swap_space": settings.swap_space,
        "max_num_seqs": settings.max_num_seqs,
        "preemption_mode": settings.preemption_mode,
        "scheduling_policy": "priority",
        "cpu_weight_packing": settings.cpu_weight_packing,
        "quantization": settings.quantization,
        "max_model_len": settings.max_model_len,
        "enforce_eager": settings.enforce_eager,
        "cuda_graph_max_batch": settings.cuda_graph_max_batch,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "seed": settings.seed,
        "tokenizer": str(settings.tokenizer) if settings.tokenizer else None,
    }
    if settings.kv_cache_memory:
        kwargs["kv_cache_memory"] = settings.kv_cache_memory
    if settings.attention_backend:
        kwargs["attention_backend"] = settings.attention_backend
    if settings.num_threads:
        kwargs["num_threads"] = settings.num_threads
    return kwargs


def engine_service() -> EngineService:
    """This process's engine service, loading the model on first use."""
    global _service
    with _lock:
        if _service is None:
            from engine import LLMEngine

            settings = get_settings()
            metrics = WorkerMetrics(settings.model)
            _service = EngineService.start_building(
                lambda: LLMEngine.from_kwargs(**engine_kwargs(settings)),
                on_stats=_reporter(metrics), on_step=metrics.observe_step, token_sink=TokenPublisher())
            engine = _service.engine
            metrics.set_cache_config(engine)
            log_event(logger, "engine.ready", model=settings.model, worker_id=heartbeat.worker_id(),
                      max_model_len=engine.max_model_len)
        return _service


def _reporter(metrics: WorkerMetrics) -> Callable[[dict[str, Any]], None]:
    """The stats callback: metrics first, then the heartbeat."""

    def report(stats: dict[str, Any]) -> None:
        metrics.observe_stats(stats)  # before the beat: a Redis outage must not freeze the metrics
        heartbeat.beat(stats)

    return report


def sampling_params_class() -> type:
    """The engine's SamplingParams class."""
    from engine import SamplingParams

    return SamplingParams
