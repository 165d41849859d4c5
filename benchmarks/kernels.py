"""Paged decode attention (Triton) against torch SDPA on the same data laid out contiguously.

Contiguous SDPA is the ideal that paging costs against. Paged decode is timed on its planned
path, as the engine runs it: the plan (checks, and the launch sizes chosen for the device,
such as the partitions per sequence from the SM count) is made once outside the timed call, so
neither the checks nor a device sync are measured. ``--table-tokens`` plans as the engine's CUDA
graphs do: from the capacity of block tables that hold that many tokens, whatever the contexts.
Both sides are timed replaying a CUDA graph, as the engine replays decode: at small sizes a kernel
runs for less than Python takes to launch it, and eager timings would measure the host. For each
batch x context size the script reports both times, their ratio, and the bandwidth each achieves reading K and V,
prints a table and writes JSON and a plot beside it. Measuring needs a CUDA GPU (it exits cleanly
without one); re-rendering a recorded run does not.

    python benchmarks/kernels.py [--dtype float16] [--table-tokens 32768] [--out benchmarks/results/kernels.json]
    python benchmarks/kernels.py --from-json RESULT.json   # the table and plot of a recorded run, no GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# Run as a script, this file's folder comes first on sys.path, not the repository root whose
# packages it imports (a checkout that is not pip-installed, as on the GPU machine): put the root there.
sys.path[0] = str(Path(__file__).resolve().parents[1])

# Peak HBM bandwidth by device-name fragment, for the "% of peak" column (override with a flag).
PEAK_BANDWIDTH_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10G": 600.0}


@dataclass(slots=True)
class Row:
    """One measured grid point."""

    batch: int
    context_len: int
    partitions: int  # per sequence: the plan's choice for this device, batch and context (or table capacity)
    paged_ms: float
    sdpa_ms: float
    paged_over_sdpa: float
    paged_gbps: float
    sdpa_gbps: float
    paged_peak_fraction: float | None
    max_abs_diff: float


def make_parser() -> argparse.ArgumentParser:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context-lens", type=int, nargs="+", default=[512, 1024, 4096, 16384])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    parser.add_argument("--table-tokens", type=int, default=None,
                        help="plan from block tables with room for this many tokens (as a CUDA graph of the "
                             "engine does) instead of from the contexts")
    parser.add_argument("--peak-gbps", type=float, default=None, help="device peak bandwidth")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kernels.json"))
    parser.add_argument("--from-json", type=Path, default=None,
                        help="print the table and write the plot of a recorded run (beside it) instead of measuring")
    return parser


def peak_bandwidth_gbps(requested: float | None) -> float | None:
    """The device's peak memory bandwidth: the flag, else a known value for its name."""
    if requested is not None:
        return requested
    name = torch.cuda.get_device_name()
    return next((gbps for key, gbps in PEAK_BANDWIDTH_GBPS.items() if key in name), None)


def measure(args: argparse.Namespace, batch: int, context_len: int, peak: float | None) -> Row:
    """Time paged decode and contiguous SDPA on identical K/V for one grid point."""
    import triton.testing

    from paged_kernels import triton_ops

    dtype = getattr(torch, args.dtype)
    heads, kv_heads, head_dim, block_size = (
        args.num_heads, args.num_kv_heads, args.head_dim, args.block_size,
    )
    blocks_per_seq = triton.cdiv(context_len, block_size)
    num_blocks = batch * blocks_per_seq
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    block_tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    block_tables = block_tables.view(batch, blocks_per_seq)
    context_lens = torch.full((batch,), context_len, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, heads, head_dim, device="cuda", dtype=dtype)
    scale = head_dim**-0.5

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        """The paged cache gathered into ``[batch, kv_heads, context_len, head_dim]``."""
        gathered = cache[block_tables.long()].flatten(1, 2)[:, :context_len]
        return gathered.permute(0, 2, 1, 3).contiguous()

    key, value = contiguous(key_cache), contiguous(value_cache)
    sdpa_query = query[:, :, None, :]

    if args.table_tokens is not None:  # spare columns up to the capacity, as a graph's static tables have
        spare = triton.cdiv(args.table_tokens, block_size) - blocks_per_seq
        block_tables = torch.nn.functional.pad(block_tables, (0, spare))
    planner = triton_ops.plan_decode if args.table_tokens is None else triton_ops.plan_decode_static
    plan = planner(query, key_cache, value_cache, block_tables, context_lens)

    def paged() -> torch.Tensor:
        return triton_ops.paged_attention_decode(
            query, key_cache, value_cache, block_tables, context_lens, scale, plan=plan
        )

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(sdpa_query, key, value, scale=scale, enable_gqa=True)

    max_abs_diff = (paged().float() - sdpa()[:, :, 0].float()).abs().max().item()
    paged_ms = triton.testing.do_bench_cudagraph(paged)
    sdpa_ms = triton.testing.do_bench_cudagraph(sdpa)
    kv_bytes = 2 * batch * context_len * kv_heads * head_dim * key_cache.element_size()
    paged_gbps = kv_bytes / paged_ms / 1e6
    return Row(
        batch=batch,
        context_len=context_len,
        partitions=plan.num_partitions,
        paged_ms=paged_ms,
        sdpa_ms=sdpa_ms,
        paged_over_sdpa=paged_ms / sdpa_ms,
        paged_gbps=paged_gbps,
        sdpa_gbps=kv_bytes / sdpa_ms / 1e6,
        paged_peak_fraction=paged_gbps / peak if peak else None,
        max_abs_diff=max_abs_diff,
    )


def print_table(rows: list[Row]) -> None:
    """A fixed-width table of the measurements."""
    header = "batch  context  partitions  paged_ms  sdpa_ms  paged/sdpa  paged_GB/s  sdpa_GB/s  %peak  max_diff"
    print(header)
    for r in rows:
        peak = f"{100 * r.paged_peak_fraction:5.1f}" if r.paged_peak_fraction else "    -"
        print(
            f"{r.batch:5d}  {r.context_len:7d}  {r.partitions:10d}  {r.paged_ms:8.4f}  {r.sdpa_ms:7.4f}  "
            f"{r.paged_over_sdpa:10.3f}  {r.paged_gbps:10.1f}  {r.sdpa_gbps:9.1f}  {peak}  "
            f"{r.max_abs_diff:8.2e}"
        )


def save_plot(rows: list[Row], device: str, timing: str, path: Path) -> None:
    """Paged ÷ SDPA time per batch x context, with the 1.0 line (paging free), titled with how it was timed."""
    from benchmarks.common import save_bar_chart

    save_bar_chart([f"b{r.batch} ctx{r.context_len}" for r in rows], [r.paged_over_sdpa for r in rows],
                   "paged decode time ÷ contiguous SDPA", f"Paged decode attention vs SDPA, {device} ({timing})",
                   path, reference=1.0)


def replot(recorded: Path) -> int:
    """The table and the plot of a recorded run."""
    report = json.loads(recorded.read_text())
    for row in report["rows"]:
        if "partition_tokens" in row:  # recorded before partitions were counted per sequence (2026-12-04)
            row["partitions"] = -(-row["context_len"] // row.pop("partition_tokens"))
    rows = [Row(**row) for row in report["rows"]]
    print_table(rows)
    save_plot(rows, report["device"], report.get("timing", "timing not recorded"), recorded.with_suffix(".png"))
    print(f"wrote {recorded.with_suffix('.png')}")
    return 0


def main() -> int:
    """Run the grid, print the table, write the JSON and the plot."""
    parser = make_parser()
    args = parser.parse_args()
    if args.from_json is not None:
        if not args.from_json.is_file():
            parser.error(f"--from-json: no recorded run at {args.from_json}")
        return replot(args.from_json)
    if args.table_tokens is not None and args.table_tokens < max(args.context_lens):
        parser.error(f"--table-tokens {args.table_tokens} cannot hold --context-lens {max(args.context_lens)}")
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU; none found, nothing measured.")
        return 0
    peak = peak_bandwidth_gbps(args.peak_gbps)
    rows = [
        measure(args, batch, context_len, peak)
        for batch in args.batches
        for context_len in args.context_lens
    ]
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "from_json")}
    report = {
        "device": torch.cuda.get_device_name(),
        "timing": "triton.testing.do_bench_cudagraph",
        "peak_gbps": peak,
        "config": config,
        "rows": [asdict(r) for r in rows],
    }
    args.out.write_text(json.dumps(report, indent=2))
    save_plot(rows, report["device"], report["timing"], args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
