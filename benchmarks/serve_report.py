"""The serving benchmark's report: its tables as markdown, and a bar chart of output tokens per second."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import new_figure, save_figure

ROW_COLUMNS = [
    "round", "system", "config", "mode", "concurrency", "output_tokens_per_s", "latency_ms_p50", "latency_ms_p99",
    "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p90", "itl_ms_p99", "engine_busy_share",
    "engine_rows_per_step", "worker_cpu_ms_per_token", "api_cpu_ms_per_token", "redis_cpu_ms_per_token",
    "requests_successful", "requests_failed", "error",
]
COMPARISON_COLUMNS = [
    "mode", "concurrency", "pagedserve_output_tokens_per_s", "llama_cpp_best_config",
    "llama_cpp_best_output_tokens_per_s", "pagedserve_over_llama_cpp", "offline_output_tokens_per_s",
    "pagedserve_over_offline",
]
ERROR_CHARS = 100


def _cell(value: Any) -> str:
    """A table cell: floats to 3 significant digits (whole numbers from 100 up), errors to their first line."""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    text = str(value).splitlines()[0] if value not in (None, "") else ""
    return text[:ERROR_CHARS].replace("|", "\\|")


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """``rows`` as a markdown table of ``columns`` (missing values blank)."""
    lines = ["| " + " | ".join(column.replace("_", " ") for column in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(column)) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


def machine_line(machine: dict[str, Any]) -> str:
    """The machine in one line: CPU model, CPUs, SIMD flags, torch."""
    return (f"{machine['cpu_model']}, {machine['cpu_count']} CPUs, flags {' '.join(machine['cpu_flags']) or 'none'}, "
            f"torch {machine['torch']} ({machine['torch_threads']} threads), {machine['platform']}")


def markdown(payload: dict[str, Any]) -> str:
    """The results page: command, machine, workload, the comparison and every run."""
    workload = payload["workload"]
    return "\n".join([
        "# Serving benchmark (guidellm)", "",
        f"```\n{payload['command']}\n```", "",
        f"- Machine: {machine_line(payload['machine'])}",
        f"- Client: guidellm {payload['client']['guidellm']}, {payload['client']['processes']} process(es), "
        f"`/v1/completions`, concurrent profile",
        f"- Workload: {workload['num_requests']} requests of {workload['prompt_tokens']} prompt / "
        f"{workload['output_tokens']} output tokens (synthetic text, EOS ignored; "
        f"{'the same prompts every run' if workload.get('repeat_prompts', True) else 'each run its own prompts'})",
        "- Output tok/s: successful output tokens over guidellm's measured window. Request latency, TTFT and ITL "
        "(inter-token latency) percentiles in ms; TTFT and ITL only where tokens stream. For pagedserve, from its "
        "worker's metrics over the run: the engine's busy share (time in steps over the measured window) and rows "
        "(sequences) per step. Over several rounds, each system's fastest run per mode and concurrency is compared.",
        "", "## pagedserve against llama.cpp's best configuration", "",
        markdown_table(payload["comparisons"], COMPARISON_COLUMNS),
        "", "## Every run", "",
        markdown_table(payload["rows"], ROW_COLUMNS), "",
    ])


def save_plot(payload: dict[str, Any], path: Path) -> None:
    """Bars of output tok/s per mode and concurrency: pagedserve beside llama.cpp's best configuration."""
    cells = payload["comparisons"]
    labels = [f"{cell['mode']}\n{cell['concurrency']} in flight" for cell in cells]
    fig, ax = new_figure(figsize=(max(5, 2 * len(cells)), 4))
    width = 0.4
    for offset, (name, key) in enumerate((("pagedserve", "pagedserve_output_tokens_per_s"),
                                           ("llama.cpp (best)", "llama_cpp_best_output_tokens_per_s"))):
        positions = [index + (offset - 0.5) * width for index in range(len(cells))]
        ax.bar(positions, [cell.get(key, 0.0) for cell in cells], width, label=name)
    ax.set_xticks(range(len(cells)), labels)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"guidellm, {payload['workload']['num_requests']} requests, {payload['machine']['cpu_model']}")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
