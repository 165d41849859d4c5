"""``kv_cache_dtype``: which dtype the KV cache takes, what it refuses, and an fp32 model serving from an fp16 cache
(twice the blocks in the same memory, the compiled decode reading it, outputs within fp16's rounding of an fp32
cache's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams, config
from engine.config import EngineConfig
from engine.llm_engine import check_kv_cache_budget

AVX2_FLAGS = frozenset({"avx2", "f16c", "fma"})
PROMPTS = ["Hello, my name is", "The capital of France", "1 2 3 4", "Once upon a time"]


@pytest.mark.parametrize(("kwargs", "flags", "expected"), [
    # an fp32 model whose weights the CPU holds in fp16 (our kernel or fbgemm) or int8: an fp16 cache
    ({"dtype": "float32"}, AVX2_FLAGS, torch.float16),
    ({"dtype": "float32", "cpu_weight_packing": "fp16"}, AVX2_FLAGS, torch.float16),
    ({"dtype": "float32", "quantization": "int8_weight_only"}, AVX2_FLAGS, torch.float16),
    # fp32 weights, or a CPU without F16C: the model's dtype, as vLLM's auto
    ({"dtype": "float32", "cpu_weight_packing": "exact"}, AVX2_FLAGS, torch.float32),
    ({"dtype": "float32", "cpu_weight_packing": "onednn"}, AVX2_FLAGS, torch.float32),
    # other attention backends than the CPU's compiled one: the model's dtype
    ({"dtype": "float32", "attention_backend": "torch"}, AVX2_FLAGS, torch.float32),
    ({"dtype": "float32", "attention_backend": "triton"}, AVX2_FLAGS, torch.float32),
    ({"dtype": "float32"}, frozenset({"sse4_2"}), torch.float32),
    ({"dtype": "bfloat16"}, AVX2_FLAGS, torch.bfloat16),
    # a name is taken as given
    ({"dtype": "float32", "kv_cache_dtype": "float32"}, AVX2_FLAGS, torch.float32),
    ({"dtype": "float32", "kv_cache_dtype": "bf16"}, frozenset(), torch.bfloat16),
    ({"dtype": "float32", "kv_cache_dtype": torch.float16}, frozenset(), torch.float16),
    ({"dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}, AVX2_FLAGS, torch.bfloat16),
])
def test_the_kv_cache_dtype_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any], flags: frozenset[str], expected: torch.dtype,
) -> None:
    monkeypatch.setattr(config, "cpu_flags", lambda: flags)
    monkeypatch.setattr(config, "has_fbgemm_fp16", lambda: True)  # lets cpu_weight_packing="fp16" through anywhere
    monkeypatch.delenv("PAGEDSERVE_ATTENTION_BACKEND", raising=False)
    assert EngineConfig(device="cpu", **kwargs).kv_cache_torch_dtype() == expected


def test_auto_follows_the_attention_backend_the_environment_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "cpu_flags", lambda: AVX2_FLAGS)
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "torch")  # select_backend's choice: the plain-torch reference
    assert EngineConfig(device="cpu", dtype="float32").kv_cache_torch_dtype() == torch.float32
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "triton")
    with pytest.raises(ValueError, match="not with the triton backend"):
        EngineConfig(device="cpu", dtype="float32", kv_cache_dtype="float16")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dtype": "float32", "kv_cache_dtype": "fp8"}, "kv_cache_dtype must be 'auto' or one of"),
    ({"dtype": "float32", "kv_cache_dtype": torch.int8}, "kv_cache_dtype must be the model's dtype"),
    # wider than the model, or another 16-bit dtype: the compiled kernels pair neither
    ({"dtype": "bfloat16", "kv_cache_dtype": "float32"}, r"must be the model's dtype \(torch.bfloat16\)"),
    ({"dtype": "bfloat16", "kv_cache_dtype": "fp16"}, "or float16 / bfloat16 under an fp32 model on the CPU"),
    # the Triton kernels read caches of the query's dtype only (and never ran a narrower one)
    ({"dtype": "float32", "device": "cuda", "kv_cache_dtype": "fp16"}, "got 'fp16' on cuda"),
    ({"dtype": "float32", "attention_backend": "triton", "kv_cache_dtype": "fp16"}, "not with the triton backend"),
])
def test_a_kv_cache_dtype_the_kernels_cannot_pair_is_refused_naming_it(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{"device": "cpu", **kwargs})


def _llm(model_dir: Path, **kwargs: Any) -> LLM:
    return LLM(model=str(model_dir), **{"dtype": "float32", "kv_cache_memory": "2MiB", "swap_space": "4MiB",
                                        "device": "cpu", **kwargs})


def test_an_fp16_cache_holds_twice_the_blocks_of_an_fp32_one_in_the_same_memory(tiny_model_dir: Path) -> None:
    fp32, fp16 = (_llm(tiny_model_dir, kv_cache_dtype=name).engine for name in ("float32", "float16"))
    assert (fp32.cache.gpu_kv.dtype, fp16.cache.gpu_kv.dtype) == (torch.float32, torch.float16)
    assert fp16.cache.cpu_kv.dtype == torch.float16  # swapped blocks keep their bytes
    assert fp16.num_gpu_blocks == 2 * fp32.num_gpu_blocks
    assert fp16.num_cpu_blocks == 2 * fp32.num_cpu_blocks
    # the startup check sizes blocks as the engine does: a budget of two fp16 blocks passes, just under it fails
    two_blocks = fp16.cache.gpu_kv[:, :, :2].numel() * 2
    check_kv_cache_budget(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_dtype="float16",
                                       kv_cache_memory=two_blocks, device="cpu"), tiny_model_dir)
    with pytest.raises(ValueError, match="holds 1 blocks"):
        check_kv_cache_budget(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_dtype="float16",
                                           kv_cache_memory=two_blocks - 1, device="cpu"), tiny_model_dir)


def _agreed_logprob_differences(first: list[Any], second: list[Any]) -> list[float]:
    """Per prompt, each step's difference in the logprob of the token both greedy runs chose, up to the first step
    where their tokens differ (from there on they attend to different contexts: a random model has near ties)."""
    differences = []
    for one, other in zip(first, second):
        one_steps, other_steps = one.outputs[0], other.outputs[0]
        for step, token in enumerate(one_steps.token_ids):
            if other_steps.token_ids[step] != token:
                break
            differences.append(abs(other_steps.logprobs[step][token] - one_steps.logprobs[step][token]))
    return differences


@pytest.mark.parametrize(("kv_cache_dtype", "rounding"), [("float16", 2e-2), ("bfloat16", 1e-1)])
def test_an_fp32_model_decodes_from_a_16_bit_cache_as_the_plain_torch_backend_does(
    tiny_model_dir: Path, kv_cache_dtype: str, rounding: float
) -> None:
    """The CPU backend (compiled cache writes, decode kernel and decode stack) over a 16-bit cache gives the logprobs
    that the plain-torch backend (index_copy_ into the cache, gather and SDPA in fp32) gives over the same cache;
    both stay within the cache's rounding of an fp32 cache's logprobs (this random model's largest: 0.007 for fp16,
    0.027 for bf16)."""
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)

    def generate(**kwargs: Any) -> list[Any]:
        llm = _llm(tiny_model_dir, max_num_seqs=len(PROMPTS), **kwargs)
        return llm.generate(PROMPTS, params, use_tqdm=False)

    compiled = generate(kv_cache_dtype=kv_cache_dtype)
    plain = _agreed_logprob_differences(compiled, generate(kv_cache_dtype=kv_cache_dtype, attention_backend="torch"))
    assert len(plain) == len(PROMPTS) * params.max_tokens and max(plain) < 1e-4
    exact = _agreed_logprob_differences(compiled, generate(kv_cache_dtype="float32"))
    assert len(exact) >= len(plain) // 2 and max(exact) < rounding  # most steps agree (fp16: all 48 here)
