"""The service's ceiling: the same workload through the offline engine, built as `pagedserve up`'s worker builds it
(its settings' defaults and the same ``--pagedserve-flags``).

The engine gets ``concurrency`` as ``max_num_seqs``, so that as many requests run at once as the client keeps in
flight against the server; every request has exactly ``prompt_tokens`` random prompt ids and makes exactly
``output_tokens`` tokens (EOS ignored), as guidellm's synthetic requests do, sampled as the service samples them:
guidellm sends no sampling parameters, so the service's defaults apply (temperature 1, core/sampling_fields.py).
``pagedserve ÷ offline`` is then what the service (HTTP, queue, database, event publishing, the client sharing the
CPU) keeps of the engine's throughput.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from benchmarks.guidellm_client import Workload

SYSTEM = "offline"  # the `--systems` name and the rows' system
WARMUP_TOKENS = 4
PROMPT_SEED = 0


def prompts(workload: Workload, vocab_size: int) -> list[list[int]]:
    """Seeded random prompts of exactly ``workload.prompt_tokens`` ids, with no shared prefix to cache."""
    rng = random.Random(PROMPT_SEED)
    return [[rng.randrange(1000, vocab_size) for _ in range(workload.prompt_tokens)]
            for _ in range(workload.num_requests)]


def engine_kwargs(model: str, pagedserve_flags: list[str], concurrency: int) -> dict[str, Any]:
    """The worker's engine arguments under `pagedserve up --model model *pagedserve_flags`, with ``concurrency``
    sequences at most."""
    from cli.flags import add_settings_flags, command_settings
    from cli.main import settings_from
    from worker.service import engine_kwargs as worker_engine_kwargs

    parser = argparse.ArgumentParser(prog="pagedserve up")
    add_settings_flags(parser, command_settings("up"))
    settings = settings_from(parser.parse_args(["--model", model, *pagedserve_flags]))
    return worker_engine_kwargs(settings) | {"max_num_seqs": concurrency}


def service_default_sampling() -> dict[str, Any]:
    """The sampling parameters a request that names none gets from the service (what guidellm's requests get)."""
    from core.sampling_fields import SAMPLING_FIELDS

    return {name: SAMPLING_FIELDS[name].default for name in ("temperature", "top_p", "top_k", "min_p")}


def run(model: str, pagedserve_flags: list[str], workload: Workload, concurrency: int) -> dict[str, Any]:
    """Time ``LLM.generate`` of the workload after a warm-up request; a row like guidellm_client.summarize's."""
    from engine import LLM, SamplingParams

    kwargs = engine_kwargs(model, pagedserve_flags, concurrency)
    llm = LLM(**kwargs)
    try:
        llm.generate([[1000 + i for i in range(16)]], SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0),
                     use_tqdm=False)
        params = SamplingParams(max_tokens=workload.output_tokens, ignore_eos=True, **service_default_sampling())
        started = time.perf_counter()
        outputs = llm.generate(prompts(workload, llm.engine.model.config.vocab_size), params, use_tqdm=False)
        duration_s = time.perf_counter() - started
    finally:
        # free the engine, whose KV cache was sized from the memory free at its start, before the next one starts,
        # even when this run raised (its traceback would hold it)
        del llm
    output_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    return {
        "requests_successful": len(outputs), "requests_failed": 0, "duration_s": duration_s,
        "output_tokens": output_tokens, "output_tokens_per_s": output_tokens / duration_s,
    }
