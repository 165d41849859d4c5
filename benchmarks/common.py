"""Shared pieces of the benchmark scripts: engine set-up, KV budgets, machine facts, output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from engine import LLM, SamplingParams
from engine.cache_engine import kv_block_bytes
from engine.config import EngineConfig
from engine.model_files import resolve_model
from engine.models.llama import kv_heads_and_head_dim
from engine.models.loader import load_config

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# the CPU features that decide which kernels torch and llama.cpp run
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
console = Console(width=200)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Options every benchmark takes: model, dtype, engine limits, scale, seed, output folder."""
    parser.add_argument("--model", default="smollm2-135m-instruct", help="built-in name or HF folder")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="auto: what the engine picks on this machine (bf16 only where it is fast)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-tokens", type=int, default=4096, help="KV budget, in token slots")
    parser.add_argument("--scale", type=float, default=0.125, help="length scale vs the paper's datasets")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a CI-sized run (under a minute)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)


def require_at_least(parser: argparse.ArgumentParser, args: argparse.Namespace, minimum: int, *names: str) -> None:
    """Refuse, naming the flag, any of ``names`` (argparse destinations; a list checks each value) below ``minimum``."""
    for name in names:
        value = getattr(args, name)
        if min(value if isinstance(value, list) else [value]) < minimum:
            parser.error(f"--{name.replace('_', '-')} must be >= {minimum}")


def kv_cache_bytes(config: EngineConfig, num_tokens: int) -> int:
    """Bytes of a KV cache holding ``num_tokens`` token slots (whole blocks) of the model ``config`` runs, in the
    dtype its engine gives the cache (an fp32 model's may be fp16: ``EngineConfig.kv_cache_dtype``)."""
    model_config = load_config(resolve_model(config.model))
    num_kv_heads, head_dim = kv_heads_and_head_dim(model_config)
    block_bytes = kv_block_bytes(model_config.num_hidden_layers, config.block_size, num_kv_heads, head_dim,
                                 config.kv_cache_torch_dtype())
    return -(-num_tokens // config.block_size) * block_bytes


def build_llm(args: argparse.Namespace, **overrides: Any) -> LLM:
    """A paged engine on the CPU sized by the common arguments (``overrides`` win)."""
    kwargs: dict[str, Any] = {
        "model": args.model, "dtype": args.dtype, "device": "cpu", "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs, "swap_space": "1GiB", "seed": args.seed, **overrides,
    }
    if "kv_cache_memory" not in kwargs:
        kwargs["kv_cache_memory"] = kv_cache_bytes(EngineConfig(**kwargs), args.kv_cache_tokens)
    llm = LLM(**kwargs)
    # warm-up outside the timed runs: first calls pay for allocator and kernel start-up
    llm.generate([list(range(1000, 1040))], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    return llm


def cpu_description() -> dict[str, Any]:
    """The CPU's model name and which of ``SIMD_FLAGS`` it has (from ``/proc/cpuinfo`` where there is one)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text(errors="ignore").splitlines() if cpuinfo.exists() else []
    fields = dict(line.split(":", 1) for line in lines if ":" in line)  # every core repeats the same fields
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name") or platform.processor() or platform.machine(),
            "cpu_flags": [flag for flag in SIMD_FLAGS if flag in flags]}


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "platform": platform.platform(), **cpu_description(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "load_average_at_end": os.getloadavg(),
    }


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, round(q) - 1))]


def write_json(name: str, payload: dict[str, Any], out_dir: Path) -> Path:
    """Write ``payload`` as ``<out_dir>/<name>.json`` and return the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def print_table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    """Print ``rows`` (dicts) as a table of ``columns``; floats get 3 significant digits."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column.replace("_", " "), justify="right" if column != columns[0] else "left")
    for row in rows:
        cells = [row.get(column, "") for column in columns]
        table.add_row(*(f"{c:.3g}" if isinstance(c, float) else str(c) for c in cells))
    console.print(table)


def save_bar_chart(labels: list[str], values: list[float], ylabel: str, title: str, path: Path,
                   reference: float | None = None) -> None:
    """Save a bar chart of ``values`` per label as a PNG, with a horizontal line at ``reference`` if given."""
    fig, ax = new_figure(figsize=(7, 4))
    ax.bar(labels, values, color="tab:blue")
    if reference is not None:
        ax.axhline(reference, color="black", linewidth=0.8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def save_with_legend(fig: Any, ax: Any, ylabel: str, path: Path) -> None:
    """Label the y axis, add the legend, lay out and save ``fig`` as a PNG."""
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


def save_figure(fig: Any, path: Path, dpi: int = 100) -> None:
    """Write ``fig`` as a PNG and close it: pyplot holds every figure it made until it is closed."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def new_figure(**kwargs: Any) -> tuple[Any, Any]:
    """A matplotlib figure and axes on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(**kwargs)
