"""The kernel backend contract: what ``select_backend`` returns (``paged_kernels.reference`` or
``paged_kernels.triton_ops``).

Plans are opaque to the engine: a backend's ``plan_decode``/``plan_prefill`` make one per step and the first
layer's plan goes back to the same backend's attention call in every layer (``AttentionMetadata``).
``tests/kernels/test_backend_contract.py`` holds both backends to these signatures.
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

import torch

from paged_kernels.checks import HostTables

KernelPlan = object  # made and read by one backend only; the engine only carries it from layer to layer


class KernelBackend(Protocol):
    """Paged attention and KV-cache kernels over per-layer caches ``[num_blocks, block_size, kv_heads, head_dim]``."""

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          slot_range: tuple[int, int] | None = None) -> None: ...

    def plan_decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    host: HostTables | None = None) -> KernelPlan: ...

    def plan_decode_static(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor) -> KernelPlan | None:
        """A decode plan made from shapes alone, right for any values the tensors hold later (a CUDA
        graph replays it); ``None`` where the backend can only plan from the values."""
        ...

    def paged_attention_decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               plan: KernelPlan | None = None) -> torch.Tensor: ...

    def plan_prefill(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                     host: HostTables | None = None) -> KernelPlan: ...

    def paged_prefill_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                context_lens: torch.Tensor, scale: float,
                                plan: KernelPlan | None = None) -> torch.Tensor: ...

    def copy_blocks(self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                    block_mapping: torch.Tensor) -> None: ...

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None: ...

    def compiles_on_first_launch(self) -> bool:
        """Whether a kernel compiles at the first launch of each variant (Triton's JIT): the engine then launches
        every variant once at start (``engine/kernel_warmup.py``), not in a request's step."""
        ...

    def fused_layer_ops(self) -> ModuleType | None:
        """The compiled element-wise layer ops (residual add + RMS norm, rotary, SiLU * up; see
        ``LlamaForCausalLM.fuse_cpu_layer_ops``) the model may run with this backend; ``None``: plain torch."""
        ...
