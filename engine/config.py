"""Engine configuration: one validated object built from the ``LLM`` keyword arguments."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from paged_kernels import backend_name
from paged_kernels.cpu_features import cpu_flags, cpu_vendor, has_fbgemm_fp16
from paged_kernels.cpu_ops import reads_cache_dtype

_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
DTYPE_NAMES = ("auto", *_DTYPES)  # what `dtype` accepts as a name (the service's setting lists the same)
PREEMPTION_MODES = ("swap", "recompute")
WEIGHT_PACKING_MODES = ("auto", "onednn", "fp16", "exact", "off")
QUANTIZATION_MODES = ("int8", "int8_weight_only")
SCHEDULING_POLICIES = ("fcfs", "priority")


def parse_bytes(value: int | str, name: str) -> int:
    """Parse a byte count given as an int or a string such as ``"256MiB"`` or ``"1.5GB"``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte count like 268435456 or '256MiB', got {value!r}")
    if isinstance(value, int):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _BYTE_UNITS:
            raise ValueError(f"{name} must be a byte count like 268435456 or '256MiB', got {value!r}")
        number, unit = float(match.group(1)), match.group(2).lower()
    result = int(number * _BYTE_UNITS[unit])
    if result < 0:
        raise ValueError(f"{name} must be >= 0 bytes, got {value!r}")
    return result


def holds_weights_below_fp32(device: torch.device, dtype: torch.dtype, weight_packing: str,
                             quantization: str | None) -> bool:
    """Whether an fp32 model's linear weights are held below fp32 on this CPU: as fp16 for our F16C kernel or
    fbgemm (``cpu_weight_packing`` ``"auto"`` or ``"fp16"`` on a CPU with AVX2, F16C and FMA, which both need), or
    quantized to int8 there. (Where neither our kernel builds nor torch has fbgemm, fp16 packing falls back to
    oneDNN's fp32: judged from the flags alone, without building the kernels, that rare case still counts.)"""
    return (device.type == "cpu" and dtype == torch.float32 and {"avx2", "f16c", "fma"} <= cpu_flags()
            and (quantization is not None or weight_packing in ("auto", "fp16")))


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Pick the weights dtype; ``auto`` is bf16 where it is fast (CUDA, CPUs whose bf16 beats fp32), else fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda" or _cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _cpu_has_fast_bf16() -> bool:
    """Whether bf16 matrix products outrun fp32 ones on this CPU: with AMX tiles, and with AMD's AVX512-BF16
    (a Zen 4 EPYC: 360 against 97 GFLOP/s at 32 rows). Intel's AVX512-BF16 without AMX is not enough: there
    oneDNN's packed bf16 linears ran 1.5-1.7x slower than its packed fp32 ones (2-vCPU Xeon, 32-256 rows)."""
    flags = cpu_flags()
    return "amx_bf16" in flags or ("avx512_bf16" in flags and cpu_vendor() == "AuthenticAMD")


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to size its cache and batch its work."""

    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None  # a local tokenizer folder; None: the model's own
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    # the KV cache's dtype: "auto" the model's, but fp16 for an fp32 model whose weights the CPU holds in fp16 or
    # int8, under the CPU's compiled attention (decode attention then reads half the bytes, and the same memory
    # holds twice the tokens); a name as `dtype` takes: the model's dtype, or fp16 / bf16 under an fp32 model on the
    # CPU (not with the triton backend)
    kv_cache_dtype: str | torch.dtype = "auto"
    gpu_memory_utilization: float = 0.9
    swap_space: int | str = "1GiB"
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    preemption_mode: str = "swap"
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    watermark: float = 0.01
    seed: int = 0
    attention_backend: str | None = None
    # CPU threads for torch ops; None keeps torch's default. Fewer threads than cores help when
    # other busy processes share the machine (OpenMP waits on descheduled threads).
    num_threads: int | None = None
    # prepacked linear weights on the CPU: "auto" the fastest for the CPU (bf16 in our AVX512-BF16 kernel's layout
    # where it applies, else oneDNN's; fp32 as fp16 weights in our AVX2/F16C kernel's layout, else fbgemm's where it
    # runs, else oneDNN's fp32; both round differently from transformers'), "onednn" oneDNN's layout for both, "fp16"
    # fp16 weights for fp32 (ours, else fbgemm's), "exact" packs bf16 for oneDNN only (bit-identical to F.linear;
    # fp32 tokens equal transformers'), "off"
    cpu_weight_packing: str = "auto"
    # "int8": int8 weights and per-token int8 activations in every linear layer (CPU only); "int8_weight_only": int8
    # weights, activations in the model's dtype, read by a compiled kernel at up to 4 rows with AVX512-VNNI, 1 with
    # AVX-512 alone, 2 with AVX2 (CPU only; holds the dequantized weights too, for more rows); None: none
    quantization: str | None = None
    # decode runs from CUDA graphs captured at start for batches up to cuda_graph_max_batch (padded to
    # 1, 2, 4, 8, 16, ...); True keeps every step eager. The CPU never captures.
    enforce_eager: bool = False
    cuda_graph_max_batch: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 256:
            raise ValueError(f"block_size must be an integer between 1 and 256, got {self.block_size!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if self.max_num_batched_tokens is not None and (
            not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1
        ):
            raise ValueError(
                f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}"
            )
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so that every running sequence can decode each step"
            )
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads must be an integer >= 1 or None, got {self.num_threads!r}")
        if self.cpu_weight_packing not in WEIGHT_PACKING_MODES:
            raise ValueError(
                f"cpu_weight_packing must be one of {WEIGHT_PACKING_MODES}, got {self.cpu_weight_packing!r}"
            )
        if self.cpu_weight_packing == "fp16" and not has_fbgemm_fp16():
            raise ValueError("cpu_weight_packing='fp16' needs torch's fbgemm engine and a CPU with AVX2, F16C and FMA, "
                             "which this one lacks: use 'auto'")
        if self.quantization is not None and self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be None or one of {QUANTIZATION_MODES}, got {self.quantization!r}")
        if self.quantization is not None and self.torch_device().type != "cpu":
            raise ValueError(f"quantization={self.quantization!r} runs on the CPU only, got device {self.device!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        if not isinstance(self.cuda_graph_max_batch, int) or isinstance(self.cuda_graph_max_batch, bool) \
                or self.cuda_graph_max_batch < 1:
            raise ValueError(f"cuda_graph_max_batch must be an integer >= 1, got {self.cuda_graph_max_batch!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        self.kv_cache_torch_dtype()  # refuses a bad kv_cache_dtype now
        self.swap_space = parse_bytes(self.swap_space, "swap_space")

    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The KV cache's dtype (``kv_cache_dtype`` resolved against the model's); raises ``ValueError`` for a name it
        does not know, or one the kernels cannot pair with the model's dtype on this device and backend."""
        device = self.torch_device()
        dtype = resolve_dtype(self.dtype, device)
        backend = backend_name(device, self.attention_backend)
        if self.kv_cache_dtype == "auto":
            below_fp32 = holds_weights_below_fp32(device, dtype, self.cpu_weight_packing, self.quantization)
            return torch.float16 if backend == "cpu" and below_fp32 else dtype
        if isinstance(self.kv_cache_dtype, torch.dtype):
            cache_dtype = self.kv_cache_dtype
        elif self.kv_cache_dtype in _DTYPES:
            cache_dtype = _DTYPES[self.kv_cache_dtype]
        else:
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.kv_cache_dtype!r}")
        # the CPU's compiled kernels widen a 16-bit cache under fp32 queries, and the plain-torch backend converts
        # what it gathers; the Triton kernels read caches of the query's dtype only
        if cache_dtype != dtype and not (device.type == "cpu" and backend != "triton"
                                         and reads_cache_dtype(dtype, cache_dtype)):
            raise ValueError(
                f"kv_cache_dtype must be the model's dtype ({dtype}), or float16 / bfloat16 under an fp32 model on "
                f"the CPU (not with the triton backend), got {self.kv_cache_dtype!r} on {device.type}")
        return cache_dtype

    def torch_device(self) -> torch.device:
        """The device the model and KV cache live on (``auto``: CUDA when available)."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
