"""The CPU's fp16-weight linear (``fp16_pack_weight`` + ``fp16_linear``) is the fp32-summed product of fp32 rows and
the weights rounded to fp16, at any row count (its few-rows and many-rows passes) and any layer shape, in the
machine's own build and in the AVX2 build (a machine with AVX-512 runs a 16-lane path in its own); the baseline x86-64
build refuses it by name."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from paged_kernels.cpu_extension import cpu_kernels

# shapes off the kernel's blocks (16 outputs on AVX2, 32 on AVX-512): a last block of a few outputs, an odd number of
# blocks (the few-rows pass takes two blocks at a time), one feature, and SmolLM2's
SHAPES = [(1, 1), (5, 37), (17, 3), (67, 100), (96, 33), (192, 576), (576, 1536)]
# across the passes' row counts: few rows (2 on AVX2, 6 on AVX-512) take two blocks a pass, more take one block and
# 6 (AVX2) or 12 (AVX-512) rows a pass, the rest in a pass of fewer
ROWS = [1, 2, 3, 5, 6, 7, 12, 13, 19, 40]


@pytest.fixture(scope="module", params=["native", "avx2"])
def kernels(request: pytest.FixtureRequest) -> ModuleType:
    """The machine's own build (``-march=native``), and the AVX2 build."""
    if request.param == "avx2":
        return request.getfixturevalue("avx2_kernels")
    kernels = cpu_kernels()
    assert kernels is not None, "the CPU kernels must build here (a C++ compiler and ninja are installed)"
    if not kernels.has_fp16_linear():
        pytest.skip("the CPU lacks AVX2, F16C or FMA")
    return kernels


def assert_fp32_sum_of(got: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``got`` is rows @ fp16(weight)^T + bias up to fp32's rounding of the sums (a few ulp of the sum of the
    products' magnitudes)."""
    half = weight.half().double()
    expected = rows.double() @ half.T + (0 if bias is None else bias.double())
    magnitude = rows.double().abs() @ half.abs().T + (0 if bias is None else bias.double().abs())
    assert got.dtype == torch.float32 and got.shape == expected.shape
    error = (got.double() - expected).abs()
    assert (error <= 1e-5 * magnitude + 1e-30).all(), error.max()


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("num_rows", ROWS)
def test_fp16_linear_is_the_fp32_summed_product_with_fp16_weights(
    kernels: ModuleType, out_features: int, in_features: int, num_rows: int,
) -> None:
    torch.manual_seed(out_features * 1000 + in_features + num_rows)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features)
    rows = torch.randn(num_rows, in_features)
    packed = kernels.fp16_pack_weight(weight.half())
    for with_bias in (bias, None):
        got = kernels.fp16_linear(rows, packed, torch.empty(0) if with_bias is None else with_bias, in_features,
                                  out_features)
        assert_fp32_sum_of(got, rows, weight, with_bias)


def test_the_weights_are_rounded_to_fp16_not_kept_in_fp32(kernels: ModuleType) -> None:
    torch.manual_seed(1)
    weight, rows = torch.randn(40, 64), torch.randn(3, 64)
    got = kernels.fp16_linear(rows, kernels.fp16_pack_weight(weight.half()), torch.empty(0), 64, 40)
    assert (got - rows @ weight.T).abs().max() > 1e-4  # fp16 keeps 11 significant bits
    assert_fp32_sum_of(got, rows, weight, None)


def test_no_rows_give_an_empty_result(kernels: ModuleType) -> None:
    got = kernels.fp16_linear(torch.empty(0, 64), kernels.fp16_pack_weight(torch.randn(40, 64).half()), torch.empty(0),
                              64, 40)
    assert got.shape == (0, 40)


def test_a_non_contiguous_input_is_read_as_its_values(kernels: ModuleType) -> None:
    torch.manual_seed(2)
    weight = torch.randn(48, 64)
    rows = torch.randn(64, 7).T  # [7, 64], not contiguous
    got = kernels.fp16_linear(rows, kernels.fp16_pack_weight(weight.half()), torch.empty(0), 64, 48)
    assert_fp32_sum_of(got, rows, weight, None)


def test_a_packed_weight_holds_each_block_feature_by_feature_padded_with_zeros(kernels: ModuleType) -> None:
    weight = torch.randn(5, 37).half()
    packed = kernels.fp16_pack_weight(weight)
    assert packed.dtype == torch.float16 and packed.dim() == 3 and packed.shape[:2] == (1, 37)
    block_outputs = packed.shape[2]
    assert block_outputs in (16, 32)  # two vectors of outputs: AVX2's 8 lanes or AVX-512's 16
    unpacked = packed.permute(0, 2, 1).reshape(block_outputs, 37)
    assert torch.equal(unpacked[:5], weight) and not unpacked[5:].any()


@pytest.mark.parametrize(("call", "message"), [
    (lambda k, p: k.fp16_linear(torch.randn(2, 64).half(), p, torch.empty(0), 64, 40), "input must be a 2-D fp32"),
    (lambda k, p: k.fp16_linear(torch.randn(2, 2, 64), p, torch.empty(0), 64, 40), "input must be a 2-D fp32"),
    (lambda k, p: k.fp16_linear(torch.randn(2, 62), p, torch.empty(0), 62, 40),
     "packed must be fp16_pack_weight's layout"),
    (lambda k, p: k.fp16_linear(torch.randn(2, 66), p, torch.empty(0), 64, 40), "input has 66 features"),
    (lambda k, p: k.fp16_linear(torch.randn(2, 64), p, torch.empty(0), 64, 80),
     "packed must be fp16_pack_weight's layout"),
    (lambda k, p: k.fp16_linear(torch.randn(2, 64), p.float(), torch.empty(0), 64, 40),
     "packed must be fp16_pack_weight's layout"),
    (lambda k, p: k.fp16_linear(torch.randn(2, 64), p, torch.randn(39), 64, 40), "bias must be empty"),
    (lambda k, p: k.fp16_linear(torch.randn(2, 64), p, torch.randn(40).half(), 64, 40), "bias must be empty"),
    (lambda k, p: k.fp16_pack_weight(torch.randn(40, 64)), "weight must be 2-D fp16"),
])
def test_bad_arguments_are_named(kernels: ModuleType, call: object, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        call(kernels, kernels.fp16_pack_weight(torch.randn(40, 64).half()))  # type: ignore[operator]


@pytest.mark.x86_builds
def test_the_baseline_build_refuses_fp16_linear_by_name(baseline_kernels: ModuleType) -> None:
    assert not baseline_kernels.has_fp16_linear()
    weight = torch.zeros(1, 2, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="fp16_linear: this build has no AVX2 with F16C and FMA"):
        baseline_kernels.fp16_linear(torch.zeros(1, 2), baseline_kernels.fp16_pack_weight(weight), torch.empty(0), 2, 1)
