"""Triton backend: the same functions and signatures as ``kernels.reference``, for CUDA.

CPU <-> GPU swaps and context gathering are plain copies, so they stay in torch.
"""

from __future__ import annotations

from kernels.reference import gather_context, swap_blocks
from kernels.triton_cache import copy_blocks, reshape_and_cache
from kernels.triton_decode import paged_attention_decode
from kernels.triton_prefill import paged_prefill_attention

__all__ = [
    "copy_blocks",
    "gather_context",
    "paged_attention_decode",
    "paged_prefill_attention",
    "reshape_and_cache",
    "swap_blocks",
]
