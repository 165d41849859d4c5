"""What the CPU computes in hardware, read once from ``/proc/cpuinfo``'s flags (none where there is no such file)."""

from __future__ import annotations

from functools import lru_cache

import torch

# the AMX flag under which the CPU multiplies each reduced-precision dtype in tiles
_AMX_FLAGS = {torch.bfloat16: "amx_bf16", torch.float16: "amx_fp16"}


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``avx512_bf16``, ``amx_bf16``…); empty where the OS does not list them."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_amx_for(dtype: torch.dtype) -> bool:
    """True if the CPU multiplies ``dtype`` matrices in AMX tiles."""
    flag = _AMX_FLAGS.get(dtype)
    return flag is not None and flag in cpu_flags()
