"""A snapshot of the engine's cache, queues and cumulative counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler


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


def snapshot(scheduler: Scheduler, manager: BlockManager, num_steps: int) -> EngineStats:
    """The engine's stats now, from its scheduler and block manager."""
    running = scheduler.running_seqs()
    num_waiting, num_swapped = scheduler.num_queued_seqs()
    usage = manager.usage(running)
    slots = usage.num_used_blocks * manager.block_size
    counters = scheduler.counters
    num_gpu_blocks, num_cpu_blocks = manager.gpu.num_blocks, manager.cpu.num_blocks
    num_free_cpu = manager.cpu.num_free_blocks
    return EngineStats(
        num_total_blocks=num_gpu_blocks,
        num_free_blocks=manager.num_free_gpu_blocks,
        num_cached_blocks=usage.num_cached_free_blocks,
        num_cpu_blocks=num_cpu_blocks,
        num_free_cpu_blocks=num_free_cpu,
        block_size=manager.block_size,
        kv_cache_usage=usage.num_used_blocks / num_gpu_blocks,
        cpu_cache_usage=(1 - num_free_cpu / num_cpu_blocks) if num_cpu_blocks else 0.0,
        kv_cache_waste_ratio=(1 - usage.num_filled_slots / slots) if slots else 0.0,
        num_running=len(running),
        num_waiting=num_waiting,
        num_swapped=num_swapped,
        num_preemptions=counters.num_preemptions,
        num_preemptions_swap=counters.num_preemptions_swap,
        num_preemptions_recompute=counters.num_preemptions_recompute,
        num_blocks_swapped_out=counters.num_blocks_swapped_out,
        num_blocks_swapped_in=counters.num_blocks_swapped_in,
        prompt_tokens=counters.prompt_tokens,
        generation_tokens=counters.generation_tokens,
        prefix_cache_queries=manager.num_prefix_queries,
        prefix_cache_hits=manager.num_prefix_hits,
        num_steps=num_steps,
    )
