"""Runs the attention kernels once per compiled variant at engine start, so Triton compiles them there.

A Triton kernel compiles (or loads from its disk cache) on the first launch of each combination of its
compile-time constants. The prefill kernel's row tile follows the longest run of new tokens (powers of two),
and decode has a one-partition and a split variant (the split one with its merge kernel): without a warm-up the
first request of each prompt-length bucket paid a compile inside its step (on an H200 a batch-1 decode benchmark
measured 4.22 ms a step with one inside, 1.07 without). vLLM warms its kernels at start for the same reason.
"""

from __future__ import annotations

import torch

from engine.cache_engine import CacheEngine
from paged_kernels.backend import KernelBackend
from paged_kernels.launch import PREFILL_ROWS_COMPILED

# The prefill kernel's row tile stops growing at its largest size (a token a row at least): a longer run of new
# tokens compiles nothing new, and prefilling one at start would only take memory (a 128k-token budget without
# chunked prefill would hold gigabytes of zeros).
LONGEST_PREFILL_WARMUP = max(PREFILL_ROWS_COMPILED)


def warmup_lengths(max_tokens: int) -> list[int]:
    """Runs of new tokens to warm: the powers of two up to ``max_tokens``, and ``max_tokens`` itself."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = [1 << power for power in range(max_tokens.bit_length()) if 1 << power <= max_tokens]
    return lengths if lengths[-1] == max_tokens else [*lengths, max_tokens]


@torch.inference_mode()
def compile_attention_kernels(
    ops: KernelBackend, cache: CacheEngine, num_heads: int, head_dim: int, max_new_tokens: int,
    max_context_len: int,
) -> None:
    """Prefill one sequence of each of ``warmup_lengths`` new tokens up to ``max_new_tokens`` (at most
    ``LONGEST_PREFILL_WARMUP``), and decode one sequence of one token of context and one of ``max_context_len``
    (as split as a one-sequence batch gets), reading the cache's first block over and over: nothing is written.
    The metadata has the engine's dtypes (int32 tables and lengths), which Triton compiles for."""
    key_cache, value_cache = cache.gpu_cache[0]
    block_size, device = key_cache.shape[1], key_cache.device

    def tables_and_lens(context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        tables = torch.zeros((1, -(-context_len // block_size)), dtype=torch.int32, device=device)
        return tables, torch.tensor([context_len], dtype=torch.int32, device=device)

    for length in warmup_lengths(min(max_new_tokens, LONGEST_PREFILL_WARMUP)):
        query = torch.zeros((length, num_heads, head_dim), dtype=key_cache.dtype, device=device)
        starts = torch.tensor([0, length], dtype=torch.int32, device=device)
        tables, lens = tables_and_lens(length)
        ops.paged_prefill_attention(query, key_cache, value_cache, tables, starts, lens, 1.0)
    query = torch.zeros((1, num_heads, head_dim), dtype=key_cache.dtype, device=device)
    for context_len in sorted({1, max_context_len}):
        ops.paged_attention_decode(query, key_cache, value_cache, *tables_and_lens(context_len), 1.0)
