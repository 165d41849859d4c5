"""What the per-step token budget (``max_num_batched_tokens``) trades: time to first token and the longest steps
(the stall every running sequence sees while prompts are prefilled) against output throughput.

Two workloads per budget, each on a fresh engine (no prefix cache carried over):

- **burst**: ``--burst-requests`` prompts of ``--prompt-tokens`` real-text tokens arriving at once, as a
  serving benchmark at that concurrency starts (guidellm's concurrent profile);
- **poisson**: ``--num-requests`` ShareGPT-shaped requests arriving at ``--load`` times the workload's capacity,
  which an offline pass under the first budget measures.

Each round runs every budget in turn, in the given order and then reversed in the next round (a host's drift
favours none); each budget's figures are the median over ``--rounds``.

    .venv/bin/python -m benchmarks.token_budget --budgets 2048 512 256 --rounds 2 --name token-budget
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from typing import Any

from benchmarks.common import (
    add_common_args,
    build_llm,
    machine,
    new_figure,
    percentile,
    print_table,
    require_at_least,
    save_figure,
    write_json,
)
from benchmarks.runner import EngineRun, run_engine
from benchmarks.serve_report import machine_line, markdown_table
from benchmarks.workloads import Request, corpus_token_ids, make_requests, poisson_arrivals
from engine.model_files import load_tokenizer

WORKLOADS = ("burst", "poisson")
METRICS = ("output_tokens_per_s", "mean_ttft_s", "p50_ttft_s", "p99_ttft_s", "p99_step_s", "max_step_s")
COLUMNS = ["workload", "budget", *METRICS, "throughput_vs_first"]
RUN_COLUMNS = ["round", "workload", "budget", *METRICS, "num_steps"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--budgets", type=int, nargs="+", default=[2048, 1024, 512, 256],
                        help="max_num_batched_tokens values; the first calibrates the poisson rate")
    parser.add_argument("--burst-requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128, help="burst prompt length")
    parser.add_argument("--output-tokens", type=int, default=64, help="burst output length")
    parser.add_argument("--num-requests", type=int, default=48, help="poisson requests (ShareGPT lengths)")
    parser.add_argument("--load", type=float, default=0.8, help="poisson arrival rate, as a share of capacity")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default="token-budget", help="file names of the results: <name>.json, .md, .png")
    parser.set_defaults(scale=0.25)
    args = parser.parse_args(argv)
    require_at_least(parser, args, 1, "burst_requests", "prompt_tokens", "output_tokens", "num_requests", "rounds")
    require_at_least(parser, args, args.max_num_seqs, "budgets")  # the engine's own rule
    if args.load <= 0:
        parser.error("--load must be > 0")
    if args.quick:
        args.budgets, args.rounds, args.burst_requests, args.num_requests = args.budgets[:2], 1, 4, 6
        args.scale, args.prompt_tokens, args.output_tokens, args.kv_cache_tokens = 0.05, 32, 8, 1024
    return args


def burst_requests(args: argparse.Namespace, corpus: list[int]) -> list[Request]:
    """``--burst-requests`` distinct real-text prompts of ``--prompt-tokens`` tokens each."""
    rng = random.Random(args.seed)
    starts = [rng.randrange(len(corpus) - args.prompt_tokens) for _ in range(args.burst_requests)]
    return [Request(corpus[start:start + args.prompt_tokens], args.output_tokens) for start in starts]


def run(args: argparse.Namespace, budget: int, requests: list[Request], arrivals: list[float] | None) -> EngineRun:
    """One pass of ``requests`` through a fresh engine stepping at most ``budget`` tokens."""
    llm = build_llm(args, max_num_batched_tokens=budget)
    return run_engine(llm.engine, requests, arrivals, desc=f"budget {budget}")


def summary(engine_run: EngineRun) -> dict[str, float]:
    """Throughput, TTFT (from each request's arrival) and step-time figures of one run."""
    ttft = [timing.ttft_s for timing in engine_run.timings]
    steps = engine_run.samples.step_s
    return {"output_tokens_per_s": engine_run.output_tokens / engine_run.elapsed_s,
            "mean_ttft_s": statistics.fmean(ttft), "p50_ttft_s": percentile(ttft, 50),
            "p99_ttft_s": percentile(ttft, 99), "p99_step_s": percentile(steps, 99), "max_step_s": max(steps),
            "num_steps": len(steps)}


def medians(runs: list[dict[str, Any]], budgets: list[int]) -> list[dict[str, Any]]:
    """Per workload and budget, the median of each metric over the rounds, and throughput over the first budget's."""
    rows = []
    for workload in WORKLOADS:
        for budget in budgets:
            mine = [r for r in runs if r["workload"] == workload and r["budget"] == budget]
            rows.append({"workload": workload, "budget": budget,
                         **{m: statistics.median(r[m] for r in mine) for m in METRICS}})
        first = rows[-len(budgets)]["output_tokens_per_s"]
        for row in rows[-len(budgets):]:
            row["throughput_vs_first"] = row["output_tokens_per_s"] / first
    return rows


def plot(rows: list[dict[str, Any]], path: Any, title: str) -> None:
    """Mean TTFT and output throughput per budget, one panel per workload."""
    fig, axes = new_figure(ncols=len(WORKLOADS), figsize=(11, 4))
    for ax, workload in zip(axes, WORKLOADS):
        mine = [row for row in rows if row["workload"] == workload]
        labels = [str(row["budget"]) for row in mine]
        ax.bar(labels, [row["mean_ttft_s"] for row in mine], color="tab:blue", label="mean TTFT (s)")
        ax.set_xlabel("max_num_batched_tokens")
        ax.set_ylabel("mean TTFT (s)")
        twin = ax.twinx()
        twin.plot(labels, [row["output_tokens_per_s"] for row in mine], "o-", color="tab:red")
        twin.set_ylabel("output tok/s", color="tab:red")
        twin.set_ylim(bottom=0)
        ax.set_title(f"{workload}: {title}")
    fig.tight_layout()
    save_figure(fig, path)


def markdown(command: str, machine_info: dict[str, Any], rows: list[dict[str, Any]],
             runs: list[dict[str, Any]]) -> str:
    """The results as a Markdown page: the command, the machine, the medians and every run."""
    return "\n".join(["# Per-step token budget", "", f"```\n{command}\n```", "",
                      f"- Machine: {machine_line(machine_info)}", "", markdown_table(rows, COLUMNS), "",
                      "## Every run", "", markdown_table(runs, RUN_COLUMNS)]) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Calibrate the poisson rate, run every budget on both workloads for each round; JSON, Markdown and a plot."""
    args = parse_args(argv)
    corpus = corpus_token_ids(load_tokenizer(args.model))
    workloads = {"burst": (burst_requests(args, corpus), None)}
    requests = make_requests("sharegpt", args.num_requests, args.scale, corpus, args.seed)
    capacity = len(requests) / run(args, args.budgets[0], requests, None).elapsed_s
    workloads["poisson"] = (requests, poisson_arrivals(len(requests), args.load * capacity, args.seed))
    runs = []
    for round_number in range(1, args.rounds + 1):
        for workload, (reqs, arrivals) in workloads.items():
            for budget in args.budgets if round_number % 2 else reversed(args.budgets):
                runs.append({"round": round_number, "workload": workload, "budget": budget,
                             **summary(run(args, budget, reqs, arrivals))})
    rows = medians(runs, args.budgets)
    print_table(f"{args.model}: median over {args.rounds} round(s)", rows, COLUMNS)
    payload = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
               "poisson_rate_per_s": args.load * capacity, "rows": rows, "runs": runs}
    write_json(args.name, payload, args.out)
    command = "python -m benchmarks.token_budget " + " ".join(sys.argv[1:] if argv is None else argv)
    (args.out / f"{args.name}.md").write_text(markdown(command, payload["machine"], rows, runs))
    plot(rows, args.out / f"{args.name}.png", args.model)
    return payload


if __name__ == "__main__":
    main()
