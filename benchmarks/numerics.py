"""Quality and speed of the engine's numerics: exact fp32, oneDNN-packed fp32, fp16 weights, int8, int8 weights
only, and bf16 (auto's layers and oneDNN's).

Quality: the mean change of the log-probability of each token of a fixed text (teacher forced, on
transformers' model with our layers swapped in) and how many greedy tokens of the engine agree with
exact fp32 over some prompts. Speed: paired ratios from one run, each the minimum over interleaved
repeats, of the model's linear layers and of a whole decode step.

    .venv/bin/python -m benchmarks.numerics --rows 32 128 --repeats 5
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import cpu_description
from engine import LLM, SamplingParams
from engine.model_files import resolve_model
from engine.models import quantization
from engine.models.cpu_packing import pack_linear_layers, packed_layer_type, replace_linear_layers
from engine.models.quantization import Int8WeightOnlyLinear, quantize_linear_layers
from paged_kernels.cpu_features import has_fbgemm_fp16

# variant name -> LLM keyword arguments
VARIANTS: dict[str, dict[str, object]] = {
    "fp32-plain": {"cpu_weight_packing": "exact"},
    "fp32-packed": {"cpu_weight_packing": "onednn"},
    # these two pin an fp32 KV cache (auto's is fp16 under them): the weights' numerics alone, as the others
    "fp16-weights": {"cpu_weight_packing": "fp16", "kv_cache_dtype": "float32"},  # our kernel's or fbgemm's
    "int8": {"quantization": "int8", "cpu_weight_packing": "onednn", "kv_cache_dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},  # auto's pick where bf16 is fast (AMX, AMD's AVX512-BF16): our kernel's layers
    # (oneDNN's with AMX), fused layer ops
    "bf16-onednn": {"dtype": "bfloat16", "cpu_weight_packing": "onednn"},
    "bf16-int8-weight-only": {"dtype": "bfloat16", "quantization": "int8_weight_only"},
}
FIXED_TEXT = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling after decades of salt and "
    "wind. Every evening the keeper climbed the spiral stairs, trimmed the wick and polished the great lens "
    "until it shone. Ships passing in the night relied on its steady beam to steer clear of the rocks below. "
    "When the harbour commission decided to replace the lamp with an automatic light, the keeper wrote a "
    "long letter explaining why a human eye still mattered in a storm. The commission read the letter, "
    "thanked him for his service, and installed the new light the following spring."
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Q: What is the boiling point of water?\nA:",
    "The three primary colours are",
    "To make a cup of tea, first",
    "1, 2, 3, 4,",
    "The most important invention of the twentieth century",
]


def hf_variant(folder: Path, variant: str) -> nn.Module:
    """transformers' fp32 model of ``folder`` with its linear layers computed as ``variant`` computes them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if variant.startswith("bf16"):
        model = model.to(torch.bfloat16)  # transformers' own bf16 layers (oneDNN's): the dtype's cost
    if variant == "bf16" and (layer_type := packed_layer_type(torch.bfloat16, torch.device("cpu"))) is not None:
        pack_linear_layers(model, layer_type)  # type: ignore[arg-type]  # auto's layers: our kernel's where it applies
    elif variant == "bf16-int8-weight-only":
        replace_linear_layers(model, Int8WeightOnlyLinear)  # the LM head too, as in the engine
    elif variant == "int8":
        quantize_linear_layers(model.model)  # the decoder; a tied head stays full precision, as in the engine
    elif variant == "fp32-packed":
        pack_linear_layers(model)  # type: ignore[arg-type]
    elif variant == "fp16-weights":
        pack_linear_layers(model, packed_layer_type(torch.float32, torch.device("cpu"), "fp16"))  # type: ignore[arg-type]
    return model


def token_logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Log-probability the model gives each token of ``ids`` (1-D) after the ones before it."""
    with torch.inference_mode():
        logits = model(ids[None]).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, ids[1:, None])[:, 0]


def logprob_change(folder: Path, variant: str, text: str = FIXED_TEXT) -> tuple[float, float]:
    """(mean, mean absolute) change of the per-token log-probability of ``text``, ``variant`` minus exact fp32."""
    from transformers import AutoTokenizer

    ids = torch.tensor(AutoTokenizer.from_pretrained(folder).encode(text))
    change = token_logprobs(hf_variant(folder, variant), ids) - token_logprobs(hf_variant(folder, "fp32-plain"), ids)
    return change.mean().item(), change.abs().mean().item()


def greedy_tokens(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """The engine's greedy continuations, eos ignored."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Mean over prompts of the share of tokens generated before the first one that differs."""
    shares = []
    for ours, theirs in zip(tokens, reference):
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
        shares.append(same / len(theirs))
    return sum(shares) / len(shares)


def paired_min_s(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each run's fastest time over ``repeats`` rounds that call every run once, in turn, so that
    the variants share whatever load the machine has."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def outermost_linear_layers(model: nn.Module) -> list[nn.Module]:
    """Every linear layer of ``model`` (anything with ``in_features``) that no other one holds: an int8 layer's
    ``many_rows`` or a row-split head's halves run inside their holder."""
    linear = [m for m in model.modules() if hasattr(m, "in_features")]
    inner = {id(child) for m in linear for child in m.modules() if child is not m}
    return [m for m in linear if id(m) not in inner]


def layers_pass(layers: list[nn.Module], rows: int, dtype: torch.dtype) -> Callable[[], None]:
    """One pass of ``rows`` random token rows (of ``dtype``) through every one of ``layers``, run once here."""
    inputs = [torch.randn(rows, layer.in_features, dtype=dtype) for layer in layers]

    def run() -> None:
        with torch.inference_mode():
            for layer, hidden in zip(layers, inputs):
                layer(hidden)

    run()
    return run


def linear_layers_run(llm: LLM, rows: int) -> Callable[[], None]:
    """One pass of ``rows`` random token rows through every linear layer of the engine's model."""
    model = llm.engine.model
    return layers_pass(outermost_linear_layers(model), rows, model.embed_tokens.weight.dtype)


def start_decoding(llm: LLM, rows: int) -> list[str]:
    """Add ``rows`` long greedy requests and step until all are prefilled; returns their ids."""
    params = SamplingParams(max_tokens=1_000, temperature=0.0, ignore_eos=True)
    ids = [f"decode-{rows}-{i}" for i in range(rows)]
    for i, request_id in enumerate(ids):
        llm.engine.add_request(request_id, PROMPTS[i % len(PROMPTS)], params)
    while llm.stats().num_waiting:
        llm.engine.step()
    llm.engine.step()
    return ids


def stop_decoding(llm: LLM, ids: list[str]) -> None:
    """Abort the requests ``start_decoding`` added."""
    for request_id in ids:
        llm.engine.abort_request(request_id)
    llm.engine.step()


def machine() -> str:
    """CPU model and the SIMD flags that decide the kernels (bf16, VNNI, AVX-512, AMX)."""
    cpu = cpu_description()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return f"{cpu['cpu_model']}, {torch.get_num_threads()} threads, flags: {' '.join(cpu['cpu_flags'])}; {load}"


@contextmanager
def int8_kernel_for_every_row() -> Iterator[None]:
    """``int8_weight_only``'s compiled kernel for every call, whatever its rows, so that quality measures the kernel's
    arithmetic: a teacher-forced text and a batch of prompts would otherwise take the layers for many rows, whose
    dequantized weights are rounded to the model's dtype."""
    saved = quantization.INT8_KERNEL_MAX_ROWS
    quantization.INT8_KERNEL_MAX_ROWS = sys.maxsize
    try:
        yield
    finally:
        quantization.INT8_KERNEL_MAX_ROWS = saved


def print_quality(folder: Path, llms: dict[str, LLM], max_tokens: int) -> None:
    """Each fast variant's log-prob change on the fixed text and its greedy agreement with exact fp32."""
    reference = greedy_tokens(llms["fp32-plain"], PROMPTS, max_tokens)
    for name in [name for name in llms if name != "fp32-plain"]:
        with int8_kernel_for_every_row():
            mean, mean_abs = logprob_change(folder, name)
            agree = agreement(greedy_tokens(llms[name], PROMPTS, max_tokens), reference)
        print(f"{name}: log-prob change vs exact fp32 mean {mean:+.4f}, mean |.| {mean_abs:.4f} nats/token; "
              f"greedy agreement {agree:.3f} over {len(PROMPTS)} prompts x {max_tokens} tokens")


def print_speed(llms: dict[str, LLM], rows: int, repeats: int) -> None:
    """Paired minimum times (and ratios to fp32-plain) of the linear layers and of a decode step."""
    linear = paired_min_s({name: linear_layers_run(llm, rows) for name, llm in llms.items()}, repeats)
    decoding = {name: start_decoding(llm, rows) for name, llm in llms.items()}
    step = paired_min_s({name: llm.engine.step for name, llm in llms.items()}, repeats)
    for name, llm in llms.items():
        stop_decoding(llm, decoding[name])
    for label, times in (("linear layers", linear), ("decode step", step)):
        base = times["fp32-plain"]
        print(f"{rows:4d} rows {label}: " + ", ".join(
            f"{name} {t * 1e3:.1f} ms ({base / t:.2f}x)" for name, t in times.items()), flush=True)


def main() -> None:
    """Print the quality numbers, then the paired speed ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--speed-only", action="store_true", help="skip the quality numbers")
    args = parser.parse_args()
    folder = resolve_model(args.model)
    print(f"machine: {machine()}", flush=True)
    variants = {name: kwargs for name, kwargs in VARIANTS.items() if name != "fp16-weights" or has_fbgemm_fp16()}
    base = {"dtype": "float32", "kv_cache_memory": "256MiB", "max_num_seqs": max(args.rows)}
    llms = {name: LLM(model=str(folder), **{**base, **kwargs}) for name, kwargs in variants.items()}
    if not args.speed_only:
        print_quality(folder, llms, args.max_tokens)
    for rows in args.rows:
        print_speed(llms, rows, args.repeats)


if __name__ == "__main__":
    main()
