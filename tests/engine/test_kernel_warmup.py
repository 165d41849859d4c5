"""The engine compiles its attention kernels at start (CUDA), so no request's step waits for Triton."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before paged_kernels.triton_ops defines its kernels

from engine import LLM, SamplingParams  # noqa: E402
from engine.cache_engine import CacheEngine  # noqa: E402
from engine.kernel_warmup import LONGEST_PREFILL_WARMUP, compile_attention_kernels, warmup_lengths  # noqa: E402
from paged_kernels import select_backend, triton_decode, triton_ops, triton_prefill  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(("max_tokens", "lengths"), [
    (1, [1]), (2, [1, 2]), (8, [1, 2, 4, 8]), (100, [1, 2, 4, 8, 16, 32, 64, 100]),
])
def test_warmup_lengths_are_the_powers_of_two_up_to_the_longest_run_and_that_run(
    max_tokens: int, lengths: list[int],
) -> None:
    assert warmup_lengths(max_tokens) == lengths


def test_warmup_lengths_refuse_an_empty_budget() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        warmup_lengths(0)


@pytest.mark.parametrize(("backend", "compiles"), [("torch", False), ("cpu", False), ("triton", DEVICE.type == "cuda")])
def test_only_triton_outside_its_interpreter_compiles_on_first_launch(backend: str, compiles: bool) -> None:
    assert select_backend(DEVICE, backend).compiles_on_first_launch() is compiles


@pytest.fixture
def launches() -> Iterator[list[str]]:
    """Names of the attention kernels launched while the test runs, the decode kernel's with its variant."""
    names: list[str] = []
    kernels = {"prefill": triton_prefill._prefill_kernel, "decode": triton_decode._decode_partition_kernel,
               "merge": triton_decode._decode_reduce_kernel}
    hooks = {}
    for name, kernel in kernels.items():
        def hook(*args: object, name: str = name, **kwargs: object) -> None:
            names.append(f"{name}-single" if name == "decode" and kwargs.get("SINGLE_PARTITION") else name)
        hooks[name] = hook
        kernel.add_pre_run_hook(hook)
    yield names
    for name, kernel in kernels.items():
        kernel.pre_run_hooks.remove(hooks[name])


def test_the_warmup_runs_every_variant_and_writes_nothing_into_the_cache(launches: list[str]) -> None:
    cache = CacheEngine(num_layers=1, num_gpu_blocks=4, num_cpu_blocks=0, block_size=8, num_kv_heads=2,
                        head_dim=16, dtype=torch.float32, device=DEVICE)
    for key, value in cache.gpu_cache:
        key.normal_()
        value.normal_()
    before = [tensor.clone() for pair in cache.gpu_cache for tensor in pair]
    # contexts far longer than the cache holds: the warm-up reads block 0 over and over
    compile_attention_kernels(triton_ops, cache, num_heads=4, head_dim=16, max_new_tokens=9, max_context_len=2048)
    # prefills of 1, 2, 4, 8 and 9 new tokens; a decode of one partition, one split (with its merge)
    assert launches == ["prefill"] * 5 + ["decode-single", "decode", "merge"]
    assert all(torch.equal(a, b) for a, b in zip(before, [t for pair in cache.gpu_cache for t in pair], strict=True))


def test_a_run_of_new_tokens_longer_than_the_largest_prefill_tile_is_not_warmed(launches: list[str]) -> None:
    # a budget of 1,000 new tokens warms up to the largest tile, 128 rows: 1, 2, 4, ..., 128 tokens
    cache = CacheEngine(num_layers=1, num_gpu_blocks=2, num_cpu_blocks=0, block_size=16, num_kv_heads=1,
                        head_dim=16, dtype=torch.float32, device=DEVICE)
    compile_attention_kernels(triton_ops, cache, num_heads=1, head_dim=16, max_new_tokens=1000, max_context_len=64)
    assert launches.count("prefill") == len(warmup_lengths(LONGEST_PREFILL_WARMUP)) == 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("settings", [{}, {"enforce_eager": True, "max_num_batched_tokens": 64}],
                         ids=["graphs", "eager-small-budget"])
def test_no_attention_kernel_compiles_after_the_engine_starts(
    tiny_model_dir: Path, settings: dict[str, object],
) -> None:
    import triton

    llm = LLM(model=str(tiny_model_dir), device="cuda", dtype="bfloat16", kv_cache_memory="16MiB",
              max_model_len=512, max_num_seqs=8, **settings)
    compiled: list[str] = []

    def count(**kwargs: object) -> None:  # returning None lets Triton compile as usual
        function = kwargs["fn"]
        compiled.append(f"{getattr(function, 'module', '')}.{getattr(function, 'name', function)}")

    triton.knobs.runtime.jit_cache_hook = count
    try:
        prompts = [" ".join(["word"] * n) for n in (1, 3, 20, 70, 200, 400)]
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        llm.generate(prompts[:1] * 20, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    attention = ("paged_kernels.triton_decode", "paged_kernels.triton_prefill")
    assert [name for name in compiled if name.startswith(attention)] == []
