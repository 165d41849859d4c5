"""The CPU's compiled decode attention of a git revision against the working tree's, on the same inputs.

Both builds are loaded into one process and called in turn, layer after layer over ``--layers`` layers' caches
(SmolLM2's 30 by default, so that the caches outgrow the L3 and each call reads its blocks from memory, as in a
decode step; a kernel timed on one layer's cache runs from the caches and can rank two versions the wrong way
round). Reports each build's fastest time per call, the ratio of the medians too (the host's drift shows in
their difference), and the largest difference between their outputs; writes JSON, a table and a plot.

    .venv/bin/python -m benchmarks.kernel_revisions --base 082b02f^ --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import hashlib
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks.common import RESULTS_DIR, machine, new_figure, print_table, save_with_legend, write_json
from paged_kernels.cpu_extension import FUNCTIONS, SOURCES, build_kernels, cpu_kernels
from paged_kernels.cpu_features import cpu_flags

REPO_ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The two builds, the grid and the output."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision whose paged_kernels/csrc/ is the baseline")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32], help="sequences per call")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 256], help="tokens per sequence")
    parser.add_argument("--layers", type=int, default=30, help="caches called in turn (enough to outgrow the L3)")
    parser.add_argument("--repeats", type=int, default=12, help="passes over the layers per build")
    parser.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M's by default)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="kernel-revisions")
    args = parser.parse_args(argv)
    for name in ("rows", "contexts"):
        if min(getattr(args, name)) < 1:
            parser.error(f"--{name} must be >= 1")
    for name in ("layers", "repeats", "heads", "kv_heads", "head_dim", "block_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    return args


def resolve_revision(revision: str) -> str:
    """The commit ``revision`` names; SystemExit naming ``--base`` when git does not know it."""
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
                           cwd=REPO_ROOT, capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"--base: git knows no commit {revision!r} in {REPO_ROOT}")
    return found.stdout.strip()


@contextmanager
def checked_out(commit: str) -> Iterator[Path]:
    """A temporary git worktree of ``commit`` (detached), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="revision-") as scratch:
        worktree = Path(scratch) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(worktree), commit], cwd=REPO_ROOT,
                       check=True)
        try:
            yield worktree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO_ROOT, check=False)


def _shown(commit: str, path: str) -> str | None:
    shown = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO_ROOT, capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else None


DECODE_SOURCE = "paged_decode_cpu.cpp"  # what the timed kernel needs; a revision may predate the other files


def sources_at(commit: str) -> list[str]:
    """The texts of ``SOURCES`` that ``commit`` has (under the package's former name ``kernels/`` in commits
    before it was renamed); SystemExit naming the file when it lacks the decode kernel's."""
    texts = []
    for source in SOURCES:
        relative = source.relative_to(REPO_ROOT)
        path, former = relative.as_posix(), Path("kernels", *relative.parts[1:]).as_posix()
        text = _shown(commit, path) or _shown(commit, former)
        if text is None and source.name == DECODE_SOURCE:
            raise SystemExit(f"--base: commit {commit[:12]} has no {path}, so its kernels cannot be built")
        if text is not None:
            texts.append(text)
    return texts


def defined_functions(texts: list[str]) -> list[str]:
    """The names of ``FUNCTIONS`` that these sources define (a revision from before a kernel was added lacks it)."""
    joined = "\n".join(texts)
    return [name for name in FUNCTIONS if re.search(rf"\b{re.escape(name)}\(", joined)]


def kernels_from(texts: list[str]) -> ModuleType:
    """The build of these source texts: the engine's own where they are the working tree's, else one named by
    their digest and the CPU's flags (built once, loaded from the extension cache after)."""
    if texts == [source.read_text() for source in SOURCES]:
        kernels = cpu_kernels()
        if kernels is None:
            raise SystemExit("the working tree's CPU kernels do not build here (see the warning above)")
        return kernels
    digest = hashlib.sha256("\0".join([*texts, *sorted(cpu_flags())]).encode()).hexdigest()[:12]
    return build_kernels(f"pagedserve_cpu_kernels_rev_{digest}", texts, functions=defined_functions(texts))


def decode_inputs(args: argparse.Namespace, dtype: torch.dtype, rows: int, context: int) -> dict[str, Any]:
    """A query, ``--layers`` layers' K and V caches, and block tables that scatter each sequence's blocks."""
    blocks_per_sequence = -(-context // args.block_size)
    num_blocks = rows * blocks_per_sequence
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    return {
        "query": torch.randn(rows, args.heads, args.head_dim).to(dtype),
        "caches": [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(args.layers)],
        "tables": torch.randperm(num_blocks).to(torch.int32).view(rows, blocks_per_sequence).contiguous(),
        "lens": torch.full((rows,), context, dtype=torch.int32),
        "scale": args.head_dim ** -0.5,
    }


def time_per_call(kernels: ModuleType, inputs: dict[str, Any]) -> float:
    """Microseconds per call over one pass through every layer's cache."""
    started = time.perf_counter()
    for key_cache, value_cache in inputs["caches"]:
        kernels.paged_decode(inputs["query"], key_cache, value_cache, inputs["tables"], inputs["lens"],
                             inputs["scale"])
    return (time.perf_counter() - started) / len(inputs["caches"]) * 1e6


def measure(args: argparse.Namespace, builds: dict[str, ModuleType], dtype_name: str, rows: int,
            context: int) -> dict[str, Any]:
    """Both builds at one point: fastest and median µs per call, and how far apart their outputs are."""
    inputs = decode_inputs(args, DTYPES[dtype_name], rows, context)
    key_cache, value_cache = inputs["caches"][0]
    outputs = [kernels.paged_decode(inputs["query"], key_cache, value_cache, inputs["tables"], inputs["lens"],
                                    inputs["scale"]).float() for kernels in builds.values()]
    times: dict[str, list[float]] = {name: [] for name in builds}
    for repeat in range(args.repeats):
        order = list(builds) if repeat % 2 == 0 else list(reversed(builds))  # neither always goes first
        for name in order:
            times[name].append(time_per_call(builds[name], inputs))
    base_us, head_us = min(times["base"]), min(times["head"])
    return {"dtype": dtype_name, "rows": rows, "context": context, "base_us": base_us, "head_us": head_us,
            "head_over_base": head_us / base_us,
            "median_head_over_base": statistics.median(times["head"]) / statistics.median(times["base"]),
            "max_abs_difference": (outputs[0] - outputs[1]).abs().max().item()}


def plot(results: list[dict[str, Any]], base: str, path: Path) -> None:
    """Bars of both builds' fastest time per call at each point."""
    fig, ax = new_figure(figsize=(8, 4))
    positions = range(len(results))
    ax.bar([p - 0.2 for p in positions], [r["base_us"] for r in results], 0.4, label=f"base {base[:12]}")
    ax.bar([p + 0.2 for p in positions], [r["head_us"] for r in results], 0.4, label="working tree")
    ax.set_xticks(list(positions), [f"{r['dtype']}\n{r['rows']} x {r['context']}" for r in results])
    ax.set_title("CPU paged decode attention, caches past the L3")
    save_with_legend(fig, ax, "µs per call (fastest)", path)


def main(argv: list[str] | None = None) -> None:
    """Build both, measure the grid, print the table, write JSON and the plot."""
    args = parse_args(argv)
    base = resolve_revision(args.base)
    base_texts = sources_at(base)
    builds = {"base": kernels_from(base_texts), "head": kernels_from([source.read_text() for source in SOURCES])}
    grid = [(dtype, rows, context) for dtype in args.dtypes for rows in args.rows for context in args.contexts]
    results = [measure(args, builds, *point) for point in tqdm(grid, desc="decode calls", unit="point")]
    print_table(f"decode attention per call, working tree vs {args.base} ({base[:12]})", results,
                ["dtype", "rows", "context", "base_us", "head_us", "head_over_base", "median_head_over_base",
                 "max_abs_difference"])
    same_source = builds["base"] is builds["head"]
    write_json(args.name, {"machine": machine(), "args": vars(args), "base_commit": base,
                           "same_source": same_source, "results": results}, args.out)
    plot(results, base, args.out / f"{args.name}.png")


if __name__ == "__main__":
    main()
