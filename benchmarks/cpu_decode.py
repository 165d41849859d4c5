"""Decode steps with the CPU's compiled paged attention (backend ``cpu``) against the plain-torch gather + SDPA
(backend ``torch``): one engine of each on the same model, numerics and requests, stepped in turn so that both
share whatever load the machine has. Reports each backend's fastest step per batch × context, their ratio, and
whether both sampled the same greedy tokens; writes JSON, a table and a plot.

    .venv/bin/python -m benchmarks.cpu_decode --rows 8 32 --contexts 150 400 --steps 8
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from benchmarks.common import RESULTS_DIR, machine, new_figure, print_table, save_with_legend, write_json
from engine import LLM, SamplingParams
from engine.config import EngineConfig

BACKENDS = ("torch", "cpu")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The grid and the output."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32], help="sequences decoding per step")
    parser.add_argument("--contexts", type=int, nargs="+", default=[150, 400], help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per backend (the fastest counts)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="cpu-decode")
    return parser.parse_args(argv)


def start_decoding(llm: LLM, rows: int, context: int, steps: int) -> None:
    """``rows`` greedy requests of ``context`` prompt tokens that outlast ``steps`` more steps, stepped until every
    one decodes."""
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    for i in range(rows):
        llm.engine.add_request(f"decode-{i}", [100 + (i + p) % 1000 for p in range(context)], params)
    while llm.stats().num_waiting or llm.stats().num_running < rows:
        llm.engine.step()
    llm.engine.step()


def measure(args: argparse.Namespace, rows: int, context: int) -> dict[str, Any]:
    """Both backends' fastest decode step at ``rows`` × ``context``, and whether their tokens agreed."""
    # both over the cache the compiled backend takes by default (an fp32 model's may be fp16), so that they compare
    # the attention, not the cache's dtype
    cache_dtype = EngineConfig(model=args.model, attention_backend="cpu").kv_cache_torch_dtype()
    llms = {name: LLM(model=args.model, max_num_seqs=rows, kv_cache_memory="1GiB", attention_backend=name,
                      kv_cache_dtype=cache_dtype)
            for name in BACKENDS}
    for llm in llms.values():
        start_decoding(llm, rows, context, args.steps)
    best = dict.fromkeys(BACKENDS, float("inf"))
    tokens: dict[str, list[list[int]]] = {name: [] for name in BACKENDS}
    for _ in range(args.steps):
        for name, llm in llms.items():
            start = time.perf_counter()
            outputs = llm.engine.step()
            best[name] = min(best[name], time.perf_counter() - start)
            tokens[name].append([o.outputs[0].token_ids[-1] for o in sorted(outputs, key=lambda o: o.request_id)])
    return {"rows": rows, "context": context, "torch_ms": best["torch"] * 1e3, "cpu_ms": best["cpu"] * 1e3,
            "speedup": best["torch"] / best["cpu"], "same_tokens": tokens["torch"] == tokens["cpu"]}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Bars of both backends' step times per grid point."""
    fig, ax = new_figure(figsize=(7, 4))
    labels = [f"{r['rows']} x {r['context']}" for r in results]
    positions = range(len(results))
    ax.bar([p - 0.2 for p in positions], [r["torch_ms"] for r in results], 0.4, label="torch (gather + SDPA)")
    ax.bar([p + 0.2 for p in positions], [r["cpu_ms"] for r in results], 0.4, label="cpu (compiled, in place)")
    ax.set_xticks(list(positions), labels)
    ax.set_xlabel("sequences x prompt tokens")
    save_with_legend(fig, ax, "decode step (ms, fastest)", path)


def main(argv: list[str] | None = None) -> None:
    """Measure the grid, print the table, write JSON and the plot."""
    args = parse_args(argv)
    grid = [(rows, context) for rows in args.rows for context in args.contexts]
    results = [measure(args, rows, context) for rows, context in tqdm(grid, desc="decode steps", unit="point")]
    print_table("decode step, attention backend cpu vs torch", results,
                ["rows", "context", "torch_ms", "cpu_ms", "speedup", "same_tokens"])
    write_json(args.name, {"machine": machine(), "args": vars(args), "results": results}, args.out)
    plot(results, args.out / f"{args.name}.png")


if __name__ == "__main__":
    main()
