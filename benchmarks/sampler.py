"""The sampler's draws on the CPU: its torch ops against the compiled kernel (``paged_kernels/csrc/sampler_cpu.cpp``).

``engine.sampler.sample`` runs on the same logits and seeded generators both ways (``compiled=None`` and the CPU's
kernels), in turn, ``--repeats`` times per row count and parameter set; each way's fastest call counts, and the
tokens of the two are compared. The logits are normal with standard deviation ``--scale`` over ``--vocab`` tokens
(SmolLM2's by default): a small scale spreads a top-p nucleus over thousands of tokens, a large one over a few.
Writes JSON (the machine, every time, whether the tokens agreed), a table and a plot of compiled ÷ torch.

    .venv/bin/python -m benchmarks.sampler --rows 1 4 16 64
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks.common import (
    RESULTS_DIR,
    machine,
    new_figure,
    print_table,
    require_at_least,
    save_with_legend,
    write_json,
)
from engine.sampler import SamplingRow, sample
from engine.sampling_params import SamplingParams
from paged_kernels.cpu_extension import cpu_kernels

PARAMETER_SETS: dict[str, dict[str, Any]] = {
    "temperature 1": {"temperature": 1.0},
    "greedy": {"temperature": 0.0},
    "top-p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "top-k 40": {"temperature": 0.8, "top_k": 40},
    "min-p 0.05": {"temperature": 0.8, "min_p": 0.05},
    "repetition penalty": {"temperature": 1.0, "repetition_penalty": 1.2},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The grid and the output."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64], help="rows per call")
    parser.add_argument("--params", nargs="+", choices=list(PARAMETER_SETS), default=list(PARAMETER_SETS))
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--scale", type=float, default=4.0, help="standard deviation of the random logits")
    parser.add_argument("--repeats", type=int, default=5, help="calls per way, row count and parameter set")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="sampler")
    args = parser.parse_args(argv)
    require_at_least(parser, args, 1, "rows", "vocab", "repeats")
    if args.scale <= 0:
        parser.error("--scale must be > 0")
    return args


def timed_draws(logits: torch.Tensor, params: dict[str, Any], compiled: Any) -> tuple[float, list[int]]:
    """Seconds of one ``sample`` call over ``logits`` with a fresh seeded generator per row, and its tokens."""
    rows = [SamplingRow(SamplingParams(**params), torch.Generator().manual_seed(i), list(range(i, i + 64)), 32, [])
            for i in range(logits.shape[0])]
    started = time.perf_counter()
    results = sample(logits, rows, compiled)
    return time.perf_counter() - started, [result.token_id for result in results]


def plot(results: list[dict[str, Any]], params: list[str], path: Path) -> None:
    """Compiled ÷ torch per row count, one line per parameter set."""
    fig, ax = new_figure(figsize=(7, 4))
    for name in params:
        mine = [result for result in results if result["params"] == name]
        ax.plot([result["rows"] for result in mine], [result["compiled_over_torch"] for result in mine], marker="o",
                label=name)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows per call")
    ax.set_title("sampler: compiled kernel's time over the torch ops'")
    save_with_legend(fig, ax, "compiled ÷ torch", path)


def main(argv: list[str] | None = None) -> None:
    """Time both ways over the grid, print the table, write JSON and the plot."""
    args = parse_args(argv)
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("the CPU's compiled kernels could not be built here: nothing to compare")
    ways: dict[str, Callable[[torch.Tensor, dict[str, Any]], tuple[float, list[int]]]] = {
        "torch": lambda logits, params: timed_draws(logits, params, None),
        "compiled": lambda logits, params: timed_draws(logits, params, kernels),
    }
    results = []
    grid = [(rows, name) for rows in args.rows for name in args.params]
    for rows, name in tqdm(grid, desc="row counts × parameters", unit="cell"):
        logits = torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(rows)) * args.scale
        best = {way: float("inf") for way in ways}
        tokens: dict[str, list[int]] = {}
        for _ in range(args.repeats):
            for way, run in ways.items():  # in turn, so that drift touches both
                seconds, tokens[way] = run(logits, PARAMETER_SETS[name])
                best[way] = min(best[way], seconds)
        results.append({"rows": rows, "params": name, "torch_ms": 1e3 * best["torch"],
                        "compiled_ms": 1e3 * best["compiled"], "compiled_over_torch": best["compiled"] / best["torch"],
                        "same_tokens": tokens["torch"] == tokens["compiled"]})
    print_table(f"sampler over {args.vocab} tokens (logits' std {args.scale}), fastest of {args.repeats}", results,
                ["rows", "params", "torch_ms", "compiled_ms", "compiled_over_torch", "same_tokens"])
    write_json(args.name, {"machine": machine(), "args": {**vars(args), "out": str(args.out)},
                           "parameter_sets": {name: PARAMETER_SETS[name] for name in args.params},
                           "results": results}, args.out)
    plot(results, args.params, args.out / f"{args.name}.png")


if __name__ == "__main__":
    main()
