"""A model's linear layers in each CPU layout the engine can pack them in, paired on the same rows.

Each layout gets its own copy of the model's decoder and LM head (the real weights: 30 layers' distinct matrices
for SmolLM2, so that a pass reads them from memory, as a decode step does), packed by ``pack_linear_layers``; one
pass calls every layer once on random rows. The layouts are called in turn, ``--repeats`` times per row count, and
each one's fastest pass counts. fp32 models: our fp16 kernel (``fp16``, the default where it builds), fbgemm's fp16
(``fbgemm-fp16``, its head split by rows as the engine holds it) and oneDNN's packed fp32 (``onednn``); bf16 models:
our bf16 kernel (``bf16``, where the CPU has AVX512-BF16) and oneDNN's packed bf16 (``onednn``). ``--base REV``
adds our kernel as a git revision builds it (``fp16@base`` / ``bf16@base``, the kernels of that revision's
``paged_kernels/csrc/`` loaded beside the working tree's, as ``benchmarks.kernel_revisions`` loads them), in the same
passes. Writes JSON (the machine, every time), a table and a plot of each layout's time over the baseline's per row
count.

    .venv/bin/python -m benchmarks.linear_layers --dtype float32 --rows 1 2 4 8 32 128 512
    .venv/bin/python -m benchmarks.linear_layers --dtype bfloat16 --base HEAD~1 --baseline bf16@base --rows 1 16 64
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from benchmarks.common import RESULTS_DIR, machine, new_figure, print_table, save_with_legend, write_json
from benchmarks.kernel_revisions import kernels_from, resolve_revision, sources_at
from benchmarks.numerics import layers_pass, outermost_linear_layers, paired_min_s
from engine.model_files import resolve_model
from engine.models import cpu_packing, loader
from paged_kernels import reference

CPU = torch.device("cpu")


def layouts_for(dtype: torch.dtype, base_commit: str | None = None) -> dict[str, type[nn.Module]]:
    """The layouts this machine can run for ``dtype``, the baseline (the one the others are divided by) last; with
    ``base_commit``, our kernel as that commit builds it too."""
    if dtype == torch.float32:
        layouts: dict[str, type[nn.Module]] = {}
        if cpu_packing.fp16_kernel_applies():
            layouts["fp16"] = cpu_packing.Fp16Linear
        if cpu_packing.has_fbgemm_fp16():
            layouts["fbgemm-fp16"] = cpu_packing.FbgemmFp16Linear
    else:
        layouts = {"bf16": cpu_packing.Bf16Linear} if cpu_packing.bf16_kernel_applies() else {}
    if base_commit is not None:
        ours = next((name for name, layout in layouts.items() if issubclass(layout, cpu_packing.CompiledLinear)), None)
        if ours is None:
            raise SystemExit(f"--base: no kernel of ours runs {dtype} linear layers on this machine")
        build = kernels_from(sources_at(base_commit))
        if not hasattr(build, f"{ours}_linear"):
            raise SystemExit(f"--base: commit {base_commit[:12]} has no {ours}_linear kernel")
        layouts[f"{ours}@base"] = type(f"{layouts[ours].__name__}AtBase", (layouts[ours],), {"build": build})
    return {**layouts, "onednn": cpu_packing.PackedLinear}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The model, the dtype, the row counts and the output."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32, 128, 512])
    parser.add_argument("--repeats", type=int, default=5, help="passes per layout and row count (the fastest counts)")
    parser.add_argument("--baseline", default=None, help="the layout the others are divided by (default: fbgemm-fp16 "
                        "for fp32 where it runs, else onednn)")
    parser.add_argument("--base", default=None, help="a git revision whose build of our kernel runs too (as "
                        "fp16@base / bf16@base)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="linear-layers")
    args = parser.parse_args(argv)
    if min(args.rows) < 1:
        parser.error("--rows must be >= 1")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def packed_layers(folder: Path, dtype: torch.dtype, layer_type: type[nn.Module]) -> list[nn.Module]:
    """The model's linear layers (the head last) packed as ``layer_type``, outermost only (not a split head's
    halves)."""
    model = loader.load_model(folder, dtype, CPU, ops=reference, weight_packing="off")
    cpu_packing.pack_linear_layers(model, layer_type)
    return outermost_linear_layers(model)


def plot(results: list[dict[str, Any]], layouts: list[str], baseline: str, path: Path) -> None:
    """Each layout's time over the baseline's per row count, with the 1.0 line."""
    fig, ax = new_figure(figsize=(7, 4))
    rows = [result["rows"] for result in results]
    for layout in layouts:
        if layout != baseline:
            ax.plot(rows, [result[f"{layout}_over_{baseline}"] for result in results], marker="o", label=layout)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token rows per call")
    ax.set_title(f"linear layers: time over {baseline}'s")
    save_with_legend(fig, ax, f"time ÷ {baseline}", path)


def main(argv: list[str] | None = None) -> None:
    """Pack every layout, time the passes, print the table, write JSON and the plot."""
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    base_commit = None if args.base is None else resolve_revision(args.base)
    layouts = layouts_for(dtype, base_commit)
    baseline = args.baseline or ("fbgemm-fp16" if "fbgemm-fp16" in layouts else "onednn")
    if baseline not in layouts:
        raise SystemExit(f"--baseline must be one of this machine's layouts for {args.dtype}: {', '.join(layouts)}")
    folder = resolve_model(args.model)
    models = {name: packed_layers(folder, dtype, layer_type) for name, layer_type in layouts.items()}
    weight_bytes = sum(layer.in_features * layer.out_features for layer in models[baseline]) * 2  # as 16-bit
    results = []
    for rows in tqdm(args.rows, desc="row counts", unit="count"):
        passes = {name: layers_pass(layers, rows, dtype) for name, layers in models.items()}
        times = paired_min_s(passes, args.repeats)
        result: dict[str, Any] = {"rows": rows, **{f"{name}_ms": 1e3 * t for name, t in times.items()}}
        result.update({f"{name}_over_{baseline}": t / times[baseline] for name, t in times.items() if name != baseline})
        result.update({f"{name}_gb_per_s_16bit": weight_bytes / t / 1e9 for name, t in times.items()})
        results.append(result)
    columns = ["rows", *(f"{name}_ms" for name in layouts),
               *(f"{name}_over_{baseline}" for name in layouts if name != baseline)]
    print_table(f"{args.model} linear layers ({args.dtype}), fastest of {args.repeats} passes", results, columns)
    write_json(args.name, {"machine": machine(), "args": {**vars(args), "out": str(args.out)},
                           "base_commit": base_commit, "baseline": baseline,
                           "layouts": list(layouts), "results": results}, args.out)
    plot(results, list(layouts), baseline, args.out / f"{args.name}.png")


if __name__ == "__main__":
    main()
