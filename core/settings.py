"""The one settings object of the service, read from PAGEDSERVE_* environment variables."""

from __future__ import annotations

import json
import logging
import math
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ByteSize, Field, ValidationInfo, field_serializer, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# the names `dtype` and `kv_cache_dtype` take (engine.config.DTYPE_NAMES, which the service does not import)
DtypeName = Literal["auto", "float32", "fp32", "float", "bfloat16", "bf16", "float16", "fp16", "half"]


class Settings(BaseSettings):
    """Service configuration; every field is PAGEDSERVE_<NAME> in the environment and --<name> on the CLI."""

    # inf and nan are no durations, sizes or fractions (an inf also reaches a child process as null)
    model_config = SettingsConfigDict(env_prefix="PAGEDSERVE_", extra="ignore", allow_inf_nan=False)

    data_dir: Path = Field(Path("~/.local/share/pagedserve"), description="embedded SQLite, Redis files, uploads")
    cache_dir: Path = Field(Path("~/.cache/pagedserve"), description="converted model weights")
    database_url: str | None = Field(None, description="SQLAlchemy URL of the job store (default: SQLite in data dir)")
    database_pool_size: int = Field(10, ge=1, description="database connections a process keeps open")
    database_max_overflow: int = Field(60, ge=0, description="extra database connections a process may open at peaks")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Celery broker and token event streams")
    redis_key_prefix: str = Field("pagedserve:", description="prefix of every Redis key the service writes")
    host: str = Field("127.0.0.1", description="where the API listens")
    port: int = Field(8000, ge=1, le=65_535, description="API port")
    metrics_port: int = Field(9400, ge=1, le=65_535, description="a worker's Prometheus port")
    metrics_host: str = Field("127.0.0.1", description="where a worker serves its Prometheus metrics")
    model: str = Field("smollm2-135m-instruct", description="model name or local HF folder")
    dtype: DtypeName = Field(
        "auto", description="weights dtype: auto = bf16 where the device computes it fast, else float32")
    kv_cache_dtype: DtypeName = Field(
        "auto", description="KV cache dtype (as vLLM's --kv-cache-dtype, without fp8): auto = the model's dtype, but "
        "float16 for a float32 model whose weights the CPU holds in fp16 or int8, under the cpu attention backend "
        "(half the bytes to read, twice the tokens in kv_cache_memory); a name: the model's dtype, or float16 / "
        "bfloat16 under a float32 model on the CPU (not with the triton backend)")
    kv_cache_memory: str | None = Field(None, description="KV cache budget on the device (default: engine's choice)")
    swap_space: ByteSize = Field(ByteSize(4 << 30), description="CPU swap pool for preempted KV blocks: GiB when a "
                                 "bare number (as vLLM), or with a unit such as 512MiB")
    max_num_seqs: int = Field(64, ge=1, le=1024, description="engine batch limit and worker concurrency")
    block_size: int = Field(16, ge=1, description="KV block size in tokens")
    preemption_mode: Literal["swap", "recompute"] = Field("swap", description="how the engine preempts")
    attention_backend: Literal["cpu", "torch", "triton"] | None = Field(None, description="attention implementation")
    num_threads: int | None = Field(
        None, ge=1, le=1024, description="a worker's CPU threads for torch (default: torch's)")
    cpu_weight_packing: Literal["auto", "onednn", "fp16", "exact", "off"] = Field(
        "auto", description="prepacked weights on the CPU: onednn = oneDNN's layout (fp32 and bf16), fp16 = fp32 "
        "models' weights in fp16 for fbgemm (bf16 models: onednn), auto = the fastest (bf16: our AVX512-BF16 "
        "kernel's layout where the CPU has AVX512-BF16 and no AMX, else onednn; fp32: fp16 where fbgemm runs, else "
        "onednn), exact = bf16 packed for oneDNN only (fp32 tokens equal transformers')")
    quantization: Literal["int8", "int8_weight_only"] | None = Field(
        None, description="int8 = int8 weights and activations in the linear layers (CPU; faster, small quality cost); "
        "int8_weight_only = int8 weights read by a compiled kernel in decode steps of up to 4 rows with "
        "AVX512-VNNI (1 with AVX-512 alone, 2 with AVX2): the fastest at that many in flight (CPU with a C++ "
        "compiler; holds the weights dequantized too, for larger steps)")
    max_model_len: int | None = Field(None, ge=1, description="context length (default: the model's own)")
    enforce_eager: bool = Field(
        False, description="run every step eagerly: no CUDA graphs (on CUDA, decode batches up to "
        "cuda_graph_max_batch run from graphs captured at start; the CPU never captures)")
    cuda_graph_max_batch: int = Field(
        256, ge=1, description="largest decode batch run from a CUDA graph (batches are padded to 1, 2, 4, 8, 16, ...)")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="fraction of the GPU's total memory for weights, activations and KV cache "
        "(as vLLM; unused when kv_cache_memory is set)")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="tokens one engine step may compute (unset: 2048 on a GPU, 256 on a CPU)")
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of shared prompt prefixes")
    seed: int = Field(0, ge=0, description="seed of the engine's sampler")
    tokenizer: Path | None = Field(None, description="local tokenizer folder (default: the model's)")
    chat_template: str | None = Field(None, description="chat template file or Jinja text (default: the model's)")
    enable_auto_tool_choice: bool = Field(
        False, description="tool_choice auto (a chat request's default when it has tools) reads tool calls out of the "
        "output with --tool-call-parser (as vLLM; without it, auto answers the text as content)")
    tool_call_parser: Literal["hermes", "mistral", "granite", "llama3_json", "pythonic"] | None = Field(
        None, description="the model's tool-call format: hermes (<tool_call> JSON blocks: Hermes, Qwen, SmolLM2), "
        "mistral ([TOOL_CALLS]), granite (<|tool_call|>), llama3_json (Llama 3.1-3.3), pythonic (Llama 3.2 and 4: "
        "[f(x=1)])")
    api_key: Annotated[list[str] | None, NoDecode] = Field(
        None, min_length=1, description="bearer tokens the API accepts besides the stored keys, as vLLM's --api-key "
        "(each is a key of its own: its jobs are its own); the environment gives one token, or a JSON list")
    tensor_parallel_size: int = Field(
        1, ge=1, le=1, description="devices one worker's model spans (vLLM's flag): pagedserve runs one per worker; "
        "start more workers to serve more")
    pipeline_parallel_size: int = Field(
        1, ge=1, le=1, description="pipeline stages one worker's model spans (vLLM's flag): one per worker")
    served_model_name: Annotated[list[Annotated[str, Field(min_length=1)]] | None, NoDecode] = Field(
        None, min_length=1, description="model names the OpenAI routes answer to (default: --model)")
    webhook_allow_private: bool = Field(False, description="allow webhook targets on loopback/private networks")
    webhook_max_attempts: int = Field(6, ge=1, le=20, description="delivery attempts before a webhook is failed")
    webhook_backoff_s: float = Field(1.0, gt=0, description="first retry delay; doubles each attempt")
    webhook_timeout_s: float = Field(10.0, gt=0, description="deadline of one whole webhook attempt")
    webhook_concurrency: int = Field(16, ge=1, le=1024, description="threads delivering webhooks in each worker "
                                     "(apart from the job slots)")
    webhook_concurrency_per_key: int = Field(4, ge=1, le=1024, description="most webhook attempts of one API key "
                                             "at once in each worker (its others wait their turn)")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body the API accepts")
    max_file_bytes: int = Field(100 << 20, ge=1024, description="largest file POST /v1/files accepts")
    max_batch_lines: int = Field(50_000, ge=1, description="most requests one OpenAI batch input file may hold")
    max_files_per_key: int = Field(1000, ge=1, description="most files (uploads and batch outputs) one API key keeps")
    max_file_storage_bytes_per_key: int = Field(
        10 << 30, ge=1024, description="most bytes of files one API key keeps; uploads past it are refused")
    openai_timeout_s: float = Field(600.0, gt=0, description="wait for a non-streaming OpenAI job")
    heartbeat_ttl_s: float = Field(15.0, gt=0, description="a worker silent this long is dead; its jobs are requeued")
    reaper_interval_s: float = Field(3.0, gt=0, description="how often a worker looks for dead workers' and lost jobs")
    engine_stall_timeout_s: float = Field(
        120.0, gt=0, description="a worker whose engine holds work without stepping this long fails its healthcheck")
    readyz_require_worker: bool = Field(
        False, description="/readyz is ready only while a worker for the model has a fresh heartbeat")
    log_format: Literal["text", "json"] = Field("text", description="log lines as text or as one JSON object each")
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="on SIGTERM a worker finishes running jobs this long, then requeues the rest")
    reconcile_grace_s: float = Field(
        30.0, gt=0, description="queued work missing from the broker this long is re-enqueued")
    # Longer than any job may run: a message is redelivered after this long even while its worker still runs
    # its job; redelivered, it is one more run at its level (the next waiting job, or nothing: a job held by a
    # live worker is never claimed twice).
    broker_visibility_timeout_s: float = Field(
        6 * 3600.0, gt=0,
        description="a job message taken by a worker that died unacknowledged is redelivered after this long")
    rate_limit_per_s: int = Field(1000, ge=0, description="requests per second per API key (0: unlimited)")
    max_inflight_jobs_per_key: int = Field(100_000, ge=1, description="queued plus running jobs one API key may have")
    # Priorities reach across tenants (an urgent job preempts others' running ones), so by default a key may only
    # make its jobs less urgent than 0; `pagedserve keys update --priority-floor` trusts one key with more.
    priority_floor: int = Field(0, ge=-1000, le=1000, description="the most urgent priority an API key's jobs may "
                                "have unless the key has its own floor (a lower one asked is 403)")
    batch_priority: int = Field(500, ge=-1000, le=1000, description="priority of Batch API jobs (lower runs "
                                "earlier; interactive jobs default to 0, so batches yield to them)")

    @field_validator("webhook_concurrency_per_key")
    @classmethod
    def _one_key_leaves_threads_to_others(cls, value: int, info: ValidationInfo) -> int:
        threads = info.data.get("webhook_concurrency")
        if threads is not None and value >= threads:
            raise ValueError(f"must be below webhook_concurrency ({threads}): one API key's slow receivers may not "
                             "hold every delivery thread")
        return value

    @model_validator(mode="after")
    def _auto_tool_choice_has_a_parser(self) -> Settings:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (PAGEDSERVE_TOOL_CALL_PARSER): "
                             "the format to read tool calls in")
        return self

    @field_validator("swap_space", mode="before")
    @classmethod
    def _bare_number_is_gib(cls, value: Any) -> Any:
        # vLLM's --swap-space 4 means 4 GiB; a number with a unit (512MiB, 4294967296B) is taken as written.
        # The default is a ByteSize, in bytes already (pydantic-settings validates defaults too).
        if isinstance(value, ByteSize):
            return value
        if isinstance(value, int | float) or (isinstance(value, str) and _is_number(value)):
            if not math.isfinite(float(value)):
                raise ValueError(f"must be a finite size, got {value}")
            return int(float(value) * (1 << 30))
        return value

    @field_serializer("swap_space", when_used="json")
    def _swap_space_with_unit(self, value: ByteSize | str) -> str:
        # a bare number would read back as GiB; a str is what model_copy(update=...) left unvalidated
        return f"{int(value)}B" if isinstance(value, int) else value

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names_from_text(cls, value: Any) -> Any:
        # the environment gives text: a JSON list (what `up` hands its children) or comma-separated names
        if isinstance(value, str):
            return json.loads(value) if value.lstrip().startswith("[") else [n.strip() for n in value.split(",")]
        return value

    @field_validator("api_key", mode="before")
    @classmethod
    def _tokens_from_text(cls, value: Any) -> Any:
        # one token as vLLM's VLLM_API_KEY, or the JSON list `up` hands its children; commas may be in a token
        if isinstance(value, str):
            return json.loads(value) if value.startswith("[") else [value]
        return value

    @field_validator("api_key", mode="after")
    @classmethod
    def _tokens_are_sendable(cls, value: list[str] | None) -> list[str] | None:
        for token in value or []:
            if not token or token != token.strip() or not token.isprintable():
                raise ValueError(f"an API key must be printable text without surrounding spaces, got {token!r}")
        return value

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_is_local(cls, value: Path | None) -> Path | None:
        if value is not None and not (value.expanduser() / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer must be a local folder with a tokenizer.json, got {str(value)!r}")
        return value

    @field_validator("data_dir", "cache_dir", mode="after")
    @classmethod
    def _expand_home(cls, value: Path | None) -> Path | None:
        # children get these paths through the environment; an unexpanded ~ would become a folder named "~"
        return value.expanduser() if value is not None else None

    def resolved_data_dir(self) -> Path:
        """The data directory, expanded and created."""
        path = self.data_dir.expanduser()
        path.mkdir(parents=True, exist_ok=True)
        return path

    def resolved_database_url(self) -> str:
        """The job store URL, defaulting to a SQLite file in the data directory."""
        return self.database_url or f"sqlite:///{self.resolved_data_dir() / 'pagedserve.db'}"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


_override: Settings | None = None
logger = logging.getLogger("pagedserve.settings")
# PAGEDSERVE_ variables read outside Settings: the kernels' backend override
_READ_ELSEWHERE = frozenset({"PAGEDSERVE_ATTENTION_BACKEND"})


def unknown_environment_names() -> list[str]:
    """PAGEDSERVE_ variables that nothing reads: misspelt, or settings that were removed."""
    known = {f"PAGEDSERVE_{name.upper()}" for name in Settings.model_fields} | _READ_ELSEWHERE
    return sorted(name for name in os.environ if name.startswith("PAGEDSERVE_") and name not in known)


@lru_cache(maxsize=1)
def _from_env() -> Settings:
    unknown = unknown_environment_names()
    if unknown:  # pydantic-settings ignores them silently; a removed setting must not pass unnoticed
        logger.warning("settings.unknown_environment names=%s: not read by any setting", ",".join(unknown))
    return Settings()


def get_settings() -> Settings:
    """The process-wide settings: the configured object, else one read from the environment."""
    return _override or _from_env()


def configure(settings: Settings | None) -> None:
    """Install settings for this process (CLI flags, tests); None goes back to the environment."""
    global _override
    _override = settings
    _from_env.cache_clear()
