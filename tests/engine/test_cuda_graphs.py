"""Decode from captured graphs: padded batches, static buffers, when graphs are used and when not.

The graphs here are ``EagerCapture`` (on CUDA too, where these tests run with the compiled kernels):
the captured function re-runs over the same static buffers with the plan made at capture, which checks
padding, buffers and static plans but not a CUDA capture or replay; the ``gpu`` test compares real
graphs with eager decoding.
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before paged_kernels.triton_ops defines its kernels

from engine import LLM, SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.cuda_graphs import (  # noqa: E402
    PADDING_SLOT,
    CudaGraphCapture,
    DecodeGraphRunner,
    EagerCapture,
    capture_decode_graphs,
    capture_sizes,
    garbage_collection_paused,
    padded_batch_size,
    uses_cuda_graphs,
)
from paged_kernels.checks import HostTables  # noqa: E402
from tests.engine.test_device_syncs import DEVICE, READ_BACKS, ReadBackCounter  # noqa: E402

BLOCK_SIZE = 8
MAX_MODEL_LEN = 64  # static tables of 8 blocks


def _llm(folder: Path, backend: str, **kwargs: object) -> LLM:
    """An engine stepping eagerly unless told otherwise: the tests attach their own graphs."""
    settings = {"device": DEVICE, "enforce_eager": True, **kwargs}
    return LLM(model=str(folder), dtype="float32", kv_cache_memory="2MiB", attention_backend=backend,
               block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, **settings)


def _static_graphs(llm: LLM, max_batch: int) -> DecodeGraphRunner:
    """Graphs of the static-buffer path, run eagerly, attached to the engine's runner."""
    engine = llm.engine
    graphs = DecodeGraphRunner(engine.model, engine.cache, engine.ops, MAX_MODEL_LEN // BLOCK_SIZE,
                               capture_sizes(max_batch))
    graphs.capture(EagerCapture)
    engine.runner.graphs = graphs
    return graphs


def _add(llm: LLM, max_tokens: list[int]) -> None:
    for i, n in enumerate(max_tokens):
        llm.engine.add_request(f"r{i}", list(range(10 + 3 * i, 19 + 5 * i)),
                               SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


def test_capture_sizes_are_1_2_4_then_multiples_of_8_up_to_the_first_that_holds_the_batch() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(10) == [1, 2, 4, 8, 16]
    assert capture_sizes(64) == [1, 2, 4, *range(8, 65, 8)]
    with pytest.raises(ValueError, match="max_batch"):
        capture_sizes(0)


def test_collection_is_paused_after_one_collection_and_resumes() -> None:
    # a cycle collected during a capture released an earlier engine's CUDA objects and invalidated the capture
    class Cycle:
        pass

    garbage = Cycle()
    garbage.itself = garbage  # type: ignore[attr-defined]
    ref = weakref.ref(garbage)
    del garbage
    with garbage_collection_paused():
        assert ref() is None
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_batch_runs_in_the_smallest_size_that_holds_it() -> None:
    sizes = capture_sizes(24)
    assert [padded_batch_size(sizes, n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 24, 25)] == \
        [1, 2, 4, 4, 8, 8, 16, 24, 24, None]


def test_cuda_captures_unless_enforce_eager_and_the_cpu_never_does(tiny_model_dir: Path) -> None:
    assert uses_cuda_graphs(torch.device("cuda"), enforce_eager=False)
    assert not uses_cuda_graphs(torch.device("cuda"), enforce_eager=True)
    assert not uses_cuda_graphs(torch.device("cpu"), enforce_eager=False)
    assert _llm(tiny_model_dir, "torch", device="cpu", enforce_eager=False).engine.runner.graphs is None


def test_a_backend_that_plans_decode_only_from_values_decodes_eagerly_instead_of_capturing(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    # the reference backend's decode plan is a gather of the step's blocks, made from lengths read back:
    # no graph can replay it, so the engine steps eagerly (before any CUDA call: this runs on the CPU)
    engine = _llm(tiny_model_dir, "torch").engine
    assert capture_decode_graphs(engine.model, engine.cache, engine.ops, MAX_MODEL_LEN // BLOCK_SIZE, 4) is None
    assert "decode runs eagerly" in caplog.text
    triton = _llm(tiny_model_dir, "triton").engine
    graphs = DecodeGraphRunner(triton.model, triton.cache, triton.ops, MAX_MODEL_LEN // BLOCK_SIZE, [1])
    assert graphs.plans_statically()


@pytest.mark.parametrize(("field", "value"), [("enforce_eager", "yes"), ("cuda_graph_max_batch", 0),
                                              ("cuda_graph_max_batch", True)])
def test_a_bad_graph_setting_is_refused_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_padding_rows_write_no_slot_and_read_one_token_of_block_0(tiny_model_dir: Path) -> None:
    graphs = _static_graphs(_llm(tiny_model_dir, "torch"), max_batch=4)
    fields = graphs.host_fields([5, 6], [9, 20], [73, 164], HostTables([[9, 2], [4, 7, 20]], [10, 21]), 4)
    assert fields == [[5, 6, 0, 0], [9, 20, 0, 0], [73, 164, PADDING_SLOT, PADDING_SLOT],
                      [9, 2, 0, 4, 7, 20, 0, 0, 0, 0, 0, 0], [10, 21, 1, 1]]


def test_steps_a_graph_cannot_hold_run_eagerly(tiny_model_dir: Path) -> None:
    graphs = _static_graphs(_llm(tiny_model_dir, "torch"), max_batch=2)
    decodes = HostTables([[1], [2]], [3, 4])
    assert graphs.size_for(decodes, num_prefills=0) == 2
    assert graphs.size_for(decodes, num_prefills=1) is None  # a mixed step
    assert graphs.size_for(HostTables([[1]] * 3, [3] * 3), num_prefills=0) is None  # above the largest size
    assert graphs.size_for(HostTables([list(range(9))], [3]), num_prefills=0) is None  # wider than the buffers


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_padded_graph_step_gives_the_eager_logits_and_writes_only_its_own_slots(
    tiny_model_dir: Path, backend: str,
) -> None:
    llm = _llm(tiny_model_dir, backend)
    _add(llm, [4, 4, 4])
    llm.engine.step()  # the prefills
    out = llm.engine.scheduler.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [1, 1, 1]
    eager_logits, _, _ = llm.engine.runner.execute(out)
    before = llm.engine.cache.gpu_kv.clone()
    graphs = _static_graphs(llm, max_batch=4)  # warm-up and capture run padding rows only
    graph_logits, _, _ = llm.engine.runner.execute(out)  # the same step again, 3 rows padded to 4
    assert graphs.num_replays == 1
    torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-5, atol=1e-5)

    def by_slot(kv: torch.Tensor) -> torch.Tensor:  # [layers, 2, slots, kv_heads, head_dim]
        return kv.flatten(2, 3)

    slots = [s.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for s in out.scheduled for p in [s.seq.num_computed_tokens]]
    others = torch.ones(by_slot(before).shape[2], dtype=torch.bool)
    others[slots] = False
    after = llm.engine.cache.gpu_kv
    assert torch.equal(by_slot(after)[:, :, others], by_slot(before)[:, :, others])
    torch.testing.assert_close(by_slot(after)[:, :, slots], by_slot(before)[:, :, slots])


def test_the_captured_forward_reads_nothing_back_and_makes_no_tensor_from_host_data(tiny_model_dir: Path) -> None:
    # what a CUDA graph cannot hold: a read-back stalls (and fails) a capture, a tensor made from a host list
    # is a copy the graph would replay from stale host memory
    llm = _llm(tiny_model_dir, "triton")
    _add(llm, [4, 4, 4])
    llm.engine.step()
    graphs = _static_graphs(llm, max_batch=4)
    counter = ReadBackCounter(READ_BACKS | {"tensor", "as_tensor"})
    with counter, torch.inference_mode():  # as in ModelRunner.execute
        for capture, _ in graphs.graphs.values():
            capture.replay()  # EagerCapture: runs the forward a CUDA graph records
    assert not counter.sites, dict(counter.sites)


def test_greedy_decoding_from_graphs_matches_eager_and_runs_only_small_decode_batches_in_them(
    tiny_model_dir: Path,
) -> None:
    lengths = [3, 6, 9]  # the batch shrinks from 3 to 1
    eager = _llm(tiny_model_dir, "triton")
    _add(eager, lengths)
    graphed = _llm(tiny_model_dir, "triton")
    graphs = _static_graphs(graphed, max_batch=2)
    _add(graphed, lengths)
    small_decode_steps = []
    graphed.engine.step_observers.append(lambda out: small_decode_steps.append(
        len(out.scheduled) <= 2 and all(s.num_new_tokens == 1 for s in out.scheduled)))
    tokens = {}
    for name, llm in (("eager", eager), ("graphed", graphed)):
        while llm.engine.has_unfinished_requests():
            for output in llm.engine.step():
                tokens[name, output.request_id] = output.outputs[0].token_ids
    assert {k[1]: v for k, v in tokens.items() if k[0] == "graphed"} == \
        {k[1]: v for k, v in tokens.items() if k[0] == "eager"}
    assert [len(tokens["graphed", f"r{i}"]) for i in range(3)] == lengths
    assert graphs.num_replays == sum(small_decode_steps) > 0
    assert sum(small_decode_steps) < len(small_decode_steps)  # the prefill and 3-row steps ran eagerly


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decoding_from_cuda_graphs_gives_the_eager_tokens(tiny_model_dir: Path) -> None:
    prompts = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 12, 20)]
    results = []
    for enforce_eager in (True, False):
        llm = LLM(model=str(tiny_model_dir), dtype="float32", device="cuda", kv_cache_memory="64MiB",
                  enforce_eager=enforce_eager, max_num_seqs=8)
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == enforce_eager
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8] and graphs.num_replays > 0
    assert results[1] == results[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_engine_captures_while_an_earlier_one_waits_in_a_cycle_for_collection(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # on an H200 a collection during capture released an earlier engine's CUDA objects and failed the capture;
    # automatic collections come when they will, so each capture here collects, as one would, if collection is on
    capture = CudaGraphCapture.capture

    def capture_then_collect(self: CudaGraphCapture, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        def forward_then_collect() -> torch.Tensor:
            out = forward()
            if gc.isenabled():
                gc.collect()
            return out

        return capture(self, forward_then_collect)

    monkeypatch.setattr(CudaGraphCapture, "capture", capture_then_collect)
    earlier = LLM(model=str(tiny_model_dir), dtype="float32", device="cuda", kv_cache_memory="8MiB", max_num_seqs=8)
    earlier.itself = earlier  # type: ignore[attr-defined]  # freed only by a collection
    gone = weakref.ref(earlier)
    del earlier
    llm = LLM(model=str(tiny_model_dir), dtype="float32", device="cuda", kv_cache_memory="8MiB", max_num_seqs=8)
    assert gone() is None
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.num_replays > 0
