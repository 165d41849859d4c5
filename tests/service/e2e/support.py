"""Helpers of the end-to-end tests: the offline reference outputs and waiting for jobs."""

from __future__ import annotations

from pathlib import Path

import httpx

from engine import LLMEngine, SamplingParams
from tests.service.procs import wait_until


def offline_greedy(model_dir: Path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy token ids of the prompts from an in-process engine (the reference for service outputs)."""
    engine = LLMEngine.from_kwargs(model=str(model_dir), dtype="float32", cpu_weight_packing="exact",
                                   kv_cache_memory="32MiB", swap_space="32MiB", max_num_seqs=32)  # as service_settings
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    results: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
    return [results[str(i)] for i in range(len(prompts))]


def wait_final(client: httpx.Client, job_id: str, timeout_s: float = 120) -> dict:
    """Poll a job until it reaches a final state and return it."""
    job: dict = {}

    def final() -> bool:
        nonlocal job
        job = client.get(f"/v1/jobs/{job_id}").json()
        return job["status"] in {"succeeded", "failed", "cancelled"}

    wait_until(final, timeout_s, f"job {job_id} to finish")
    return job
