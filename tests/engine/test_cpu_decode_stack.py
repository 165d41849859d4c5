"""The compiled decode stack (``engine/models/cpu_decode_stack.py``): decode steps through it give bit for bit what the
model's Python layers give, it serves exactly the steps and models it should, and its C++ loop names what is wrong
with its arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models import cpu_packing
from engine.models.cpu_decode_stack import CompiledDecodeStack
from engine.models.llama import RMSNorm
from engine.models.quantization import INT8_KERNEL_MAX_ROWS
from paged_kernels.cpu_extension import cpu_kernels

FP16_KERNEL = cpu_packing.fp16_kernel_applies()
BF16_KERNEL = cpu_packing.bf16_kernel_applies()
# five: past every build's int8 kernel rows (INT8_KERNEL_MAX_ROWS is at most 4)
PROMPTS = ["Hello, my name is", "The capital of France", "1 2 3 4", "Once upon a time", "Dear Sir"]


def _llm(model_dir: Path, **kwargs: Any) -> LLM:
    return LLM(model=str(model_dir), **{"dtype": "float32", "kv_cache_memory": "4MiB", "device": "cpu", **kwargs})


def _stack(llm: LLM) -> CompiledDecodeStack | None:
    return llm.engine.model.decode_stack


@pytest.mark.parametrize(("kwargs", "has_stack"), [
    ({}, FP16_KERNEL),  # the defaults: fp32 layers in our fp16 kernel's layout where it builds
    ({"quantization": "int8_weight_only"}, True),  # our int8 kernels on every CPU
    ({"dtype": "bfloat16"}, BF16_KERNEL),  # our bf16 kernel's layers; oneDNN's packed layers are not the stack's
    ({"cpu_weight_packing": "onednn"}, False),
    ({"cpu_weight_packing": "exact"}, False),  # no fused layer ops
    ({"attention_backend": "torch"}, False),  # the plain-torch backend compiles nothing
])
def test_the_engine_runs_the_stack_only_where_every_layer_is_compiled(
    tiny_model_dir: Path, kwargs: dict[str, str], has_stack: bool,
) -> None:
    assert (_stack(_llm(tiny_model_dir, **kwargs)) is not None) is has_stack


def _generate(llm: LLM, params: SamplingParams) -> list[tuple[list[int], Any]]:
    """One prompt alone (decode steps of one row), then all of them (up to four rows)."""
    outputs = [o for prompts in (PROMPTS[:1], PROMPTS) for o in llm.generate(prompts, params, use_tqdm=False)]
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


@pytest.mark.parametrize("kwargs", [
    pytest.param({}, marks=pytest.mark.skipif(not FP16_KERNEL, reason="our fp16 kernel needs AVX2, F16C and FMA")),
    # the defaults' fp16 KV cache under fp16 weights, and an fp32 cache
    pytest.param({"kv_cache_dtype": "float32"}, marks=pytest.mark.skipif(
        not FP16_KERNEL, reason="our fp16 kernel needs AVX2, F16C and FMA")),
    pytest.param({"quantization": "int8_weight_only"}, marks=pytest.mark.skipif(
        not FP16_KERNEL, reason="past the int8 kernel's rows the layers are our fp16 kernel's")),
    pytest.param({"dtype": "bfloat16"}, marks=[
        pytest.mark.avx512_bf16, pytest.mark.skipif(not BF16_KERNEL, reason="our bf16 kernel needs AVX512-BF16")]),
], ids=["fp16-weights", "fp16-weights-fp32-cache", "int8-weight-only", "bf16"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decode_steps_through_the_stack_equal_the_python_layers_bit_for_bit(
    tiny_model_dir: Path, kwargs: dict[str, str], temperature: float,
) -> None:
    """Every logprob of every token, over decode batches of 1-5 rows (prompts finish prefill at different steps
    under a small token budget; int8 layers run their kernel up to INT8_KERNEL_MAX_ROWS rows, their fp16 layers past
    it), and seeded samples, are the same both ways."""
    llm = _llm(tiny_model_dir, max_num_batched_tokens=8, max_num_seqs=len(PROMPTS), **kwargs)
    stack = _stack(llm)
    assert stack is not None
    with torch.no_grad():  # a random model's norms are all ones: make each layer's its own (the stack holds them)
        for norm in llm.engine.model.modules():
            if isinstance(norm, RMSNorm):
                norm.weight.uniform_(0.5, 1.5)
    rows_per_call: list[int] = []
    decode_layers = stack.decode_layers

    def counted(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        rows_per_call.append(hidden.shape[0])
        return decode_layers(hidden, *args)

    stack.decode_layers = counted
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=7, logprobs=5, ignore_eos=True)
    through_stack = _generate(llm, params)
    llm.engine.model.decode_stack = None
    assert _generate(llm, params) == through_stack
    assert {1, len(PROMPTS)} <= set(rows_per_call)  # it ran steps of one row and of every prompt's
    if "quantization" in kwargs:
        assert INT8_KERNEL_MAX_ROWS < len(PROMPTS)  # both kinds of int8 projection ran
        assert stack.many_rows is not None


@pytest.fixture(scope="module")
def kernels():  # type: ignore[no-untyped-def]
    built = cpu_kernels()
    assert built is not None, "the CPU kernels must build here (a C++ compiler and ninja are installed)"
    return built


def _arguments(layers: int = 2) -> list[Any]:
    """``decode_layers``' arguments for one row of a model of hidden size 8 (one head of 8, fp16-weight layers): all
    checked before anything runs, the linears' tensors empty."""
    caches = [torch.zeros(2, 4, 1, 8) for _ in range(layers)]
    linear_shapes = [0, 8, 24, 0, 8, 8, 0, 8, 32, 0, 16, 8] * layers  # kind, in, out of qkv, o, gate_up, down
    return [torch.randn(1, 8), torch.ones(1, 8), torch.zeros(1, 8), caches, [c.clone() for c in caches],
            torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            [torch.ones(8)] * (2 * layers + 1), [torch.empty(0)] * (12 * layers), linear_shapes, 1, 1, 8, 1e-5,
            8**-0.5]


@pytest.mark.parametrize(("change", "message"), [
    (lambda a: a.__setitem__(4, a[4][:1]), "one cache per layer"),
    (lambda a: a.__setitem__(8, a[8][:-1]), "norm_weights must hold 2 per layer"),
    (lambda a: a.__setitem__(9, a[9][:-1]), "4 linears per layer"),
    (lambda a: a.__setitem__(0, torch.randn(8, 2).t()), "hidden must be contiguous"),
    (lambda a: a[3].__setitem__(1, torch.zeros(3, 4, 1, 8)), "layer 1's caches must be"),
    (lambda a: a[4].__setitem__(0, torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)), "layer 0's caches must be"),
    (lambda a: a.__setitem__(0, torch.randn(1, 8).bfloat16()), "in the model's dtype, or 16-bit under an fp32 model"),
    (lambda a: a.__setitem__(10, [9] + a[10][1:]), "linear 0 has unknown kind 9"),
], ids=["value caches", "norms", "linears", "hidden", "cache shape", "cache dtype", "cache wider than model", "kind"])
def test_the_compiled_loop_names_what_is_wrong(kernels, change, message: str) -> None:  # type: ignore[no-untyped-def]
    arguments = _arguments()
    change(arguments)
    with pytest.raises(RuntimeError, match=message):
        kernels.decode_layers(*arguments)
