"""A step's metadata reaches the device intact through the reused pinned staging buffer."""

from __future__ import annotations

import pytest
import torch

from engine.model_runner import StagingBuffer


def test_the_cpu_gets_the_values_as_one_int64_tensor() -> None:
    uploaded = StagingBuffer(torch.device("cpu")).upload([3, -1, 2**40])
    assert uploaded.dtype == torch.int64 and uploaded.tolist() == [3, -1, 2**40]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_upload_waits_for_the_last_copy_out_of_the_pinned_buffer_before_overwriting_it() -> None:
    # a step that samples nothing reads nothing back: its copy can still be queued behind the
    # previous step's kernels (the spin here) when the next step stages its own values
    staging = StagingBuffer(torch.device("cuda"))
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time ahead of the first copy
    first = staging.upload([1, 2, 3])
    second = staging.upload([4, 5, 6])
    assert first.tolist() == [1, 2, 3]
    assert second.tolist() == [4, 5, 6]
