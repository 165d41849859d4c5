"""The engine's prefill and decode steps of a git revision against the working tree's, each in its own process, in
turn.

The revision is checked out into a temporary git worktree and put first on the child process's ``PYTHONPATH``,
so that its ``engine`` package is the one imported; the working tree's child imports its own. Each child builds
the engine once (the model, dtype and weight packing of ``LLM``'s defaults unless flags say otherwise), then for
each batch size adds that many requests of ``--tokens`` tokens (EOS ignored; greedy unless ``--temperature``), their
prompts a short sentence or ``--prompt-tokens`` tokens of it repeated, and times their prefill (every step until none
waits: the whole batch's prompts, ms) and the decode steps after it (ms per step), each the fastest of
``--repeats``. The two sides alternate for ``--rounds`` rounds (these hosts drift by a quarter within minutes, so each
side's fastest round is compared).
Writes JSON (every round, the machine), a table and a plot of working tree ÷ revision per batch size.

    .venv/bin/python -m benchmarks.step_revisions --base HEAD~1 --batches 1 8 32 --rounds 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Request {}: write a short story about a lighthouse keeper who finds a message in a bottle."
PROMPT_NUMBERS = itertools.count()
# A child loads this file by its path, with the measured tree first on sys.path (its working directory): run as a
# script, this file's folder would come first instead, and benchmarks/kernels.py would shadow the ``kernels``
# package that transformers imports.
CHILD_BOOT = ("import importlib.util, sys; "
              "spec = importlib.util.spec_from_file_location('step_revisions', sys.argv[1]); "
              "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
              "module.main(['--child', *sys.argv[2:]])")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The revision, the grid and the output."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision whose engine is the baseline")
    parser.add_argument("--model", default=None, help="model name or folder (LLM's default when not given)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="sequences per decode step")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per sequence")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="tokens per prompt (the sentence's repeated); default: the sentence alone")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of the requests (0: greedy); each request is seeded")
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per batch size and child")
    parser.add_argument("--rounds", type=int, default=3, help="children per side, alternating")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--name", default="step-revisions")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.batches) < 1:
        parser.error("--batches must be >= 1")
    for name in ("repeats", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.temperature < 0:
        parser.error("--temperature must be >= 0")
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        parser.error("--prompt-tokens must be >= 1")
    if args.tokens < 2:
        parser.error("--tokens must be >= 2 (one prefill step, then decode steps to time)")
    return args


def prompt_of(llm: Any, index: int, tokens: int | None) -> str | list[int]:
    """Request ``index``'s prompt: the sentence, or ``tokens`` token ids of it repeated."""
    if tokens is None:
        return PROMPT.format(index)
    ids = llm.engine.tokenizer.encode(PROMPT.format(index))
    return (ids * (tokens // len(ids) + 1))[:tokens]


def prefill(engine: Any, request_ids: list[str]) -> int:
    """Step until every request has its first token (over several steps where the prompts outgrow one step's
    tokens); the steps taken."""
    steps = 0
    while any(seq.num_output_tokens == 0 for request_id in request_ids for seq in engine.groups[request_id].seqs):
        engine.step()
        steps += 1
    return steps


def step_ms(llm: Any, batch: int, tokens: int, temperature: float = 0.0,
            prompt_tokens: int | None = None) -> tuple[float, float]:
    """Milliseconds of the prefill of ``batch`` sequences sampled at ``temperature`` (0: greedy), and per decode step
    after it."""
    from engine import SamplingParams

    engine = llm.engine
    request_ids = [f"bench-{batch}-{time.monotonic_ns()}-{i}" for i in range(batch)]
    for i, request_id in enumerate(request_ids):
        params = SamplingParams(max_tokens=tokens, temperature=temperature, seed=i, ignore_eos=True)
        # a prompt of its own: none is served from the prefix cache that an earlier timing filled
        engine.add_request(request_id, prompt_of(llm, next(PROMPT_NUMBERS), prompt_tokens), params)
    started = time.perf_counter()
    prefill(engine, request_ids)
    prefill_ms = 1000 * (time.perf_counter() - started)
    steps, started = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return prefill_ms, 1000 * (time.perf_counter() - started) / max(1, steps)


def run_child(args: argparse.Namespace) -> None:
    """Measure this process's ``engine`` and print one JSON line: where it was imported from, prefill ms and ms per
    decode step."""
    import engine
    from engine import LLM

    llm = LLM(**({"model": args.model} if args.model else {}), max_num_seqs=max(args.batches))
    step_ms(llm, 1, 8)  # warm-up: first calls pay for allocator and kernel start-up
    timed = {batch: [step_ms(llm, batch, args.tokens, args.temperature, args.prompt_tokens)
                     for _ in range(args.repeats)] for batch in args.batches}
    print(json.dumps({"engine": str(Path(engine.__file__).resolve().parent),
                      "prefill_ms": {batch: min(t[0] for t in times) for batch, times in timed.items()},
                      "ms_per_step": {batch: min(t[1] for t in times) for batch, times in timed.items()}}))


def child_result(args: argparse.Namespace, root: Path) -> dict[str, dict[int, float]]:
    """Run a child whose ``engine`` comes from ``root``; its prefill ms and ms per decode step per batch size, checked
    to have imported from there."""
    command = [sys.executable, "-c", CHILD_BOOT, str(Path(__file__).resolve()), "--batches", *map(str, args.batches),
               "--tokens", str(args.tokens), "--repeats", str(args.repeats), "--temperature", str(args.temperature)]
    if args.prompt_tokens is not None:
        command += ["--prompt-tokens", str(args.prompt_tokens)]
    if args.model:
        command += ["--model", args.model]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the child measuring {root} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["engine"]) != root / "engine":
        raise SystemExit(f"the child meant to measure {root} imported engine from {result['engine']}")
    return {name: {int(batch): float(ms) for batch, ms in result[name].items()}
            for name in ("prefill_ms", "ms_per_step")}


def main(argv: list[str] | None = None) -> None:
    """Check out the revision, alternate the children, print the table, write JSON and the plot."""
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return
    from tqdm.auto import tqdm

    from benchmarks.common import machine, print_table, save_bar_chart, write_json
    from benchmarks.kernel_revisions import checked_out, resolve_revision

    base = resolve_revision(args.base)
    rounds: list[dict[str, Any]] = []
    with checked_out(base) as worktree:
        sides = {"base": worktree, "head": REPO_ROOT}
        with tqdm(total=2 * args.rounds, desc="children", unit="run") as progress:
            for index in range(args.rounds):
                order = ["head", "base"] if index % 2 == 0 else ["base", "head"]  # neither always first
                for side in order:
                    rounds.append({"round": index, "side": side, **child_result(args, sides[side])})
                    progress.update()
    results = []
    for batch in args.batches:
        row: dict[str, Any] = {"batch": batch}
        for name, label in (("prefill_ms", "prefill"), ("ms_per_step", "decode")):
            fastest = {side: min(r[name][batch] for r in rounds if r["side"] == side) for side in ("base", "head")}
            row |= {f"{label}_base_ms": fastest["base"], f"{label}_head_ms": fastest["head"],
                    f"{label}_head_over_base": fastest["head"] / fastest["base"]}
        results.append(row)
    print_table(f"prefill and decode step, working tree vs {args.base} ({base[:12]}), fastest of {args.rounds} rounds",
                results, ["batch", "prefill_base_ms", "prefill_head_ms", "prefill_head_over_base", "decode_base_ms",
                          "decode_head_ms", "decode_head_over_base"])
    write_json(args.name, {"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "child"},
                           "base_commit": base, "rounds": rounds, "results": results}, args.out)
    save_bar_chart([f"{label} {r['batch']}" for label in ("prefill", "decode") for r in results],
                   [r[f"{label}_head_over_base"] for label in ("prefill", "decode") for r in results],
                   "time: working tree ÷ base", f"Prefill and decode step vs {args.base} ({base[:12]})",
                   args.out / f"{args.name}.png", reference=1.0)


if __name__ == "__main__":
    main()
