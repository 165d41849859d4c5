"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

Interpreter time grows with (programs x loop iterations), so the cases stay tiny.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

from paged_kernels.cpu_extension import SOURCES, build_kernels
from paged_kernels.cpu_features import cpu_flags

CUDA = torch.cuda.is_available()
if not CUDA:
    # Must be set before any @triton.jit body is defined, i.e. before paged_kernels.triton_ops loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# On a CUDA machine every kernel test runs compiled on the GPU; elsewhere interpreted on the CPU.
# (The CPU case is left out rather than skipped there: only tests needing missing hardware may skip.)
GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")])
DEVICES = [GPU] if CUDA else [pytest.param("cpu"), GPU]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@dataclass(slots=True)
class PagedCase:
    """A random paged KV cache and the block tables of a few sequences."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    num_heads: int


def build_case(
    context_lens: list[int],
    num_heads: int = 6,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    spare_blocks: int = 3,
) -> PagedCase:
    """Scatter each sequence's blocks randomly over the cache; pad tables with -1 and extra
    columns (``spare_blocks`` past the longest context) that the kernels must not read."""
    blocks_per_seq = [(n + block_size - 1) // block_size for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, device=device).to(dtype)
    value_cache = torch.randn(shape, device=device).to(dtype)
    permutation = torch.randperm(num_blocks).tolist()
    width = max(blocks_per_seq) + spare_blocks
    block_tables = torch.full((len(context_lens), width), -1, dtype=torch.int32)
    for row, count in enumerate(blocks_per_seq):
        block_tables[row, :count] = torch.tensor(permutation[:count])
        permutation = permutation[count:]
    return PagedCase(
        key_cache,
        value_cache,
        block_tables.to(device),
        torch.tensor(context_lens, dtype=torch.int32, device=device),
        num_heads,
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal within the tolerance of the inputs' dtype (fp32 accumulation on both sides)."""
    tolerance = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Where the kernels under test run."""
    return request.param


@pytest.fixture
def make_case() -> Callable[..., PagedCase]:
    """The ``build_case`` factory."""
    return build_case


@pytest.fixture
def assert_matches() -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The ``assert_close`` check."""
    return assert_close


@pytest.fixture(scope="session")
def triton_ops() -> ModuleType:
    """The Triton backend module (interpreted on CPU-only machines)."""
    from paged_kernels import triton_ops

    return triton_ops


def kernels_for(march: str) -> ModuleType:
    """The CPU kernels built for ``-march=march``, under a test build name of their own."""
    name = f"pagedserve_cpu_kernels_{march.replace('-', '_')}_test"
    return build_kernels(name, [source.read_text() for source in SOURCES], march)


# x86-64-v3: AVX2, FMA and F16C without AVX-512 (the compiled kernels' paths for machines without AVX-512)
AVX2_FLAGS = {"avx2", "fma", "f16c"}


@pytest.fixture(scope="session")
def avx2_kernels() -> ModuleType:
    """The CPU kernels built for AVX2 alone: a machine with AVX-512 builds its own kind with -march=native, so
    without this build its tests would never run the AVX2 code."""
    if not AVX2_FLAGS <= cpu_flags():
        pytest.skip(f"the CPU lacks {sorted(AVX2_FLAGS - cpu_flags())}")
    return kernels_for("x86-64-v3")


@pytest.fixture(scope="session")
def baseline_kernels() -> ModuleType:
    """The CPU kernels built for x86-64's baseline (SSE2): the plain-loop paths that CPUs without AVX2 run."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the baseline build is x86-64's; this machine is {platform.machine()}")
    return kernels_for("x86-64")


@pytest.fixture(scope="session")
def without_amx_kernels() -> ModuleType:
    """The CPU kernels built for AVX512-BF16 without AMX (Cooper Lake's): a machine with AMX builds its own kind with
    -march=native, whose bf16 linear multiplies in tiles, so without this build its tests would never run the
    AVX512-BF16 path at whole steps of 32 features."""
    if not {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags():
        pytest.skip("the machine's own build has no AMX: it runs the AVX512-BF16 path already")
    return kernels_for("cooperlake")
