"""Plot the engine's Prometheus series during a benchmark-like run: a real Prometheus scrapes an in-process engine.

    python -m benchmarks.metrics_plot            # ShareGPT-like Poisson load on SmolLM2, tight KV budget
    → docs/engine-metrics.png (KV usage and waste, running/waiting/swapped, tokens/s, from Prometheus' range API)
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from benchmarks.common import add_common_args, build_llm, kv_cache_bytes, new_figure, save_figure
from benchmarks.prometheus_server import PrometheusServer
from benchmarks.runner import run_engine
from benchmarks.workloads import corpus_token_ids, make_requests, poisson_arrivals
from engine.config import EngineConfig
from engine.model_files import load_tokenizer
from worker.metrics import WorkerMetrics, serve_metrics

DOCS_PNG = Path(__file__).resolve().parents[1] / "docs" / "engine-metrics.png"
SCRAPE_INTERVAL_S = 1.0
# panel title → (PromQL, legend label) pairs, as the Engine dashboard shows them
PANELS: dict[str, list[tuple[str, str]]] = {
    "KV cache (ratio)": [('pagedserve_kv_cache_usage_ratio{pool="gpu"}', "GPU-pool usage"),
                         ('pagedserve_kv_cache_usage_ratio{pool="cpu"}', "CPU swap-pool usage"),
                         ("pagedserve_kv_cache_waste_ratio", "waste (1 − filled / allocated slots)")],
    "Requests": [("pagedserve_num_requests_running", "running"), ("pagedserve_num_requests_waiting", "waiting"),
                 ("pagedserve_num_requests_swapped", "swapped")],
    "Tokens per second": [("rate(pagedserve_generation_tokens_total[5s])", "generated"),
                          ("rate(pagedserve_prompt_tokens_total[5s])", "prompt (prefill)")],
    "Preemptions per second": [("sum(rate(pagedserve_preemptions_total[5s]))", "preemptions")],
}


def instrument(engine: Any, metrics: WorkerMetrics) -> None:
    """Wrap ``engine.step`` so each step feeds the worker metrics, as the worker's engine service does."""
    step = engine.step

    def observed() -> Any:
        started = time.perf_counter()
        outputs = step()
        metrics.observe_step(time.perf_counter() - started, outputs)
        metrics.observe_stats(asdict(engine.stats()))
        return outputs

    engine.step = observed


def plot(prometheus: PrometheusServer, start: float, end: float, title: str, path: Path) -> None:
    """Query every panel's series over [start, end] and save them as one PNG, x in seconds from the start."""
    fig, axes = new_figure(nrows=len(PANELS), sharex=True, figsize=(10, 2.4 * len(PANELS)))
    for ax, (panel, series) in zip(axes, PANELS.items()):
        for expr, label in series:
            for result in prometheus.query_range(expr, start, end, SCRAPE_INTERVAL_S):
                t, v = zip(*((float(ts) - start, float(value)) for ts, value in result["values"]))
                ax.plot(t, v, label=label)
        ax.set_ylabel(panel, fontsize=9)
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds since the first request")
    axes[0].set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=110)


def main() -> None:
    """Run the workload under Prometheus and plot what it scraped."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.set_defaults(kv_cache_tokens=1024)  # tight: the load must preempt and swap
    parser.add_argument("--dataset", default="sharegpt")
    parser.add_argument("--num-requests", type=int, default=80)
    parser.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    parser.add_argument("--metrics-port", type=int, default=19400)
    parser.add_argument("--prometheus-port", type=int, default=19090)
    parser.add_argument("--png", type=Path, default=DOCS_PNG)
    args = parser.parse_args()
    if args.quick:
        args.num_requests = 12

    # a swap pool as large as the device pool, so its usage shows on the same axis
    device_pool = EngineConfig(model=args.model, dtype=args.dtype, device="cpu", block_size=args.block_size)
    llm = build_llm(args, swap_space=kv_cache_bytes(device_pool, args.kv_cache_tokens))
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    metrics.set_cache_config(llm.engine)
    instrument(llm.engine, metrics)
    metrics_port = serve_metrics(args.metrics_port, host="127.0.0.1", registry=registry)
    requests = make_requests(args.dataset, args.num_requests, args.scale, corpus_token_ids(load_tokenizer(args.model)),
                             args.seed)
    arrivals = poisson_arrivals(len(requests), args.rate, args.seed)
    with PrometheusServer({"pagedserve-worker": [f"127.0.0.1:{metrics_port}"]}, port=args.prometheus_port,
                          scrape_interval_s=SCRAPE_INTERVAL_S) as prometheus:
        prometheus.wait_until_targets_up()
        time.sleep(2 * SCRAPE_INTERVAL_S)  # an idle lead-in on the plot
        start = time.time()
        run = run_engine(llm.engine, requests, arrivals, desc="metrics_plot")
        time.sleep(4 * SCRAPE_INTERVAL_S)  # scrapes of the idle engine after the last request
        title = (f"{Path(args.model).name}, {args.num_requests} {args.dataset}-like requests at {args.rate}/s, "
                 f"KV budget {args.kv_cache_tokens} tokens: {run.output_tokens / run.elapsed_s:.0f} output tokens/s, "
                 f"{run.num_preemptions} preemptions")
        plot(prometheus, start - 2, time.time(), title, args.png)
    print(f"wrote {args.png} ({run.elapsed_s:.1f} s run)")


if __name__ == "__main__":
    main()
