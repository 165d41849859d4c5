"""What the CPU computes in hardware, read once from ``/proc/cpuinfo`` (nothing where there is no such file)."""

from __future__ import annotations

from functools import lru_cache

import torch

# the AMX flag under which the CPU multiplies each reduced-precision dtype in tiles
_AMX_FLAGS = {torch.bfloat16: "amx_bf16", torch.float16: "amx_fp16"}


@lru_cache(maxsize=1)
def _first_processor() -> dict[str, str]:
    """The fields of the first processor in ``/proc/cpuinfo`` (``flags``, ``vendor_id``…); empty without the file."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():  # a blank line ends a processor's block
                    break
                name, _, value = line.partition(":")
                fields[name.strip()] = value.strip()
    except OSError:
        pass
    return fields


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``avx512_bf16``, ``amx_bf16``…); empty where the OS does not list them."""
    return frozenset(_first_processor().get("flags", "").split())


def cpu_vendor() -> str:
    """The CPU's vendor id (``GenuineIntel``, ``AuthenticAMD``); empty where the OS does not list it."""
    return _first_processor().get("vendor_id", "")


def has_amx_for(dtype: torch.dtype) -> bool:
    """True if the CPU multiplies ``dtype`` matrices in AMX tiles."""
    flag = _AMX_FLAGS.get(dtype)
    return flag is not None and flag in cpu_flags()


def has_fbgemm_fp16() -> bool:
    """True if torch's fbgemm can multiply fp32 rows by fp16-stored weights (its AVX2/F16C/FMA kernels)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and {"avx2", "f16c", "fma"} <= cpu_flags()

