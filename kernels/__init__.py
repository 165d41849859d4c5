"""Paged attention and KV-cache kernels: Triton on CUDA, plain torch elsewhere."""

from __future__ import annotations

import os
from typing import cast

import torch

from kernels import reference
from kernels.backend import KernelBackend

BACKENDS = ("torch", "triton")


def select_backend(device: torch.device, requested: str | None = None) -> KernelBackend:
    """Return the kernel module for ``device``: ``triton`` on CUDA, ``torch`` otherwise.

    ``requested`` (or ``PAGEDSERVE_ATTENTION_BACKEND``) overrides the choice.
    """
    name = requested or os.environ.get("PAGEDSERVE_ATTENTION_BACKEND") or (
        "triton" if device.type == "cuda" else "torch"
    )
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "torch":
        return cast(KernelBackend, reference)
    from kernels import triton_ops  # imported lazily: triton is optional on CPU machines

    return cast(KernelBackend, triton_ops)
