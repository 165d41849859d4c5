"""KV blocks saved by sharing: parallel sampling and beam search (2, 4, 6) and a shared prompt prefix.

    python -m benchmarks.sharing [--num-requests 32] [--scale 1.0] [--quick]

Each step, the blocks in the scheduled sequences' tables are counted once (what pagedserve
holds) and once per sequence (what the same sequences would hold without sharing); the saving
is ``1 - mean(shared) / mean(unshared)``, the paper's Figure 15 measure. The shared prefix (whole blocks)
is computed once before the requests arrive, as a service caches its system prompt. Writes ``sharing.json``
and ``sharing.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks.common import add_common_args, build_llm, machine, print_table, save_bar_chart, write_json
from benchmarks.runner import MakeParams, run_engine, summarize
from benchmarks.workloads import Request, corpus_token_ids, make_requests
from engine import SamplingParams
from engine.model_files import load_tokenizer

# the paper's translation prompts share a 1-shot (80-token) or 5-shot (341-token) prefix
PAPER_PREFIX_TOKENS = {1: 80, 5: 341}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (Alpaca-like requests, like the paper's sharing experiments)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.set_defaults(scale=1.0)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--n", type=int, nargs="*", default=[2, 4, 6], help="parallel samples per request")
    parser.add_argument("--beam-widths", type=int, nargs="*", default=[2, 4, 6])
    parser.add_argument("--prefix-shots", type=int, nargs="*", default=[1, 5], choices=[1, 5])
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.scale, args.kv_cache_tokens, args.n, args.prefix_shots = 3, 0.5, 512, [2], [1]
        args.beam_widths = [2]
    return args


def with_prefix(requests: list[Request], prefix: list[int]) -> list[Request]:
    """The same requests, each prompt behind a common ``prefix``."""
    return [Request(prefix + r.prompt_token_ids, r.output_len) for r in requests]


def sampling(n: int = 1, beam_width: int = 1) -> MakeParams:
    """Parameters for ``n`` random samples (seeded per request) or a ``beam_width`` beam search."""

    def make(index: int, request: Request) -> SamplingParams:
        return SamplingParams(max_tokens=request.output_len, temperature=1.0 if n > 1 else 0.0, ignore_eos=True,
                              n=n, beam_width=beam_width, seed=index)

    return make


def measure(args: argparse.Namespace, name: str, requests: list[Request], make_params: MakeParams,
            prefix: list[int] | None = None) -> dict[str, Any]:
    """Run ``requests``; blocks with and without sharing, and the saving."""
    llm = build_llm(args)
    if prefix is not None:  # a served prefix is computed once and cached before the requests come
        llm.generate([prefix + [prefix[0]]], SamplingParams(max_tokens=1), use_tqdm=False)
    run = run_engine(llm.engine, requests, make_params=make_params, desc=name)
    shared = statistics.fmean(run.samples.blocks_shared)
    unshared = statistics.fmean(run.samples.blocks_unshared)
    stats = llm.engine.stats()
    return {
        "scenario": name, "mean_blocks_shared": shared, "mean_blocks_unshared": unshared,
        "saving_percent": 100 * (1 - shared / unshared),
        "prefix_cache_hit_rate": stats.prefix_cache_hits / max(1, stats.prefix_cache_queries),
        **summarize(run, len(requests)),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure every scenario, print, write JSON and a PNG; return the results."""
    args = parse_args(argv)
    corpus = corpus_token_ids(load_tokenizer(args.model))
    requests = make_requests("alpaca", args.num_requests, args.scale, corpus, args.seed)
    rows = [measure(args, f"parallel n={n}", requests, sampling(n=n)) for n in args.n]
    rows += [measure(args, f"beam width={w}", requests, sampling(beam_width=w)) for w in args.beam_widths]
    for shots in args.prefix_shots:
        tokens = PAPER_PREFIX_TOKENS[shots]
        num_blocks = max(1, round(tokens * args.scale / args.block_size))
        prefix = corpus[: num_blocks * args.block_size]
        rows.append({**measure(args, f"shared prefix {shots}-shot", with_prefix(requests, prefix), sampling(), prefix),
                     "prefix_tokens": len(prefix)})
    payload = {
        "benchmark": "sharing", "dataset": "alpaca", "num_requests": len(requests), "scale": args.scale,
        "config": {k: str(v) for k, v in vars(args).items()}, "machine": machine(),
        "method": __doc__.split("\n\n")[2].replace("\n", " "), "results": rows,
    }
    print_table(f"sharing · alpaca ×{args.scale} · {len(requests)} requests", rows,
                ["scenario", "mean_blocks_shared", "mean_blocks_unshared", "saving_percent",
                 "prefix_cache_hit_rate", "output_tokens_per_s", "mean_batch_size"])
    write_json("sharing", payload, args.out)
    plot(rows, args)
    return payload


def plot(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Bar chart of the KV block saving per scenario."""
    save_bar_chart([r["scenario"] for r in rows], [r["saving_percent"] for r in rows],
                   "KV blocks saved by sharing (%)", f"Sharing, alpaca-like x{args.scale}", args.out / "sharing.png")


if __name__ == "__main__":
    main()
