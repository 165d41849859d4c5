"""A decode step reads device memory back once: the sampled tokens.

On a CUDA device every read-back (``.item()``, ``.tolist()``, ``bool(tensor)``, boolean-mask
indexing...) stalls the host until the GPU has caught up. This test counts the calls that
would do so, made by engine/ and paged_kernels/ code during one decode step with the Triton backend
(run by Triton's interpreter on the CPU, whose own copies are not the engine's; compiled, on the device, where
there is a GPU).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

if not torch.cuda.is_available():
    # must be set before paged_kernels.triton_ops defines its kernels; the interpreter runs them on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM, SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton takes device tensors only

REPO = Path(__file__).resolve().parents[2]
COUNTED_DIRS = (str(REPO / "engine") + os.sep, str(REPO / "paged_kernels") + os.sep)
TORCH_DIR = str(Path(torch.__file__).parent) + os.sep
# Tensor methods that copy device data to the host and so wait for the device.
READ_BACKS = frozenset({
    "item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
    "nonzero", "masked_select", "unique", "any_", "equal", "allclose",
})
MASK_INDEXING = frozenset({"__getitem__", "__setitem__", "index_put_", "index_put"})


def _is_mask(value: Any) -> bool:
    """A boolean tensor (or a tuple holding one) used as an index: its size needs a read-back."""
    if isinstance(value, tuple):
        return any(_is_mask(v) for v in value)
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool


def _caller(frame: FrameType | None) -> str | None:
    """``file:line function`` of the first frame outside torch and this test, if engine/ or paged_kernels/ code."""
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(TORCH_DIR) and name != __file__:
            if name.startswith(COUNTED_DIRS):
                return f"{Path(name).relative_to(REPO)}:{frame.f_lineno} {frame.f_code.co_name}"
            return None
        frame = frame.f_back
    return None


class ReadBackCounter(TorchFunctionMode):
    """Counts, by call site, the torch calls from engine/ and paged_kernels/ that read device data back (or, with
    other ``names``, those calls)."""

    def __init__(self, names: frozenset[str] = READ_BACKS) -> None:
        super().__init__()
        self.names = names
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in self.names or (name in MASK_INDEXING and len(args) > 1 and _is_mask(args[1])):
            site = _caller(sys._getframe(1))
            if site is not None:
                self.sites[f"{site} ({name})"] += 1
        return func(*args, **(kwargs or {}))


def _engine_with_requests(folder: Path, num_seqs: int) -> LLM:
    """An engine on the Triton backend holding ``num_seqs`` greedy requests, not yet stepped."""
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory="4MiB", attention_backend="triton",
              block_size=8, device=DEVICE)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        llm.engine.add_request(f"r{i}", list(range(10 + 7 * i, 30 + 9 * i)), params)
    return llm


def _step_counting(llm: LLM) -> tuple[list[int], Counter[str]]:
    """One step's number of tokens per request, and its read-backs by call site."""
    counter = ReadBackCounter()
    with counter:
        outputs = llm.engine.step()
    return [len(o.outputs[0].token_ids) for o in outputs], counter.sites


def test_a_prefill_step_reads_back_only_the_sampled_tokens(tiny_model_dir: Path) -> None:
    lengths, sites = _step_counting(_engine_with_requests(tiny_model_dir, num_seqs=3))
    assert lengths == [1, 1, 1]  # every prompt fit the token budget: one prefill step
    assert sum(sites.values()) <= 1, dict(sites)
    assert all(site.startswith("engine/sampler.py") for site in sites), dict(sites)


def test_a_decode_step_reads_back_only_the_sampled_tokens(tiny_model_dir: Path) -> None:
    llm = _engine_with_requests(tiny_model_dir, num_seqs=3)
    llm.engine.step()
    lengths, sites = _step_counting(llm)
    assert lengths == [2, 2, 2]  # it was a decode step
    assert sum(sites.values()) <= 1, dict(sites)
    assert all(site.startswith("engine/sampler.py") for site in sites), dict(sites)


def test_the_counter_sees_the_read_back_of_an_unplanned_decode() -> None:
    # without a plan, decode must read the context lengths back to size its grid
    from paged_kernels import triton_ops

    cache = torch.zeros(4, 8, 1, 16, device=DEVICE)
    tables, lengths = torch.tensor([[0, 1]], device=DEVICE), torch.tensor([9], device=DEVICE)
    counter = ReadBackCounter()
    with counter:
        triton_ops.paged_attention_decode(torch.zeros(1, 2, 16, device=DEVICE), cache, cache, tables, lengths, 0.25)
    assert sum(counter.sites.values()) == 1, dict(counter.sites)
    assert all(site.startswith("paged_kernels/checks.py") for site in counter.sites)


def test_steps_that_swap_and_copy_blocks_read_back_only_the_sampled_tokens(tiny_model_dir: Path) -> None:
    # ten 8-token blocks cannot hold three requests of two samples each: sequences are swapped
    # out and in, and each sample's first write to its shared last block copies it
    llm = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=10 * 4096, attention_backend="triton",
              block_size=8, device=DEVICE, watermark=0.0, preemption_mode="swap")
    params = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=0, ignore_eos=True)
    for i in range(3):
        llm.engine.add_request(f"r{i}", list(range(10 + 5 * i, 30 + 5 * i)), params)
    copies: list[list[tuple[int, int]]] = []
    copy = llm.engine.cache.copy

    def recording_copy(mapping: list[tuple[int, int]]) -> None:
        copies.append(mapping)
        copy(mapping)

    llm.engine.cache.copy = recording_copy  # type: ignore[method-assign]
    read_backs = []
    while llm.engine.has_unfinished_requests():
        read_backs.append(sum(_step_counting(llm)[1].values()))
    stats = llm.engine.stats()
    assert stats.num_blocks_swapped_out > 0 and stats.num_blocks_swapped_in > 0
    assert any(copies)
    assert max(read_backs) <= 1, read_backs
