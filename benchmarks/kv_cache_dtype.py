"""What a 16-bit KV cache costs an fp32 model in quality: the engine's log-probability of each token of a fixed text
(``prompt_logprobs``: the prompt attends to its own K/V as read back from the cache) and its greedy agreement over
some prompts, each against exact fp32 (fp32 weights on ``F.linear``, an fp32 cache), for fp16 weights (the default
packing) with an fp32, fp16 and bf16 cache. Speed is ``benchmarks.step_revisions`` and ``benchmarks.serve``'s.

    .venv/bin/python -m benchmarks.kv_cache_dtype --name kv-cache-dtype-quality
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, machine, print_table, save_bar_chart, write_json
from benchmarks.numerics import FIXED_TEXT, PROMPTS, agreement, greedy_tokens
from engine import LLM, SamplingParams

# variant name -> LLM keyword arguments (an fp32 model throughout)
VARIANTS: dict[str, dict[str, Any]] = {
    "exact": {"cpu_weight_packing": "exact", "kv_cache_dtype": "float32"},
    "fp16-weights, fp32 cache": {"kv_cache_dtype": "float32"},
    "fp16-weights, fp16 cache": {"kv_cache_dtype": "float16"},
    "fp16-weights, bf16 cache": {"kv_cache_dtype": "bfloat16"},
}


def prompt_logprobs(llm: LLM, text: str) -> list[float]:
    """The engine's log-probability of each token of ``text`` after the ones before it."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    (output,) = llm.generate([text], params, use_tqdm=False)
    return [entry[token] for entry, token in zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:])]


def main(argv: list[str] | None = None) -> None:
    """Each variant's log-prob change and greedy agreement against exact fp32; JSON, a table and a bar chart."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="kv-cache-dtype-quality")
    args = parser.parse_args(argv)
    base = {"model": args.model, "dtype": "float32", "device": "cpu", "kv_cache_memory": "256MiB"}
    reference_logprobs: list[float] = []
    reference_tokens: list[list[int]] = []
    rows = []
    for name, kwargs in VARIANTS.items():
        llm = LLM(**base, **kwargs)
        logprobs = prompt_logprobs(llm, FIXED_TEXT)
        tokens = greedy_tokens(llm, PROMPTS, args.max_tokens)
        if name == "exact":
            reference_logprobs, reference_tokens = logprobs, tokens
        changes = [ours - theirs for ours, theirs in zip(logprobs, reference_logprobs)]
        rows.append({
            "variant": name, "cache dtype": str(llm.engine.kv_cache_dtype).removeprefix("torch."),
            "mean log-prob change": sum(changes) / len(changes),
            "mean |log-prob change|": sum(abs(c) for c in changes) / len(changes),
            "greedy agreement": agreement(tokens, reference_tokens),
        })
        del llm  # one engine at a time: the next one is built before the name would be rebound
    print_table(f"{args.model}, fp32: against exact fp32 ({len(reference_logprobs)} text tokens; "
                f"{len(PROMPTS)} prompts x {args.max_tokens} greedy tokens)", rows, list(rows[0]))
    write_json(args.name, {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
               args.out)
    save_bar_chart([row["variant"] for row in rows], [row["mean |log-prob change|"] for row in rows],
                   "mean |log-prob change| (nats/token)", f"{args.model}, fp32: against exact fp32",
                   args.out / f"{args.name}.png")


if __name__ == "__main__":
    main()
