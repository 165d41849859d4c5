"""The CPU's AVX512-BF16 linear (``bf16_pack_weight`` + ``bf16_linear``) is the fp32-summed product of bf16 rows and
bf16 weights, rounded to bf16 once, at any row count (its passes of up to 12 rows, and its AMX tiles where the CPU
has them) and any layer shape."""

from __future__ import annotations

import sys
from types import ModuleType

import pytest
import torch

from paged_kernels.cpu_extension import cpu_kernels
from paged_kernels.cpu_features import cpu_flags, has_amx_for

AVX512_BF16 = "avx512_bf16" in cpu_flags()
AMX = has_amx_for(torch.bfloat16) and "amx_tile" in cpu_flags() and sys.platform == "linux"
pytestmark = [pytest.mark.avx512_bf16, pytest.mark.skipif(not AVX512_BF16, reason="needs a CPU with AVX512-BF16")]


@pytest.fixture(scope="module", params=["native", pytest.param("without-amx", marks=pytest.mark.x86_builds)])
def kernels(request: pytest.FixtureRequest) -> ModuleType:
    """The machine's own build, which multiplies in AMX tiles where the CPU has them, and where it does, a build for
    AVX512-BF16 without AMX, so that both of the kernel's paths run here."""
    if request.param == "without-amx":
        kernels = request.getfixturevalue("without_amx_kernels")
        assert kernels.has_bf16_linear() and not kernels.has_amx_bf16_linear()
        return kernels
    kernels = cpu_kernels()
    assert kernels is not None, "the CPU kernels must build here (a C++ compiler and ninja are installed)"
    assert kernels.has_bf16_linear(), "a CPU with AVX512-BF16 builds bf16_linear"
    # a machine with AMX-BF16 must multiply in its tiles, or these tests would run the AVX512-BF16 path twice; this
    # fails where the compiler's -march=native lacks AMX (GCC < 11) or Linux refuses the tile state (< 5.16)
    assert kernels.has_amx_bf16_linear() == AMX, "a Linux machine with AMX-BF16 multiplies in its tiles"
    return kernels


def expected_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows @ weight^T + bias in fp64 (bf16 products are exact in fp32, so only the sums' order differs)."""
    out = rows.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def assert_rounded_once(got: torch.Tensor, expected: torch.Tensor) -> None:
    """``got`` (bf16) is ``expected`` rounded to bf16, up to one unit in bf16's last place and fp32's summing."""
    assert got.dtype == torch.bfloat16
    ulp = expected.abs() * torch.finfo(torch.bfloat16).eps
    assert ((got.double() - expected).abs() <= ulp + 1e-4).all(), (got.double() - expected).abs().max()


# shapes off the kernel's blocks (32 outputs, pairs of features): odd widths, a last block of a few outputs, an odd
# number of blocks (a thread's run of blocks ends anywhere), widths of whole AMX steps (32 features) with a
# last block of 8 outputs, of 1 and of 18 (its second tile of 16 outputs partly used), and SmolLM2's
SHAPES = [(1, 2), (5, 37), (67, 100), (96, 33), (40, 64), (33, 32), (50, 64), (192, 576), (576, 1536)]


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("num_rows", [1, 2, 5, 6, 10, 12, 13, 16, 19, 32, 40, 48, 71])
def test_bf16_linear_is_the_fp32_summed_product_rounded_once(
    kernels: ModuleType, out_features: int, in_features: int, num_rows: int,
) -> None:
    torch.manual_seed(out_features * 1000 + in_features + num_rows)
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias = torch.randn(out_features)
    rows = torch.randn(num_rows, in_features).to(torch.bfloat16)
    packed = kernels.bf16_pack_weight(weight)
    for with_bias in (bias, None):
        got = kernels.bf16_linear(rows, packed, torch.empty(0) if with_bias is None else with_bias, in_features,
                                  out_features)
        assert got.shape == (num_rows, out_features)
        assert_rounded_once(got, expected_linear(rows, weight, with_bias))


@pytest.mark.parametrize("num_rows", [128, 129, 300])
def test_rows_past_one_chunk_are_each_their_own_product(kernels: ModuleType, num_rows: int) -> None:
    """With AMX, a thread passes its blocks over 512 KiB of rows at a time: 4 passes of 32 rows at 2,048 features, so
    these rows end a chunk exactly, one row past it, and in a partial pass of a third chunk."""
    torch.manual_seed(num_rows)
    weight = torch.randn(80, 2048).to(torch.bfloat16)
    bias = torch.randn(80)
    rows = torch.randn(num_rows, 2048).to(torch.bfloat16)
    got = kernels.bf16_linear(rows, kernels.bf16_pack_weight(weight), bias, 2048, 80)
    assert_rounded_once(got, expected_linear(rows, weight, bias))


def test_no_rows_give_an_empty_result(kernels: ModuleType) -> None:
    weight = torch.randn(40, 64).to(torch.bfloat16)
    got = kernels.bf16_linear(torch.empty(0, 64, dtype=torch.bfloat16), kernels.bf16_pack_weight(weight),
                              torch.empty(0), 64, 40)
    assert got.shape == (0, 40)


def test_no_features_give_the_bias(kernels: ModuleType) -> None:
    bias = torch.randn(40)
    packed = kernels.bf16_pack_weight(torch.empty(40, 0, dtype=torch.bfloat16))
    got = kernels.bf16_linear(torch.empty(3, 0, dtype=torch.bfloat16), packed, bias, 0, 40)
    assert_rounded_once(got, bias.double().expand(3, 40))


def test_a_non_contiguous_input_is_read_as_its_values(kernels: ModuleType) -> None:
    torch.manual_seed(2)
    weight = torch.randn(48, 64).to(torch.bfloat16)
    rows = torch.randn(64, 7).to(torch.bfloat16).T  # [7, 64], not contiguous
    got = kernels.bf16_linear(rows, kernels.bf16_pack_weight(weight), torch.empty(0), 64, 48)
    assert_rounded_once(got, expected_linear(rows, weight, None))


def test_a_packed_weight_pads_its_blocks_and_its_last_pair_with_zeros(kernels: ModuleType) -> None:
    weight = torch.randn(5, 37).to(torch.bfloat16)
    packed = kernels.bf16_pack_weight(weight)
    assert packed.shape == (1, 19, 32, 2)
    unpacked = packed.permute(0, 2, 1, 3).reshape(32, 38)
    assert torch.equal(unpacked[:5, :37], weight)
    assert not unpacked[5:].any() and not unpacked[:, 37:].any()


@pytest.mark.parametrize(("call", "message"), [
    (lambda k, w, p: k.bf16_linear(torch.randn(2, 64), p, torch.empty(0), 64, 40), "input must be a 2-D bf16"),
    (lambda k, w, p: k.bf16_linear(torch.randn(2, 2, 64).bfloat16(), p, torch.empty(0), 64, 40),
     "input must be a 2-D bf16"),
    (lambda k, w, p: k.bf16_linear(torch.randn(2, 62).bfloat16(), p, torch.empty(0), 62, 40),
     "packed must be bf16_pack_weight's layout"),
    (lambda k, w, p: k.bf16_linear(torch.randn(2, 66).bfloat16(), p, torch.empty(0), 64, 40), "input has 66 features"),
    (lambda k, w, p: k.bf16_linear(torch.randn(2, 64).bfloat16(), p, torch.empty(0), 64, 80),
     "packed must be bf16_pack_weight's layout"),
    (lambda k, w, p: k.bf16_linear(torch.randn(2, 64).bfloat16(), p.float(), torch.empty(0), 64, 40),
     "packed must be bf16_pack_weight's layout"),
    (lambda k, w, p: k.bf16_linear(torch.randn(2, 64).bfloat16(), p, torch.randn(39), 64, 40), "bias must be empty"),
    (lambda k, w, p: k.bf16_linear(torch.randn(2, 64).bfloat16(), p, torch.randn(40).bfloat16(), 64, 40),
     "bias must be empty"),
    (lambda k, w, p: k.bf16_pack_weight(w.float()), "weight must be 2-D bf16"),
])
def test_bad_arguments_are_named(kernels: ModuleType, call: object, message: str) -> None:
    weight = torch.randn(40, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        call(kernels, weight, kernels.bf16_pack_weight(weight))  # type: ignore[operator]
