"""What structured outputs cost per decode step: one engine per constraint on the same model and requests, stepped
in turn (so that all share whatever load the machine has), every row constrained, against an engine without
constraints. Reports each one's fastest and median step per batch size and their ratio to the unconstrained step,
and how long the first request of each constraint took to be added (its compile, and each engine's first
constraint builds llguidance's tokenizer, about 0.6 s); writes JSON, a table and a plot.

    .venv/bin/python -m benchmarks.structured --rows 8 32 --steps 12
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from benchmarks.common import RESULTS_DIR, machine, new_figure, print_table, save_with_legend, write_json
from engine import LLM, SamplingParams

# Constraints that never complete within the run (the rows keep decoding): free text inside a JSON string is the
# costly case for masks (most of the vocabulary stays allowed), a character-class regex the cheap one.
# (minItems keeps the JSON from being complete, which would end the row early)
FREE_TEXT = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"},
                                                        "minItems": 10_000}},
             "required": ["notes"]}
CONSTRAINTS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "regex": {"regex": "[a-z ,.]+"},
    "json": {"json": FREE_TEXT},
    "json-compact": {"json": FREE_TEXT, "disable_any_whitespace": True},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The grid and the output."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32], help="sequences decoding per step")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per engine")
    parser.add_argument("--constraints", nargs="+", default=list(CONSTRAINTS), choices=list(CONSTRAINTS))
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="structured")
    return parser.parse_args(argv)


def start_decoding(llm: LLM, constraint: dict[str, Any] | None, rows: int, args: argparse.Namespace) -> float:
    """``rows`` sampled requests under ``constraint`` that outlast the timed steps (their end-of-sequence tokens
    held back by min_tokens), stepped until every one decodes; the seconds the first request took to be added
    (the grammar's compile, and the tokenizer's on the first constraint)."""
    length = args.steps + 16
    params = SamplingParams(max_tokens=length, min_tokens=length, temperature=0.8, seed=0,
                            structured_outputs=constraint)
    added = time.perf_counter()
    for i in range(rows):
        llm.engine.add_request(f"decode-{i}", [100 + (i + p) % 1000 for p in range(args.prompt_tokens)], params)
        if i == 0:
            added = time.perf_counter() - added
    while llm.stats().num_waiting or llm.stats().num_running < rows:
        llm.engine.step()
    llm.engine.step()
    return added


def measure(args: argparse.Namespace, rows: int) -> list[dict[str, Any]]:
    """Every constraint's fastest and median decode step at ``rows``, against the unconstrained engine's."""
    llms = {name: LLM(model=args.model, max_num_seqs=rows, kv_cache_memory="1GiB") for name in args.constraints}
    first_add = {name: start_decoding(llm, CONSTRAINTS[name], rows, args) for name, llm in llms.items()}
    times: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(args.steps):
        for name, llm in llms.items():
            start = time.perf_counter()
            llm.engine.step()
            times[name].append(time.perf_counter() - start)
    base = min(times["none"]) if "none" in times else None
    return [{"rows": rows, "constraint": name, "fastest_ms": min(steps) * 1e3,
             "median_ms": statistics.median(steps) * 1e3,
             "vs_none": min(steps) / base if base else None, "first_add_ms": first_add[name] * 1e3,
             "running_at_end": llms[name].engine.num_running()}  # every row decoded through every timed step
            for name, steps in times.items()]


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Bars of each constraint's fastest step per batch size."""
    fig, ax = new_figure(figsize=(7, 4))
    names = list(dict.fromkeys(r["constraint"] for r in results))
    batch_sizes = list(dict.fromkeys(r["rows"] for r in results))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        values = [next(r["fastest_ms"] for r in results if r["rows"] == rows and r["constraint"] == name)
                  for rows in batch_sizes]
        ax.bar([i + (j - (len(names) - 1) / 2) * width for i in range(len(batch_sizes))], values, width, label=name)
    ax.set_xticks(range(len(batch_sizes)), [f"{rows} rows" for rows in batch_sizes])
    save_with_legend(fig, ax, "decode step (ms, fastest)", path)


def main(argv: list[str] | None = None) -> None:
    """Measure the grid, print the table, write JSON and the plot."""
    args = parse_args(argv)
    results = [row for rows in tqdm(args.rows, desc="batch sizes", unit="size") for row in measure(args, rows)]
    print_table("decode step with structured outputs (every row constrained)", results,
                ["rows", "constraint", "fastest_ms", "median_ms", "vs_none", "first_add_ms", "running_at_end"])
    write_json(args.name, {"machine": machine(), "args": vars(args), "results": results}, args.out)
    plot(results, args.out / f"{args.name}.png")


if __name__ == "__main__":
    main()
