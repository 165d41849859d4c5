"""The settings each `pagedserve` command takes as --flags, typed from the Settings fields."""

from __future__ import annotations

import argparse
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import ByteSize, ValidationError
from pydantic.fields import FieldInfo

from core.settings import Settings

SERVER_COMMANDS = ("up", "api", "worker", "prepare")  # prepare reads what the worker reads
STORE_COMMANDS = ("migrate", "create-key", "keys")
_STORE_SETTINGS = ("data_dir", "database_url")
_CLIENT_SETTINGS = ("host", "port", "data_dir")
# Settings that only one of the two server processes reads; every other setting is shared (`up` runs both).
API_ONLY = frozenset({
    "host", "port", "chat_template", "served_model_name", "max_body_bytes", "max_file_bytes", "max_batch_lines",
    "max_files_per_key", "max_file_storage_bytes_per_key", "openai_timeout_s", "rate_limit_per_s",
    "max_inflight_jobs_per_key", "readyz_require_worker", "batch_priority", "priority_floor", "enable_auto_tool_choice",
    "tool_call_parser", "api_key",
})
WORKER_ONLY = frozenset({
    "cache_dir", "metrics_port", "metrics_host", "dtype", "kv_cache_dtype", "kv_cache_memory", "swap_space",
    "max_num_seqs", "block_size", "preemption_mode", "attention_backend", "num_threads", "cpu_weight_packing",
    "quantization", "enforce_eager", "cuda_graph_max_batch",
    "gpu_memory_utilization", "max_num_batched_tokens", "enable_prefix_caching", "seed", "webhook_max_attempts",
    "webhook_backoff_s", "webhook_timeout_s", "webhook_concurrency", "webhook_concurrency_per_key", "reaper_interval_s",
    "reconcile_grace_s", "engine_stall_timeout_s",
    "shutdown_grace_s",
})
_METAVARS: dict[Any, str] = {int: "INT", float: "FLOAT", str: "TEXT", Path: "PATH", ByteSize: "BYTES"}
_LIST_METAVARS = {"api_key": "KEY"}  # what one item of a list setting is (default: NAME)


def command_settings(command: str) -> list[str]:
    """Names of the settings `pagedserve <command>` takes as flags (the others still come from the environment)."""
    if command in STORE_COMMANDS:
        return list(_STORE_SETTINGS)
    if command not in SERVER_COMMANDS:  # the client commands: submit, submit-file
        return list(_CLIENT_SETTINGS)
    skip = {"api": WORKER_ONLY, "worker": API_ONLY, "prepare": API_ONLY}.get(command, frozenset())
    return [name for name in Settings.model_fields if name not in skip]


def flag_name(setting: str) -> str:
    """The --flag of a setting."""
    return f"--{setting.replace('_', '-')}"


def _value_type(annotation: Any) -> Any:
    """The annotation without its `| None`."""
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        return members[0] if len(members) == 1 else annotation
    return annotation


def _flag_options(name: str, field: FieldInfo) -> dict[str, Any]:
    """argparse options showing a setting's type, choices and default; the default stays None (env applies)."""
    value_type = _value_type(field.annotation)
    default = field.default if isinstance(field.default, (bool, int, float, str, Path)) else None
    if isinstance(default, ByteSize):
        default = default.human_readable(decimal=False)
    help_text = field.description or ""
    if default is not None:
        help_text += f" (default: {default})"
    options: dict[str, Any] = {"default": None, "help": help_text}
    if value_type is bool:
        return {**options, "action": argparse.BooleanOptionalAction}
    if get_origin(value_type) is Literal:
        return {**options, "choices": get_args(value_type)}
    if get_origin(value_type) is list:
        return {**options, "nargs": "+", "metavar": _LIST_METAVARS.get(name, "NAME")}
    if value_type in (int, float):
        options["type"] = value_type
    return {**options, "metavar": _METAVARS.get(value_type, "VALUE")}


def add_settings_flags(parser: argparse.ArgumentParser, names: list[str]) -> None:
    """Add the named settings to a command as --flags."""
    group = parser.add_argument_group("settings (each also PAGEDSERVE_<NAME>)")
    for name in names:
        group.add_argument(flag_name(name), dest=f"setting_{name}", **_flag_options(name, Settings.model_fields[name]))


def flag_errors(exc: ValidationError) -> str:
    """A validation error of the settings as one message naming each flag (and its environment variable)."""
    messages = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else ""
        where = f"{flag_name(name)} (PAGEDSERVE_{name.upper()})" if name in Settings.model_fields else "settings"
        messages.append(f"{where}: {error['msg']}")
    return "; ".join(messages)
