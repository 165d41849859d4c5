"""Paged attention and KV-cache kernels: Triton on CUDA, compiled C++ and plain torch on the CPU."""

from __future__ import annotations

import os
from typing import cast

import torch

from paged_kernels import reference
from paged_kernels.backend import KernelBackend

BACKENDS = ("cpu", "torch", "triton")


def backend_name(device: torch.device, requested: str | None = None) -> str:
    """The backend ``select_backend`` picks for ``device``: ``requested``, else ``PAGEDSERVE_ATTENTION_BACKEND``,
    else ``triton`` on CUDA and ``cpu`` otherwise."""
    name = requested or os.environ.get("PAGEDSERVE_ATTENTION_BACKEND") or (
        "triton" if device.type == "cuda" else "cpu"
    )
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    return name


def select_backend(device: torch.device, requested: str | None = None) -> KernelBackend:
    """Return the kernel module for ``device``: ``triton`` on CUDA, ``cpu`` otherwise (``torch`` is the
    plain-torch reference, which ``cpu`` falls back to where its C++ kernels cannot be built).

    ``requested`` (or ``PAGEDSERVE_ATTENTION_BACKEND``) overrides the choice.
    """
    name = backend_name(device, requested)
    if name == "torch":
        return cast(KernelBackend, reference)
    if name == "cpu":
        from paged_kernels import cpu_ops
        from paged_kernels.cpu_extension import cpu_kernels

        cpu_kernels()  # built (once per machine) or loaded now, at engine start, not in the first decode step
        return cast(KernelBackend, cpu_ops)
    from paged_kernels import triton_ops  # imported lazily: triton is optional on CPU machines

    return cast(KernelBackend, triton_ops)
