"""A snapshot of the engine's cache, queues and cumulative counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    """Cache usage and waste, queue sizes, preemption/swap and token counters since start."""

    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    block_size: int
    kv_cache_usage: float
    cpu_cache_usage: float
    kv_cache_waste_ratio: float
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    num_preemptions_swap: int
    num_preemptions_recompute: int
    num_blocks_swapped_out: int
    num_blocks_swapped_in: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_steps: int
