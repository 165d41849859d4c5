"""Drive a paged engine over a workload and measure throughput, batch size, KV waste and latency."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from benchmarks.workloads import Request
from engine import SamplingParams

OnAdd = Callable[[Any, str, Request], None]
MakeParams = Callable[[int, Request], SamplingParams]


def greedy_params(index: int, request: Request) -> SamplingParams:
    """Greedy decoding of exactly the request's output length (EOS ignored)."""
    return SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)


@dataclass(slots=True)
class StepSamples:
    """Per-step observations taken right after the scheduler placed the step's work."""

    batch_sizes: list[int] = field(default_factory=list)
    kv_waste: list[float] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    # device blocks in the running sequences' tables: counted once (as held) and per sequence
    blocks_shared: list[int] = field(default_factory=list)
    blocks_unshared: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)  # every step's wall time, as run_engine timed it


@dataclass(slots=True)
class RequestTiming:
    """One finished request: seconds from its (intended) arrival to first token and to the end."""

    output_len: int
    ttft_s: float
    latency_s: float


@dataclass(slots=True)
class EngineRun:
    """What one pass of a workload through an engine produced."""

    elapsed_s: float
    output_tokens: int
    samples: StepSamples
    timings: list[RequestTiming]
    num_preemptions: int


def probe_steps(engine: Any, samples: StepSamples) -> None:
    """Observe ``engine``'s steps: each non-empty one records batch size and KV state once scheduled."""

    def observe(out: Any) -> None:
        if out.is_empty:
            return
        stats = engine.stats()
        samples.batch_sizes.append(len(out.scheduled))
        samples.kv_waste.append(stats.kv_cache_waste_ratio)
        samples.kv_usage.append(stats.kv_cache_usage)
        tables = [item.block_table for item in out.scheduled]
        samples.blocks_shared.append(len({block for table in tables for block in table}))
        samples.blocks_unshared.append(sum(len(table) for table in tables))

    engine.step_observers.append(observe)


def run_engine(
    engine: Any, requests: list[Request], arrivals: list[float] | None = None,
    make_params: MakeParams = greedy_params, on_add: OnAdd | None = None, desc: str = "pagedserve",
) -> EngineRun:
    """Feed ``requests`` (all at once, or at ``arrivals`` offsets in seconds) and step to completion."""
    samples = StepSamples()
    probe_steps(engine, samples)
    offsets = arrivals or [0.0] * len(requests)
    timings: list[RequestTiming] = []
    output_tokens = 0
    next_request = 0
    start = time.monotonic()
    with tqdm(total=len(requests), desc=desc, unit="req", leave=False) as bar:
        while next_request < len(requests) or engine.has_unfinished_requests():
            now = time.monotonic() - start
            while next_request < len(requests) and offsets[next_request] <= now:
                request = requests[next_request]
                params = make_params(next_request, request)
                engine.add_request(str(next_request), request.prompt_token_ids, params)
                if on_add is not None:
                    on_add(engine, str(next_request), request)
                next_request += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, offsets[next_request] - now))
                continue
            step_start = time.monotonic()
            outputs = engine.step()
            samples.step_s.append(time.monotonic() - step_start)
            for output in outputs:
                if not output.finished:
                    continue
                index = int(output.request_id)
                finished = output.metrics.finished_time - start
                first_token = output.metrics.first_token_time - start
                output_tokens += sum(len(o.token_ids) for o in output.outputs)
                timings.append(RequestTiming(requests[index].output_len, first_token - offsets[index],
                                             finished - offsets[index]))
                bar.update(1)
    elapsed = time.monotonic() - start
    return EngineRun(elapsed, output_tokens, samples, timings, engine.stats().num_preemptions)


def summarize(run: EngineRun, num_requests: int) -> dict[str, float]:
    """Throughput, batch size and KV figures of one run, as JSON-ready numbers."""
    samples = run.samples
    return {
        "elapsed_s": run.elapsed_s,
        "output_tokens": run.output_tokens,
        "output_tokens_per_s": run.output_tokens / run.elapsed_s,
        "requests_per_s": num_requests / run.elapsed_s,
        "num_steps": len(samples.batch_sizes),
        "mean_batch_size": statistics.fmean(samples.batch_sizes),
        "peak_batch_size": max(samples.batch_sizes),
        "mean_kv_waste": statistics.fmean(samples.kv_waste),
        "mean_kv_usage": statistics.fmean(samples.kv_usage),
        "num_preemptions": run.num_preemptions,
    }
