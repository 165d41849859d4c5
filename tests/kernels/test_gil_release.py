"""The CPU kernels release the GIL while they compute: another Python thread of the process runs during a call (a
service's token publishing and HTTP handlers share the process with the engine's stepping thread)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from paged_kernels.cpu_extension import cpu_kernels

MARGIN_S = 0.01  # a thread switch right before or after the call lands within this of its ends


def ran_during(call: Callable[[], object]) -> tuple[float, int]:
    """Run ``call`` on a second thread while this one counts its own loop iterations; the call's seconds and how many
    iterations fell inside it, more than MARGIN_S from either end."""
    call_window: list[float] = []
    stamps: list[float] = []

    def timed() -> None:
        call_window.append(time.perf_counter())
        call()
        call_window.append(time.perf_counter())

    thread = threading.Thread(target=timed)
    thread.start()
    while thread.is_alive():
        stamps.append(time.perf_counter())
        time.sleep(0.001)
    thread.join()
    start, end = call_window
    return end - start, sum(start + MARGIN_S < stamp < end - MARGIN_S for stamp in stamps)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    built = cpu_kernels()
    assert built is not None, "the CPU kernels must build here (a C++ compiler and ninja are installed)"
    return built


def test_the_sampler_kernel_lets_other_threads_run(kernels: ModuleType) -> None:
    rows, vocab = 4096, 8192
    logits = torch.randn(rows, vocab) * 4
    arguments = (logits, torch.ones(rows), torch.rand(rows), torch.zeros(rows, dtype=torch.long),
                 torch.full((rows,), 0.95), torch.zeros(rows))
    seconds, inside = ran_during(lambda: kernels.sample_tokens(*arguments))
    assert seconds > 4 * MARGIN_S, "the call is too short to tell"
    assert inside > 0


def test_the_fp16_linear_kernel_lets_other_threads_run(kernels: ModuleType) -> None:
    if not kernels.has_fp16_linear():
        pytest.skip("the CPU lacks AVX2, F16C or FMA")
    weight = kernels.fp16_pack_weight(torch.randn(4096, 1024).half())
    rows = torch.randn(2048, 1024)
    seconds, inside = ran_during(lambda: kernels.fp16_linear(rows, weight, torch.empty(0), 1024, 4096))
    assert seconds > 4 * MARGIN_S, "the call is too short to tell"
    assert inside > 0
