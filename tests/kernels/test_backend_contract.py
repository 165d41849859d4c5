"""Both kernel backends implement the KernelBackend protocol: every function, with its parameters in order."""

from __future__ import annotations

import inspect

import pytest
import torch

from paged_kernels import select_backend
from paged_kernels.backend import KernelBackend

CONTRACT = [name for name, member in vars(KernelBackend).items()
            if inspect.isfunction(member) and not name.startswith("_")]


def _parameters(function: object, drop_self: bool = False) -> list[str]:
    names = list(inspect.signature(function).parameters)  # type: ignore[arg-type]
    return names[1:] if drop_self else names


def test_the_contract_names_every_kernel_the_engine_calls() -> None:
    assert sorted(CONTRACT) == sorted([
        "reshape_and_cache", "plan_decode", "plan_decode_static", "paged_attention_decode", "plan_prefill",
        "paged_prefill_attention", "copy_blocks", "swap_blocks", "compiles_on_first_launch", "fused_layer_ops"])


@pytest.mark.parametrize("backend_name", ["cpu", "torch", "triton"])
def test_each_backend_has_every_contract_function_with_its_parameters(backend_name: str) -> None:
    backend = select_backend(torch.device("cpu"), backend_name)
    for name in CONTRACT:
        assert callable(getattr(backend, name, None)), f"{backend_name} lacks {name}"
        assert _parameters(getattr(backend, name)) == _parameters(getattr(KernelBackend, name), drop_self=True), name

