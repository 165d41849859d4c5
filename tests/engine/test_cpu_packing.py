"""Prepacked linear layers: oneDNN's bf16 computes exactly what ``F.linear`` does, our bf16 kernel's layers within
bf16's rounding of it, oneDNN's fp32 within rounding of it, fp16 weights (our kernel's, fbgemm's) within the rounding
of the weights, the ``auto`` mode picks per CPU, and the ``exact`` mode keeps fp32 on ``F.linear``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import numerics
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models import cpu_packing, loader
from paged_kernels import cpu_features, reference

CPU = torch.device("cpu")
BF16_PACKS = cpu_packing.packed_layer_type(torch.bfloat16, CPU, "onednn") is not None
BF16_KERNEL = cpu_packing.bf16_kernel_applies()
AUTO_BF16_LAYER = cpu_packing.Bf16Linear if BF16_KERNEL else cpu_packing.PackedLinear
FBGEMM_FP16 = cpu_features.has_fbgemm_fp16()
FP16_KERNEL = cpu_packing.fp16_kernel_applies()
Test = TypeVar("Test", bound=Callable[..., None])


def needs_bf16_kernel(test: Test) -> Test:
    """Mark ``test`` as needing our AVX512-BF16 kernel's layers (a hardware marker) and skip it without them."""
    reason = "our bf16 linear kernel needs a CPU with AVX512-BF16"
    return pytest.mark.avx512_bf16(pytest.mark.skipif(not BF16_KERNEL, reason=reason)(test))


def needs_fp16_kernel(test: Test) -> Test:
    """Skip ``test`` where our fp16 linear kernel did not build (no AVX2, F16C or FMA)."""
    return pytest.mark.skipif(not FP16_KERNEL, reason="our fp16 linear kernel needs AVX2, F16C and FMA")(test)


def needs_fbgemm_fp16(test: Test) -> Test:
    """Mark ``test`` as needing fbgemm's fp16 GEMM (a hardware marker) and skip it without one."""
    reason = "fbgemm's fp16 GEMM needs an x86 CPU with AVX2, F16C and FMA"
    return pytest.mark.fbgemm_fp16(pytest.mark.skipif(not FBGEMM_FP16, reason=reason)(test))


@pytest.mark.onednn_bf16
@pytest.mark.skipif(not BF16_PACKS, reason="oneDNN's bf16 weight reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT")
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_is_bit_identical_to_f_linear(rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=True).to(torch.bfloat16)
    hidden = torch.randn(rows, 96, dtype=torch.bfloat16)
    packed = cpu_packing.PackedLinear(linear.weight, linear.bias)
    assert torch.equal(packed(hidden), F.linear(hidden, linear.weight, linear.bias))


def test_bf16_packing_applies_exactly_where_onednn_supports_bf16() -> None:
    assert BF16_PACKS == (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


# bf16 arithmetic is emulated on any CPU: the tests below run everywhere and expect packing only where
# oneDNN's weight reorder (the one step that needs the instructions) is available.
def test_bf16_loading_packs_every_linear_where_it_applies(tiny_model_dir: Path) -> None:
    model = loader.load_model(tiny_model_dir, torch.bfloat16, torch.device("cpu"), ops=reference)
    packed = [isinstance(module, AUTO_BF16_LAYER) for module in model.modules()]
    unpacked = [isinstance(module, nn.Linear) for module in model.modules()]
    applies = BF16_PACKS or BF16_KERNEL
    assert (any(packed), any(unpacked)) == (applies, not applies)
    if applies:  # every decoder layer and the head; a tied head gets its own packed copy
        assert sum(packed) == 4 * len(model.layers) + 1
        assert isinstance(model.lm_head, AUTO_BF16_LAYER)
        assert model.lm_head.out_features == model.embed_tokens.num_embeddings


@pytest.mark.parametrize(("mode", "kernel_applies", "expected"), [
    ("auto", True, cpu_packing.Bf16Linear),
    ("auto", False, cpu_packing.PackedLinear),
    ("onednn", True, cpu_packing.PackedLinear),
    ("exact", True, cpu_packing.PackedLinear),  # oneDNN's bf16 is bit-identical to F.linear
    ("off", True, None),
])
def test_bf16_packing_follows_the_mode_and_the_cpu(
    monkeypatch: pytest.MonkeyPatch, mode: str, kernel_applies: bool, expected: type | None,
) -> None:
    monkeypatch.setattr(cpu_packing, "bf16_kernel_applies", lambda: kernel_applies)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert cpu_packing.packed_layer_type(torch.bfloat16, CPU, mode) is expected
    assert cpu_packing.packed_layer_type(torch.bfloat16, torch.device("cuda"), mode) is None


@pytest.mark.parametrize(("flags", "applies"), [
    ({"avx512f", "avx512_bf16"}, True),  # AMD's Zen 4 and later
    ({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, True),  # Intel's with AMX: the kernel multiplies in tiles
    ({"avx512f", "avx512_vnni"}, False),
])
def test_the_bf16_kernel_applies_with_avx512_bf16(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], applies: bool,
) -> None:
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(cpu_packing, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(cpu_packing, "cpu_kernels", lambda: SimpleNamespace(has_bf16_linear=lambda: True))
    assert cpu_packing.bf16_kernel_applies() == applies
    monkeypatch.setattr(cpu_packing, "cpu_kernels", lambda: None)  # no compiler: oneDNN's layers
    assert not cpu_packing.bf16_kernel_applies()


@needs_bf16_kernel
@pytest.mark.parametrize("shape", [(1, 96), (19, 96), (2, 3, 96)])
def test_bf16_kernel_layer_is_f_linear_up_to_bf16_rounding(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=True).to(torch.bfloat16)
    hidden = torch.randn(shape).to(torch.bfloat16)
    out = cpu_packing.Bf16Linear(linear.weight, linear.bias)(hidden)
    assert out.dtype == torch.bfloat16 and out.shape == (*shape[:-1], 160)
    exact = F.linear(hidden.double(), linear.weight.double(), linear.bias.double())
    assert ((out.double() - exact).abs() <= exact.abs() * torch.finfo(torch.bfloat16).eps + 1e-3).all()


@needs_bf16_kernel
def test_bf16_kernel_engine_generates_onednns_greedy_tokens(tiny_model_dir: Path) -> None:
    def generate(packing: str, layer: type) -> list[list[int]]:
        llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", kv_cache_memory="8MiB", cpu_weight_packing=packing,
                  device="cpu")
        assert isinstance(llm.engine.model.lm_head, layer)
        return numerics.greedy_tokens(llm, numerics.PROMPTS, 16)

    # the tiny model's sums (64 and 128 features) come out the same from both: the same tokens, prefill and decode
    assert generate("auto", cpu_packing.Bf16Linear) == generate("onednn", cpu_packing.PackedLinear)


@needs_bf16_kernel
def test_bf16_kernel_model_keeps_onednns_log_probs_up_to_rounding(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    ids = torch.tensor(AutoTokenizer.from_pretrained(tiny_model_dir).encode(numerics.FIXED_TEXT))
    model = numerics.hf_variant(tiny_model_dir, "bf16")
    assert sum(isinstance(module, cpu_packing.Bf16Linear) for module in model.modules()) == 7 * 2 + 1
    ours = numerics.token_logprobs(model, ids)
    onednn = numerics.token_logprobs(numerics.hf_variant(tiny_model_dir, "bf16-onednn"), ids)
    fp32 = numerics.token_logprobs(numerics.hf_variant(tiny_model_dir, "fp32-plain"), ids)
    # the two differ by the order of fp32 sums (where they differ at all), far less than bf16 differs from fp32
    assert (ours - onednn).abs().mean() < 0.5 * (onednn - fp32).abs().mean()


def test_bf16_engine_generates_the_same_tokens_with_and_without_packing(tiny_model_dir: Path) -> None:
    prompts = ["The quick brown fox", "A different prompt with more words in it"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def generate(packing: str) -> list[list[int]]:
        # the plain-torch backend: "off" would fuse the norms on the cpu one, and this compares packing alone
        llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", kv_cache_memory="8MiB", cpu_weight_packing=packing,
                  attention_backend="torch", device="cpu")
        is_packed = isinstance(llm.engine.model.lm_head, cpu_packing.PackedLinear)
        assert is_packed == (packing == "exact" and BF16_PACKS)
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]

    assert generate("exact") == generate("off")


@pytest.mark.parametrize(("mode", "has_kernel", "has_fbgemm", "expected"), [
    ("auto", True, True, cpu_packing.Fp16Linear),  # our kernel wherever it builds (AVX2, F16C, FMA)
    ("auto", False, True, cpu_packing.FbgemmFp16Linear),  # else fp16 weights wherever fbgemm runs them
    ("auto", False, False, cpu_packing.PackedLinear),
    ("onednn", True, True, cpu_packing.PackedLinear),
    ("fp16", True, True, cpu_packing.Fp16Linear),
    ("fp16", False, False, cpu_packing.FbgemmFp16Linear),
    ("exact", True, True, None),
    ("off", True, True, None),
])
def test_fp32_packing_follows_the_mode_and_the_cpu(
    monkeypatch: pytest.MonkeyPatch, mode: str, has_kernel: bool, has_fbgemm: bool, expected: type | None,
) -> None:
    monkeypatch.setattr(cpu_packing, "fp16_kernel_applies", lambda: has_kernel)
    monkeypatch.setattr(cpu_packing, "has_fbgemm_fp16", lambda: has_fbgemm)
    assert cpu_packing.packed_layer_type(torch.float32, CPU, mode) is expected
    assert cpu_packing.packed_layer_type(torch.float32, torch.device("cuda"), mode) is None


def test_fp16_packing_where_fbgemm_cannot_run_it_fails_at_start_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine import config

    monkeypatch.setattr(config, "has_fbgemm_fp16", lambda: False)
    with pytest.raises(ValueError, match="cpu_weight_packing='fp16' needs torch's fbgemm"):
        EngineConfig(cpu_weight_packing="fp16")
    EngineConfig(cpu_weight_packing="auto")  # auto then packs for oneDNN


def test_packed_fp32_linear_stays_within_rounding_of_f_linear() -> None:
    linear = nn.Linear(96, 160, bias=False)
    hidden = torch.randn(5, 96)
    packed = cpu_packing.PackedLinear(linear.weight, None)
    torch.testing.assert_close(packed(hidden), F.linear(hidden, linear.weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer_type", [
    pytest.param(cpu_packing.Fp16Linear, marks=pytest.mark.skipif(not FP16_KERNEL, reason="needs AVX2, F16C, FMA")),
    pytest.param(cpu_packing.FbgemmFp16Linear, marks=[pytest.mark.fbgemm_fp16, pytest.mark.skipif(
        not FBGEMM_FP16, reason="fbgemm's fp16 GEMM needs an x86 CPU with AVX2, F16C and FMA")]),
])
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (2, 3, 96)])
def test_fp16_weight_linear_computes_with_the_weights_rounded_to_fp16(
    layer_type: type[nn.Module], shape: tuple[int, ...],
) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=True)
    hidden = torch.randn(shape)
    out = layer_type(linear.weight, linear.bias)(hidden)
    rounded = F.linear(hidden, linear.weight.half().float(), linear.bias)  # the bias stays fp32
    assert out.dtype == torch.float32 and out.shape == (*shape[:-1], 160)
    torch.testing.assert_close(out, rounded, atol=1e-5, rtol=1e-4)
    assert (out - F.linear(hidden, linear.weight, linear.bias)).abs().max() > 0  # it does round


@needs_fp16_kernel
def test_our_fp16_layer_saturates_weights_past_fp16s_range_as_fbgemm_does() -> None:
    weight = torch.tensor([[1e5, -1e5, 2.0]])
    out = cpu_packing.Fp16Linear(weight, None)(torch.ones(1, 3))
    torch.testing.assert_close(out, torch.tensor([[2.0]]))  # +65504 - 65504 + 2, not inf - inf
    assert torch.isfinite(cpu_packing.Fp16Linear(weight, None)(torch.tensor([[1.0, 0.0, 0.0]]))).all()


@needs_fp16_kernel
def test_fp16_loading_puts_our_kernels_layers_everywhere_the_head_included(tiny_model_dir: Path) -> None:
    model = loader.load_model(tiny_model_dir, torch.float32, CPU, ops=reference, weight_packing="fp16")
    layers = [module for module in model.modules() if isinstance(module, cpu_packing.Fp16Linear)]
    assert len(layers) == 4 * len(model.layers) + 1  # fused qkv, o, fused gate_up, down; the head
    assert isinstance(model.lm_head, cpu_packing.Fp16Linear)
    assert not any(isinstance(module, nn.Linear) for module in model.modules())


@needs_fbgemm_fp16
def test_fbgemm_fp16_loading_packs_the_decoder_in_fp16_and_the_lm_head_both_ways(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_packing, "fp16_kernel_applies", lambda: False)  # a machine whose kernels did not build
    model = loader.load_model(tiny_model_dir, torch.float32, CPU, ops=reference, weight_packing="fp16")
    decoder = [module for module in model.layers.modules() if isinstance(module, cpu_packing.FbgemmFp16Linear)]
    assert len(decoder) == 4 * len(model.layers)  # fused qkv, o, fused gate_up, down
    assert isinstance(model.lm_head, cpu_packing.RowSplitHead)
    assert not any(isinstance(module, nn.Linear) for module in model.modules())


@needs_fbgemm_fp16
def test_the_row_split_head_runs_few_rows_on_fp16_weights_and_more_on_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    weight = torch.randn(300, 64)
    head = cpu_packing.RowSplitHead(weight, None)
    monkeypatch.setattr(cpu_packing, "FP16_HEAD_MAX_ROWS", 4)
    for rows in (1, 4, 5, 9):
        hidden = torch.randn(rows, 64)
        expected = F.linear(hidden, weight.half().float() if rows <= 4 else weight)
        torch.testing.assert_close(head(hidden), expected, atol=1e-5, rtol=1e-4)


def test_onednn_fp32_engine_keeps_the_exact_modes_log_probs_and_greedy_tokens(tiny_model_dir: Path) -> None:
    mean, mean_abs = numerics.logprob_change(tiny_model_dir, "fp32-packed")
    assert abs(mean) < 1e-5 and mean_abs < 1e-4

    def generate(packing: str) -> list[list[int]]:
        llm = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB", cpu_weight_packing=packing,
                  device="cpu")
        assert isinstance(llm.engine.model.lm_head, cpu_packing.PackedLinear) == (packing == "onednn")
        return numerics.greedy_tokens(llm, numerics.PROMPTS, 24)

    assert numerics.agreement(generate("onednn"), generate("exact")) == 1.0


def test_an_unknown_packing_mode_names_the_argument(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="cpu_weight_packing must be one of"):
        LLM(model=str(tiny_model_dir), cpu_weight_packing="sometimes")
