"""The CPU's int8-weight linear (``int8_pack_weight`` + ``int8_linear``) equals the fp32 product with the dequantized
weight (one scale per 32 weights of a row), in the machine's own build, the AVX2 build and the baseline x86-64 build
(plain loops), at any row count and any layer shape. Its AVX512-VNNI twin (``int8_vnni_pack_weight`` +
``int8_vnni_linear``) is the product of each row quantized to int16 in groups of 32 (one scale per group) with the
same weight, summed exactly in int32 per group, and within 2^-15 of a group's largest value of the unquantized
product."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from paged_kernels.cpu_extension import cpu_kernels
from paged_kernels.cpu_features import cpu_flags

VNNI = {"avx512_vnni", "avx512bw"} <= cpu_flags()
needs_vnni = [pytest.mark.avx512_vnni, pytest.mark.skipif(not VNNI, reason="needs a CPU with AVX512-VNNI and -BW")]


@pytest.fixture(scope="module")
def native_kernels() -> ModuleType:
    kernels = cpu_kernels()
    assert kernels is not None, "the CPU kernels must build here (a C++ compiler and ninja are installed)"
    return kernels


@pytest.fixture(scope="module")
def vnni_kernels(native_kernels: ModuleType) -> ModuleType:
    assert native_kernels.has_int8_vnni_linear(), "a CPU with AVX512-VNNI and AVX512-BW builds int8_vnni_linear"
    return native_kernels


@pytest.fixture(params=["native", pytest.param("avx2", marks=pytest.mark.x86_builds),
                        pytest.param("baseline", marks=pytest.mark.x86_builds)])
def kernels(request: pytest.FixtureRequest) -> ModuleType:
    return request.getfixturevalue(f"{request.param}_kernels")


def random_weight(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 weights and one random scale per 32 of them (the last group of a row may be shorter)."""
    qdata = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    return qdata, torch.rand(out_features, -(-in_features // 32)) / 100


def seeded_case(out_features: int, in_features: int, num_rows: int) -> tuple[torch.Tensor, ...]:
    """A shape's weight, scales, bias and rows, seeded by the shape (int8 weights, fp32 rest)."""
    torch.manual_seed(out_features * 1000 + in_features + num_rows)
    qdata, scale = random_weight(out_features, in_features)
    return qdata, scale, torch.randn(out_features), torch.randn(num_rows, in_features)


def expected_linear(
    rows: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
) -> torch.Tensor:
    """rows @ dequantized^T + bias, in fp64, with the dequantized weight built element by element."""
    weight = torch.empty(qdata.shape, dtype=torch.float64)
    for k in range(qdata.shape[1]):
        weight[:, k] = qdata[:, k].double() * scale[:, k // 32].double()
    out = rows.double() @ weight.T
    return out if bias is None else out + bias.double()


# shapes off the kernel's blocks: outputs not a multiple of 4, features not a multiple of 16
SHAPES = [(1, 16), (5, 37), (67, 100), (256, 576)]


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 9])
def test_int8_linear_is_the_product_with_the_dequantized_weight(
    kernels: ModuleType, out_features: int, in_features: int, num_rows: int,
) -> None:
    qdata, scale, bias, rows = seeded_case(out_features, in_features, num_rows)
    packed, packed_scale = kernels.int8_pack_weight(qdata, scale)
    for with_bias in (bias, None):
        got = kernels.int8_linear(rows, packed, packed_scale, torch.empty(0) if with_bias is None else with_bias,
                                  in_features, out_features)
        assert got.shape == (num_rows, out_features) and got.dtype == torch.float32
        expected = expected_linear(rows, qdata, scale, with_bias)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_rows_are_summed_in_fp32_and_rounded_once(kernels: ModuleType, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    qdata, scale = random_weight(40, 96)
    rows = torch.randn(3, 96).to(dtype)
    got = kernels.int8_linear(rows, *kernels.int8_pack_weight(qdata, scale), torch.empty(0), 96, 40)
    assert got.dtype == dtype
    expected = expected_linear(rows.float(), qdata, scale, None).float()
    # one rounding of an fp32 sum: within one unit in the last place of the dtype
    torch.testing.assert_close(got.float(), expected, rtol=torch.finfo(dtype).eps, atol=1e-6)


@pytest.mark.parametrize(("kernel", "packed_shape", "scale_shape"), [
    ("int8", (2, 4, 4, 16), (2, 2, 4)),  # blocks of 4 outputs, chunks of 16 features
    pytest.param("int8_vnni", (1, 32, 64, 2), (1, 2, 64), marks=needs_vnni),  # blocks of 64 outputs, feature pairs
])
def test_a_packed_weight_pads_its_blocks_with_zeros(
    native_kernels: ModuleType, kernel: str, packed_shape: tuple[int, ...], scale_shape: tuple[int, ...],
) -> None:
    qdata, scale = random_weight(5, 37)
    packed, packed_scale = getattr(native_kernels, f"{kernel}_pack_weight")(qdata, scale)
    assert packed.shape == packed_shape and packed.dtype == torch.int8
    unpacked = packed.permute(0, 2, 1, 3).reshape(packed_shape[0] * packed_shape[2], 64)
    assert torch.equal(unpacked[:5, :37], qdata)
    assert not unpacked[5:].any() and not unpacked[:, 37:].any()
    assert packed_scale.shape == scale_shape
    unpacked_scale = packed_scale.permute(0, 2, 1).reshape(-1, 2)
    assert torch.equal(unpacked_scale[:5], scale) and not unpacked_scale[5:].any()


@pytest.mark.parametrize("kernel", ["int8", pytest.param("int8_vnni", marks=needs_vnni)])
def test_bad_arguments_are_named(native_kernels: ModuleType, kernel: str) -> None:
    pack, linear = getattr(native_kernels, f"{kernel}_pack_weight"), getattr(native_kernels, f"{kernel}_linear")
    qdata, scale = random_weight(8, 32)
    packed, packed_scale = pack(qdata, scale)
    rows = torch.randn(2, 32)
    with pytest.raises(RuntimeError, match="input has 40 features, the weight takes 32"):
        linear(torch.randn(2, 40), packed, packed_scale, torch.empty(0), 32, 8)  # same groups
    with pytest.raises(RuntimeError, match=f"packed must be {kernel}_pack_weight's layout"):
        linear(torch.randn(2, 48), packed, packed_scale, torch.empty(0), 48, 8)
    with pytest.raises(RuntimeError, match=f"packed must be {kernel}_pack_weight's layout"):
        linear(rows, packed, packed_scale, torch.empty(0), 32, 70)  # more output blocks than packed
    with pytest.raises(RuntimeError, match=f"packed_scale must be {kernel}_pack_weight's scales"):
        linear(rows, packed, packed_scale.double(), torch.empty(0), 32, 8)
    with pytest.raises(RuntimeError, match="bias must be empty or 8"):
        linear(rows, packed, packed_scale, torch.rand(7), 32, 8)
    with pytest.raises(RuntimeError, match="input must be fp32, bf16 or fp16"):
        linear(rows.double(), packed, packed_scale, torch.empty(0), 32, 8)
    with pytest.raises(RuntimeError, match="input must be a 2-D CPU tensor"):
        linear(rows[None], packed, packed_scale, torch.empty(0), 32, 8)
    with pytest.raises(RuntimeError, match="weight must be 2-D int8"):
        pack(qdata.float(), scale)
    with pytest.raises(RuntimeError, match=r"scale must be fp32 \[8, 1\]"):
        pack(qdata, torch.rand(8, 2))


def int16_rows(rows: torch.Tensor) -> torch.Tensor:
    """The rows as the VNNI kernel quantizes them, in fp64: per group of 32, largest / 32767 times round(x * 32767 /
    largest), each step in fp32 as the kernel takes it (round half to even)."""
    values = rows.float()
    out = torch.empty(values.shape, dtype=torch.float64)
    for first in range(0, values.shape[1], 32):
        group = values[:, first:first + 32]
        largest = group.abs().amax(dim=1, keepdim=True)
        inverse = torch.where(largest > 0, torch.tensor(32767.0) / largest, torch.zeros_like(largest))
        out[:, first:first + 32] = (group * inverse).round().double() * (largest / 32767.0).double()
    return out


# shapes off the VNNI kernel's blocks: outputs not a multiple of 64, features not a multiple of 32
VNNI_SHAPES = [(1, 16), (5, 37), (67, 100), (130, 576)]


@pytest.mark.avx512_vnni
@pytest.mark.skipif(not VNNI, reason="needs a CPU with AVX512-VNNI and -BW")
@pytest.mark.parametrize(("out_features", "in_features"), VNNI_SHAPES)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5])
def test_vnni_linear_is_the_product_of_the_int16_rows_and_the_dequantized_weight(
    vnni_kernels: ModuleType, out_features: int, in_features: int, num_rows: int,
) -> None:
    qdata, scale, bias, rows = seeded_case(out_features, in_features, num_rows)
    rows[0, : min(32, in_features)] = 0.0  # an all-zero group: scale 0, no division by it
    packed, packed_scale = vnni_kernels.int8_vnni_pack_weight(qdata, scale)
    for with_bias in (bias, None):
        got = vnni_kernels.int8_vnni_linear(rows, packed, packed_scale,
                                            torch.empty(0) if with_bias is None else with_bias, in_features,
                                            out_features)
        assert got.shape == (num_rows, out_features) and got.dtype == torch.float32
        expected = expected_linear(int16_rows(rows), qdata, scale, with_bias)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
        unquantized = expected_linear(rows, qdata, scale, with_bias)
        torch.testing.assert_close(got.double(), unquantized, rtol=0, atol=1e-3)


@pytest.mark.avx512_vnni
@pytest.mark.skipif(not VNNI, reason="needs a CPU with AVX512-VNNI and -BW")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vnni_reduced_precision_rows_are_rounded_once(vnni_kernels: ModuleType, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    qdata, scale = random_weight(40, 96)
    rows = torch.randn(3, 96).to(dtype)
    got = vnni_kernels.int8_vnni_linear(rows, *vnni_kernels.int8_vnni_pack_weight(qdata, scale), torch.empty(0), 96, 40)
    assert got.dtype == dtype
    expected = expected_linear(int16_rows(rows), qdata, scale, None).float()
    torch.testing.assert_close(got.float(), expected, rtol=torch.finfo(dtype).eps, atol=1e-5)


@pytest.mark.x86_builds
@pytest.mark.parametrize("build", ["avx2", "baseline"])
def test_builds_without_avx512_refuse_its_kernels_by_name(request: pytest.FixtureRequest, build: str) -> None:
    kernels = request.getfixturevalue(f"{build}_kernels")
    assert not kernels.has_bf16_linear() and not kernels.has_int8_vnni_linear()
    weight = torch.zeros(1, 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16_linear: this build has no AVX512-BF16"):
        kernels.bf16_linear(weight, kernels.bf16_pack_weight(weight), torch.empty(0), 2, 1)
    packed, packed_scale = kernels.int8_vnni_pack_weight(*random_weight(1, 32))
    with pytest.raises(RuntimeError, match="int8_vnni_linear: this build has no AVX512-VNNI"):
        kernels.int8_vnni_linear(torch.zeros(1, 32), packed, packed_scale, torch.empty(0), 32, 1)
