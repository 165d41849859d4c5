"""Prepacked weights for linear layers on the CPU: our bf16 and fp16 kernels' layouts, oneDNN's, or fbgemm's fp16.

``F.linear`` on bf16 CPU tensors runs oneDNN, which lays the weight out in its blocked format on
every call. Reordering each weight once at load time and calling oneDNN's linear on the packed
weight gives bit-identical results 1.1-3.6× faster (1.9× at 8 rows, 1.3× at 32; most at small
batches, where decode steps live). Packed fp32 is faster than ``F.linear``'s MKL path too (3-4× on
AVX-512, 1.3-2× at 8-32 rows on AVX2), but rounds differently from it, so the ``"exact"`` mode, which
keeps tokens equal to transformers', leaves fp32 on ``F.linear``.

Decode steps at a few rows are bound by reading the weights. Where the CPU has AVX512-BF16, a bf16 model's layers
run our compiled kernel (``paged_kernels/csrc/bf16_linear_cpu.cpp``, ``Bf16Linear``), whose layout is read in one
sequential pass: SmolLM2's linear layers took 0.47x oneDNN's packed bf16 time at 1 row, 0.41x at 2, 0.59x at 4,
0.61x at 8, 0.85x at 32 and 0.94x at 128 (``benchmarks.numerics``), and 0.99x at 512 rows (30 distinct layers and
the head, past the L3), on a 2-vCPU Zen 4 (the twentieth session's kernel; since the twenty-ninth a pass of 6 rows or
more reads ahead: 0.82-0.93x that kernel's time at 12-64 rows, BENCHMARKS.md). Where the CPU has AMX tiles too,
the kernel multiplies in them, as oneDNN does; the ratios to oneDNN's time on a 2-vCPU Emerald Rapids are in
BENCHMARKS.md. Sums are fp32 in another order than oneDNN's, so bf16 results can differ from ``F.linear``'s by
rounding.

Decode steps of an fp32 model are bound by reading the weights too, and fp16 weights halve the bytes, while rounding
each weight to 11 significant bits (bf16 keeps 8). Where the CPU has AVX2, F16C and FMA, an fp32 model's layers run
our compiled kernel (``paged_kernels/csrc/fp16_linear_cpu.cpp``, ``Fp16Linear``), in one layout for every row count,
the head included: SmolLM2's linear layers took 0.85x the time of fbgemm's fp16 GEMM at 1-2 rows, 0.90-0.96x at 3-4,
0.85-0.89x at 8-32 and 0.92-0.95x at 128-512 (``benchmarks.linear_layers``, a 2-vCPU Zen 3 with AVX2 alone; its
decode step 0.86x at 1 row, 0.87-0.92x at 4-64). Without the kernel, fbgemm's fp16 GEMM
(``quantized::linear_dynamic_fp16``, torch's own op; torchao has no CPU path that keeps fp16 weights and fp32
arithmetic) serves instead: it ran the decoder layers 1.3-2.1x faster than packed fp32 at 8-128 rows on an AVX2 EPYC.
Its LM head (49,152 outputs) is packed both ways: fbgemm's fp16 ran it 2.4x faster than oneDNN's fp32 at 1-4 rows,
1.55x at 8 and 1.18x at 16, but 0.8x at 24-32 and 0.5x at 128 (AVX2 EPYC).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from engine.models.llama import LlamaForCausalLM
from paged_kernels.cpu_extension import cpu_kernels
from paged_kernels.cpu_features import cpu_flags, has_fbgemm_fp16

FP16_MAX = torch.finfo(torch.float16).max
FP16_HEAD_MAX_ROWS = 16  # the most rows for which fbgemm's fp16 LM head beat oneDNN's fp32 (see above)


class PackedLinear(nn.Module):
    """``y = x W^T + b`` for 2-D ``x`` with ``W`` held in oneDNN's packed layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(hidden, self.packed_weight, self.bias, "none", [], "")


class CompiledLinear(nn.Module):
    """``y = x W^T + b`` by one of our compiled kernels (``kernel``: its functions are ``{kernel}_pack_weight``,
    ``{kernel}_linear`` and ``has_{kernel}_linear``), over ``W`` packed once in its layout as ``weight_dtype``,
    summed in fp32."""

    kernel: str
    weight_dtype: torch.dtype
    needs: str  # what the kernel's build needs of the CPU, for the error where it is absent
    build: ModuleType | None = None  # a build of the kernels other than the engine's (benchmarks.linear_layers --base)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        kernels = self.build or cpu_kernels()
        if kernels is None or not getattr(kernels, f"has_{self.kernel}_linear")():
            raise RuntimeError(f"{type(self).__name__} needs the CPU's compiled kernels built with {self.needs}, which "
                               "this machine lacks: use cpu_weight_packing='onednn'")
        self.linear = getattr(kernels, f"{self.kernel}_linear")
        self.out_features, self.in_features = weight.shape
        self.packed_weight = getattr(kernels, f"{self.kernel}_pack_weight")(self.weight_in_dtype(weight.detach()))
        self.fp32_bias = torch.empty(0) if bias is None else bias.detach().float().contiguous()

    def weight_in_dtype(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` as ``weight_dtype``, the type the packing takes."""
        return weight.to(self.weight_dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.dim() == 2  # the model's rows: no reshapes (each costs a dispatch, 121 layers a step)
        rows = hidden if flat else hidden.reshape(-1, self.in_features)
        out = self.linear(rows, self.packed_weight, self.fp32_bias, self.in_features, self.out_features)
        return out if flat else out.reshape(*hidden.shape[:-1], self.out_features)


class Bf16Linear(CompiledLinear):
    """A bf16 model's layer by our AVX512-BF16 kernel (``bf16_linear``), rounded to bf16 once."""

    kernel, weight_dtype, needs = "bf16", torch.bfloat16, "AVX512-BF16"


class Fp16Linear(CompiledLinear):
    """An fp32 model's layer by our AVX2/F16C kernel (``fp16_linear``): ``W`` stored in fp16 and widened to fp32 in
    registers, fp32 results."""

    kernel, weight_dtype, needs = "fp16", torch.float16, "AVX2, F16C and FMA"

    def weight_in_dtype(self, weight: torch.Tensor) -> torch.Tensor:
        # fp16's largest finite value bounds the weights, as fbgemm's fp16 packing saturates them
        return weight.float().clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


class FbgemmFp16Linear(nn.Module):
    """``y = x W^T + b`` for fp32 ``x`` with ``W`` stored in fp16 for fbgemm, multiplied and summed in fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.quantized.linear_prepack_fp16(
            weight.detach().float(), None if bias is None else bias.detach().float())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # torch's Python binding looks up ``__torch_function__`` on every argument; on the packed weight (a
        # ScriptObject) the failed lookup throws a C++ exception that becomes an AttributeError: 25-30 us a call,
        # 121 calls in a SmolLM2 step, whatever its rows. With subclasses' torch functions off, the binding skips
        # the lookup (no tensor subclass reaches this layer: its weight is fbgemm's, its input the model's own).
        with torch._C.DisableTorchFunctionSubclass():
            return torch.ops.quantized.linear_dynamic_fp16(hidden, self.packed_weight)


class RowSplitHead(nn.Module):
    """An LM head held as fp16 weights for fbgemm, used up to ``FP16_HEAD_MAX_ROWS`` rows, and as oneDNN's
    packed fp32 for more rows, where fbgemm's fp16 GEMM over so many outputs falls behind."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.few_rows = FbgemmFp16Linear(weight, bias)
        self.many_rows = PackedLinear(weight, bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.numel() // self.in_features
        return (self.few_rows if rows <= FP16_HEAD_MAX_ROWS else self.many_rows)(hidden)


def bf16_kernel_applies() -> bool:
    """Whether ``"auto"`` gives a bf16 model our kernel's layers: AVX512-BF16 (with or without AMX), in a build that
    has it."""
    if "avx512_bf16" not in cpu_flags():
        return False
    kernels = cpu_kernels()
    return kernels is not None and kernels.has_bf16_linear()


def fp16_kernel_applies() -> bool:
    """Whether ``"auto"`` and ``"fp16"`` give an fp32 model our fp16 kernel's layers: a build that has it (AVX2, F16C
    and FMA)."""
    kernels = cpu_kernels()
    return kernels is not None and kernels.has_fp16_linear()


def packed_layer_type(dtype: torch.dtype, device: torch.device, mode: str = "auto") -> type[nn.Module] | None:
    """The layer ``mode`` (``EngineConfig.cpu_weight_packing``) puts in place of a ``dtype`` model's linear
    layers on ``device``, None to leave them: bf16 under ``"auto"`` in our kernel's layout where it applies, else
    packed for oneDNN where oneDNN supports it; fp32 packed unless ``"exact"``: as fp16 weights under ``"fp16"`` and
    ``"auto"``, in our kernel's layout where it applies, else for fbgemm where it runs them (``"auto"`` falls back to
    oneDNN's fp32 where neither does)."""
    if mode == "off" or device.type != "cpu":
        return None
    if dtype == torch.bfloat16 and mode == "auto" and bf16_kernel_applies():
        return Bf16Linear
    if dtype == torch.float32 and mode in ("auto", "fp16") and fp16_kernel_applies():
        return Fp16Linear
    if not torch.backends.mkldnn.is_available():
        return None
    if dtype == torch.bfloat16:
        return PackedLinear if torch.ops.mkldnn._is_mkldnn_bf16_supported() else None
    if dtype != torch.float32 or mode == "exact":
        return None
    if mode == "fp16" or (mode == "auto" and has_fbgemm_fp16()):
        return FbgemmFp16Linear  # "fp16" where fbgemm cannot run it was refused by EngineConfig
    return PackedLinear


def replace_linear_layers(model: nn.Module, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]) -> int:
    """Replace every ``nn.Linear`` of ``model`` by ``make(weight, bias)``; returns how many were replaced."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, make(child.weight, child.bias))
                count += 1
    return count


def pack_linear_layers(model: LlamaForCausalLM, layer_type: type[nn.Module] = PackedLinear) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``layer_type``, and its LM head (or, tied, a copy of the
    embedding) by a ``layer_type`` too (a ``RowSplitHead`` with fbgemm's fp16 layers); returns how many were replaced.
    The original weights are released, except the embedding. A head already replaced (quantized) stays, and the
    ``nn.Linear`` layers it holds (``int8_weight_only``'s layer for many rows) are packed as a head is."""
    head_type = RowSplitHead if layer_type is FbgemmFp16Linear else layer_type
    head = model.lm_head
    if head is not None and not isinstance(head, nn.Linear):
        return replace_linear_layers(head, head_type) + replace_linear_layers(model, layer_type)
    model.lm_head = None  # packed below, its own way
    count = replace_linear_layers(model, layer_type)
    weight, bias = (model.embed_tokens.weight, None) if head is None else (head.weight, head.bias)
    model.lm_head = head_type(weight, bias)
    return count + 1
