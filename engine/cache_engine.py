"""The KV cache tensors on the device and the CPU swap pool, and the block moves between them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.block_manager import BlockMapping


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def blocks_in_budget(budget: int, block_bytes: int) -> int:
    """The KV blocks a budget of ``budget`` bytes holds; ValueError naming kv_cache_memory below two."""
    blocks = budget // block_bytes
    if blocks < 2:
        raise ValueError(f"kv_cache_memory of {budget} bytes holds {blocks} blocks of {block_bytes} bytes; "
                         "at least 2 are needed")
    return blocks


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


def _split(mapping: BlockMapping, num_src: int, num_dst: int) -> tuple[list[int], list[int]]:
    """The source and destination ids of ``(src, dst)`` pairs, checked on the host (no device sync)."""
    src, dst = [pair[0] for pair in mapping], [pair[1] for pair in mapping]
    for name, ids, limit in (("source", src, num_src), ("destination", dst, num_dst)):
        if min(ids) < 0 or max(ids) >= limit:
            raise ValueError(f"block mapping {name} ids must be in [0, {limit}), got {min(ids)}..{max(ids)}")
    return src, dst


class CacheEngine:
    """The device cache ``[layers, 2 (key, value), blocks, block_size, kv_heads, head_dim]`` and a
    host swap pool of the same blocks, block-major ``[blocks, layers, 2, ...]``.

    ``gpu_cache`` gives the model per-layer ``(key, value)`` views. On the device, a move is one
    gather or scatter over all layers and both K and V; across, one copy per block carries all its
    layers. On CUDA the host pool is pinned and those copies are non-blocking, all on one side
    stream: in its order, a swap-in reads a host block after the swap-out that wrote it, and the
    step's stream waits only for swap-ins (a swap-out's copy overlaps the forward pass). No host sync.
    """

    def __init__(
        self, num_layers: int, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
        num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.device = device
        block_shape = (block_size, num_kv_heads, head_dim)
        self.gpu_kv = torch.zeros((num_layers, 2, num_gpu_blocks, *block_shape), dtype=dtype, device=device)
        self.gpu_cache = [(layer[0], layer[1]) for layer in self.gpu_kv]
        # block-major, so one swapped block is one contiguous run of every layer's keys and values
        self.cpu_kv = torch.zeros(
            (num_cpu_blocks, num_layers, 2, *block_shape), dtype=dtype, pin_memory=device.type == "cuda"
        )
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextmanager
    def _host_copies(self, *device_tensors: torch.Tensor) -> Iterator[None]:
        """Run copies to and from the host pool on the side stream, after the work queued so far
        (the gathers); ``device_tensors`` made on the step's stream stay allocated until they ran."""
        if self.copy_stream is None:
            yield
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        for tensor in device_tensors:
            tensor.record_stream(self.copy_stream)
        with torch.cuda.stream(self.copy_stream):
            yield

    def swap_out(self, mapping: BlockMapping) -> None:
        """Copy device blocks to their CPU slots ``(gpu, cpu)``."""
        if not mapping:
            return
        src, dst = _split(mapping, self.gpu_kv.shape[2], self.cpu_kv.shape[0])
        src_ids = torch.tensor(src, device=self.device)
        blocks = self.gpu_kv.index_select(2, src_ids).permute(2, 0, 1, 3, 4, 5).contiguous()
        with self._host_copies(blocks):
            for row, block in enumerate(dst):  # one non-blocking copy per block into the pinned pool
                self.cpu_kv[block].copy_(blocks[row], non_blocking=True)

    def swap_in(self, mapping: BlockMapping) -> None:
        """Copy CPU blocks back to their device slots ``(cpu, gpu)``."""
        if not mapping:
            return
        src, dst = _split(mapping, self.cpu_kv.shape[0], self.gpu_kv.shape[2])
        blocks = torch.empty((len(src), *self.cpu_kv.shape[1:]), dtype=self.cpu_kv.dtype, device=self.device)
        with self._host_copies(blocks):
            for row, block in enumerate(src):  # one non-blocking copy per block from the pinned pool
                blocks[row].copy_(self.cpu_kv[block], non_blocking=True)
        if self.copy_stream is not None:  # the scatter below, and the step, need the blocks
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        self.gpu_kv.index_copy_(2, torch.tensor(dst, device=self.device), blocks.permute(1, 2, 0, 3, 4, 5))

    def copy(self, mapping: BlockMapping) -> None:
        """Copy-on-write: duplicate device blocks ``(src, dst)`` in every layer."""
        if not mapping:
            return
        num_blocks = self.gpu_kv.shape[2]
        src_ids, dst_ids = torch.tensor(_split(mapping, num_blocks, num_blocks), device=self.device)
        self.gpu_kv.index_copy_(2, dst_ids, self.gpu_kv.index_select(2, src_ids))
