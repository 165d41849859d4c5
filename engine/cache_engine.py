"""The KV cache tensors on the device and the CPU swap pool, and the block moves between them."""

from __future__ import annotations

import os
from types import ModuleType

import torch

from engine.block_manager import BlockMapping


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def default_kv_cache_bytes(device: torch.device, utilization: float) -> int:
    """The KV budget when none is given: on CUDA, as vLLM, `utilization` of the device's TOTAL memory less what
    this process already holds (the weights); on the CPU a tenth of the available memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)
        budget = int(total * utilization) - held
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization {utilization} of {total} bytes leaves nothing for the KV cache "
                             f"after the {held} bytes this process holds; raise it")
        if budget > free:
            raise ValueError(f"gpu_memory_utilization {utilization} asks for {budget} bytes of KV cache but only "
                             f"{free} are free (other processes hold the rest); lower it")
        return budget
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(available * 0.1)


class CacheEngine:
    """Per layer ``(key, value)`` tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    def __init__(
        self, num_layers: int, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
        num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, ops: ModuleType,
    ) -> None:
        self.ops = ops
        self.device = device
        gpu_shape = (num_gpu_blocks, block_size, num_kv_heads, head_dim)
        cpu_shape = (num_cpu_blocks, block_size, num_kv_heads, head_dim)
        pin = device.type == "cuda"
        self.gpu_cache = [
            (torch.zeros(gpu_shape, dtype=dtype, device=device), torch.zeros(gpu_shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        self.cpu_cache = [
            (torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin), torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin))
            for _ in range(num_layers)
        ]

    @staticmethod
    def _as_tensor(mapping: BlockMapping) -> torch.Tensor:
        return torch.tensor(mapping, dtype=torch.long).view(-1, 2)

    def swap_out(self, mapping: BlockMapping) -> None:
        """Copy device blocks to their CPU slots ``(gpu, cpu)``."""
        self._swap(self.gpu_cache, self.cpu_cache, mapping)

    def swap_in(self, mapping: BlockMapping) -> None:
        """Copy CPU blocks back to their device slots ``(cpu, gpu)``."""
        self._swap(self.cpu_cache, self.gpu_cache, mapping)

    def _swap(self, src: list, dst: list, mapping: BlockMapping) -> None:
        if not mapping:
            return
        pairs = self._as_tensor(mapping)
        for (src_k, src_v), (dst_k, dst_v) in zip(src, dst):
            self.ops.swap_blocks(src_k, dst_k, pairs)
            self.ops.swap_blocks(src_v, dst_v, pairs)

    def copy(self, mapping: BlockMapping) -> None:
        """Copy-on-write: duplicate device blocks ``(src, dst)`` in every layer."""
        if not mapping:
            return
        pairs = self._as_tensor(mapping).to(self.device)
        self.ops.copy_blocks([k for k, _ in self.gpu_cache], [v for _, v in self.gpu_cache], pairs)
