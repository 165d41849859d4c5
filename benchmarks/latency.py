"""Normalized latency (s/token) and TTFT under Poisson arrivals: the paper's Figure 12 on this machine.

    python -m benchmarks.latency [--dataset sharegpt] [--num-requests 48] [--load-factors 0.5 1 2] [--quick]

An offline pass of pagedserve first measures the workload's capacity (requests/s); each system
then serves the same requests arriving at ``load factor x capacity``. Latency counts from each
request's scheduled arrival. Writes ``latency.json`` and ``latency.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks.baselines import orca
from benchmarks.common import (
    add_common_args,
    build_llm,
    machine,
    new_figure,
    percentile,
    print_table,
    save_figure,
    write_json,
)
from benchmarks.runner import EngineRun, run_engine
from benchmarks.workloads import DATASETS, Request, corpus_token_ids, make_requests, max_seq_len, poisson_arrivals
from engine.model_files import load_tokenizer

SYSTEMS = ["pagedserve", "orca-oracle", "orca-pow2", "orca-max"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--dataset", default="sharegpt", choices=sorted(DATASETS))
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--load-factors", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.scale, args.kv_cache_tokens, args.load_factors = 4, 0.03, 256, [2.0]
        args.systems = ["pagedserve", "orca-max"]
    return args


def serve(args: argparse.Namespace, system: str, requests: list[Request], arrivals: list[float] | None) -> EngineRun:
    """One pass of ``requests`` through pagedserve or a reserving variant."""
    llm = build_llm(args)
    on_add = None
    if system != "pagedserve":
        on_add = orca.install_reservation(llm.engine, orca.POLICIES[system], max_seq_len(args.scale))
    return run_engine(llm.engine, requests, arrivals, on_add=on_add, desc=system)


def latency_summary(run: EngineRun) -> dict[str, float]:
    """Mean and p50/p90/p99 of normalized latency (s per output token) and of TTFT."""
    normalized = [t.latency_s / t.output_len for t in run.timings]
    ttft = [t.ttft_s for t in run.timings]
    summary = {"mean_normalized_latency_s": statistics.fmean(normalized), "mean_ttft_s": statistics.fmean(ttft)}
    for q in (50, 90, 99):
        summary[f"p{q}_normalized_latency_s"] = percentile(normalized, q)
        summary[f"p{q}_ttft_s"] = percentile(ttft, q)
    summary["mean_batch_size"] = statistics.fmean(run.samples.batch_sizes)
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Calibrate capacity, sweep request rates for every system, print, write JSON and a PNG."""
    args = parse_args(argv)
    corpus = corpus_token_ids(load_tokenizer(args.model))
    requests = make_requests(args.dataset, args.num_requests, args.scale, corpus, args.seed)
    offline = serve(args, "pagedserve", requests, None)
    capacity = len(requests) / offline.elapsed_s
    rows: list[dict[str, Any]] = []
    for factor in args.load_factors:
        rate = factor * capacity
        arrivals = poisson_arrivals(len(requests), rate, args.seed)
        for system in args.systems:
            rows.append({"system": system, "load_factor": factor, "request_rate": rate,
                         **latency_summary(serve(args, system, requests, arrivals))})
    payload = {
        "benchmark": "latency", "dataset": args.dataset, "num_requests": len(requests), "scale": args.scale,
        "capacity_requests_per_s": capacity, "config": {k: str(v) for k, v in vars(args).items()},
        "machine": machine(), "method": "latency from each request's scheduled Poisson arrival; normalized = "
        "end-to-end latency / output tokens; capacity from an offline pagedserve pass", "results": rows,
    }
    print_table(f"latency · {args.dataset} ×{args.scale} · capacity {capacity:.3g} req/s", rows,
                ["system", "request_rate", "mean_normalized_latency_s", "p50_normalized_latency_s",
                 "p90_normalized_latency_s", "p99_normalized_latency_s", "p50_ttft_s", "p99_ttft_s", "mean_batch_size"])
    write_json("latency", payload, args.out)
    plot(rows, args)
    return payload


def plot(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Mean normalized latency against request rate, one line per system."""
    fig, ax = new_figure(figsize=(6, 4))
    for system in args.systems:
        points = [(r["request_rate"], r["mean_normalized_latency_s"]) for r in rows if r["system"] == system]
        ax.plot(*zip(*points), marker="o", label=system)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"Latency, {args.dataset}-like ×{args.scale}")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, args.out / "latency.png", dpi=120)


if __name__ == "__main__":
    main()
