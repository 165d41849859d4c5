"""``dtype="auto"``: bf16 where bf16 products beat fp32 ones (CUDA, AMX, AMD's AVX512-BF16), fp32 elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import config
from paged_kernels import cpu_features

CPU = torch.device("cpu")


@pytest.mark.parametrize(("flags", "vendor", "expected"), [
    ({"avx2", "fma"}, "AuthenticAMD", torch.float32),
    ({"avx512f", "avx512_vnni"}, "GenuineIntel", torch.float32),
    # Intel's AVX512-BF16 without AMX tiles: oneDNN's bf16 linears measured slower than its fp32 ones
    ({"avx512f", "avx512_bf16"}, "GenuineIntel", torch.float32),
    ({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "GenuineIntel", torch.bfloat16),
    ({"avx512f", "avx512_bf16"}, "AuthenticAMD", torch.bfloat16),
])
def test_auto_dtype_on_the_cpu_follows_the_hardware(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], vendor: str, expected: torch.dtype,
) -> None:
    monkeypatch.setattr(config, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(config, "cpu_vendor", lambda: vendor)
    assert config.resolve_dtype("auto", CPU) == expected
    assert config.resolve_dtype("float32", CPU) == torch.float32  # named dtypes never depend on the CPU


def test_cpu_features_are_the_first_processors_lines_of_cpuinfo() -> None:
    path = Path("/proc/cpuinfo")
    if not path.is_file():
        assert cpu_features.cpu_flags() == frozenset() and cpu_features.cpu_vendor() == ""
        return
    lines = path.read_text(errors="ignore").splitlines()
    vendor = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")), "")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    assert cpu_features.cpu_vendor() == vendor
    assert cpu_features.cpu_flags() == frozenset(flags)
