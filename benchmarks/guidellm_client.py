"""guidellm, the vLLM project's serving benchmark, run offline as a subprocess with one fixed synthetic workload."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# no Hub look-ups: the tokenizer is a local folder and the data are synthetic
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
PERCENTILES = (50, 90, 99)
REQUEST_TIMEOUT_S = 3600  # a slow server is measured, not failed
# measured only when tokens stream (guidellm reports 0 for whole responses)
STREAMING_LATENCIES_MS = {"ttft_ms": "time_to_first_token_ms", "itl_ms": "inter_token_latency_ms"}
DEFAULT_PROMPT_SEED = 42  # guidellm's own default


@dataclass(frozen=True, slots=True)
class Workload:
    """The requests every server gets: synthetic text of exact prompt/output token counts, EOS ignored."""

    num_requests: int
    prompt_tokens: int
    output_tokens: int
    repeat_prompts: bool = False  # every run the same prompts (guidellm's default seed), else each run its own


@dataclass(frozen=True, slots=True)
class Target:
    """An OpenAI-compatible server: where it listens, the model name it answers to, its API key if any."""

    base_url: str
    model: str
    api_key: str | None = None


def command(target: Target, tokenizer_dir: Path, workload: Workload, stream: bool, concurrency: int,
            report_path: Path, prompt_seed: int = DEFAULT_PROMPT_SEED) -> list[str]:
    """``guidellm run``: ``workload`` sent to ``/v1/completions`` with ``concurrency`` requests in flight, its
    synthetic prompts drawn with ``prompt_seed`` (the same seed, the same prompts)."""
    backend = (f"kind=openai_http,target={target.base_url},model={target.model},request_format=/v1/completions,"
               f"stream={str(stream).lower()},timeout={REQUEST_TIMEOUT_S}")
    if target.api_key:
        backend += f",api_key={target.api_key}"
    return [
        sys.executable, "-m", "guidellm", "run", "--backend", backend,
        "--profile", f"kind=concurrent,streams={concurrency}",
        "--constraint", f"kind=max_requests,count={workload.num_requests}",
        # guidellm asks for max_tokens = output_tokens with ignore_eos, so every request makes exactly that many
        "--data", (f"kind=synthetic_text,prompt_tokens={workload.prompt_tokens},"
                   f"output_tokens={workload.output_tokens}"),
        # guidellm's data worker otherwise prepares 4,096 prompts ahead, whatever the run's count: a synthetic
        # prompt costs it about 0.8 ms of CPU, so for the first seconds of a run the client takes most of a core
        # from the server it measures (measured on a 2-vCPU host: 0.7-0.8 cores for about 4 s)
        "--data-loader", f"kind=pytorch,prefetch_factor={workload.num_requests}",
        "--seed", f"kind=static,value={prompt_seed}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
        "--output", f"kind=json,path={report_path}",
        "--disable-console",
    ]


def environment(client_processes: int) -> dict[str, str]:
    """The client's environment: offline, and at most ``client_processes`` worker processes (guidellm would
    start up to 10, which on a small machine take CPU from the server being measured)."""
    return {**os.environ, **OFFLINE_ENV, "GUIDELLM__MAX_WORKER_PROCESSES": str(client_processes)}


def run(target: Target, tokenizer_dir: Path, workload: Workload, stream: bool, concurrency: int,
        client_processes: int, work_dir: Path, prompt_seed: int = DEFAULT_PROMPT_SEED) -> dict[str, Any]:
    """Run guidellm once and return ``summarize`` of its report; raise with its log's tail if it fails."""
    name = f"{'streaming' if stream else 'non-streaming'}-c{concurrency}"
    report_path, log_path = work_dir / f"{name}.json", work_dir / f"{name}.log"
    with log_path.open("w") as log:
        argv = command(target, tokenizer_dir, workload, stream, concurrency, report_path, prompt_seed)
        returncode = subprocess.run(argv, env=environment(client_processes), stdout=log,
                                    stderr=subprocess.STDOUT).returncode
    if returncode != 0 or not report_path.is_file():
        tail = "\n".join(log_path.read_text().splitlines()[-15:])
        raise RuntimeError(f"guidellm failed (exit {returncode}) against {target.base_url}; last lines:\n{tail}")
    return summarize(json.loads(report_path.read_text()), stream)


def _percentiles(metric: dict[str, Any], name: str, scale: float = 1.0) -> dict[str, float]:
    """``<name>_p50``, ``_p90``, ``_p99`` of a guidellm distribution's successful requests, times ``scale``."""
    percentiles = metric["successful"]["percentiles"]
    return {f"{name}_p{q}": percentiles[f"p{q}"] * scale for q in PERCENTILES}


def summarize(report: dict[str, Any], stream: bool) -> dict[str, Any]:
    """Request counts, output tokens per second of the measured window, and latency percentiles (ms) of the
    successful requests (TTFT and inter-token latency too when ``stream``), from guidellm's JSON report."""
    (benchmark,) = report["benchmarks"]
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]
    output_tokens = metrics["output_token_count"]["successful"]["total_sum"]
    summary: dict[str, Any] = {
        "requests_successful": totals["successful"],
        "requests_failed": totals["errored"] + totals["incomplete"],
        "duration_s": benchmark["duration"],
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / benchmark["duration"],
        **_percentiles(metrics["request_latency"], "latency_ms", scale=1000.0),  # guidellm's are in seconds
    }
    if stream:
        for name, key in STREAMING_LATENCIES_MS.items():
            summary |= _percentiles(metrics[key], name)
    return summary
