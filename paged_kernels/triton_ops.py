"""Triton backend: the same functions and signatures as ``paged_kernels.reference``, for CUDA.

CPU <-> GPU swaps are plain copies, so they stay in torch.
"""

from __future__ import annotations

from paged_kernels.reference import fused_layer_ops, swap_blocks
from paged_kernels.triton_cache import copy_blocks, reshape_and_cache
from paged_kernels.triton_decode import paged_attention_decode, plan_decode, plan_decode_static
from paged_kernels.triton_prefill import paged_prefill_attention, plan_prefill
from paged_kernels.triton_tiles import interpreted

__all__ = [
    "compiles_on_first_launch",
    "copy_blocks",
    "fused_layer_ops",
    "paged_attention_decode",
    "paged_prefill_attention",
    "plan_decode",
    "plan_decode_static",
    "plan_prefill",
    "reshape_and_cache",
    "swap_blocks",
]


def compiles_on_first_launch() -> bool:
    """Whether Triton compiles (or loads from its disk cache) each variant of a kernel at its first launch: on
    CUDA, not in Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests), which compiles nothing."""
    return not interpreted()
