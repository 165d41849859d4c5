"""int8 linear layers on the CPU, two ways (``EngineConfig.quantization``).

``"int8"``: int8 weights per output channel and int8 activations per token. Weights are quantized once with
torchao's affine primitives; the matmul runs oneDNN's int8 linear (``onednn::qlinear_pointwise``, the kernel
torchao's x86 PT2E path lowers to). torchao's eager int8 configs do not speed up a CPU here (torchao 0.18,
torch 2.13): ``Int8WeightOnlyConfig`` dequantizes the whole weight on every call (0.5-0.9x fp32) and
``Int8DynamicActivationInt8WeightConfig`` runs ``torch._int_mm``'s CPU fallback (14-50x slower). ``torch.ao``'s
fbgemm dynamic linear is deprecated.

``"int8_weight_only"``: int8 weights, one scale per 32 of a row, activations in the model's dtype. A decode
step of a few rows is bound by reading the weights, and no library kernel reads int8 weights at memory speed at
so few rows (torch's ``_weight_int8pack_mm``, which torchao's weight-only path calls, ran a SmolLM2 step's linears
at 0.51-0.97x oneDNN bf16's speed at 1 row), so those rows take our compiled kernels: with AVX512-VNNI
``int8_vnni_linear_cpu.cpp`` (each row quantized to int16 in groups of 32, integer sums), elsewhere
``int8_linear_cpu.cpp`` (each weight widened to fp32, fp32 sums). More rows (prefill, larger batches) multiply the
same quantized weights dequantized to the model's dtype, held as a second copy, in the layers weight packing gives
the model (our bf16 kernel's, oneDNN's or fbgemm's fp16), which are faster there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.cpu_packing import replace_linear_layers
from engine.models.llama import LlamaForCausalLM
from paged_kernels.cpu_extension import cpu_kernels
from paged_kernels.cpu_features import cpu_flags

# Weights use 7 bits: on x86 without VNNI, oneDNN multiplies u8 activations by s8 weights in pairs
# summed into int16, which saturates at 255 * 127 * 2 but not at 255 * 63 * 2. Keeping activations at
# 8 bits costs less quality (SmolLM2: mean |log-prob change| 0.24 vs 0.39 with 7-bit activations).
_WEIGHT_MAX = 63
_ACTIVATION_MAX = 127
_ACTIVATION_ZERO_POINT = 128
# int8_weight_only: the most rows a call multiplies from the int8 weights. On a Zen 4 EPYC (2 vCPUs) a SmolLM2
# step's linears at 1 / 2 / 4 rows took 3.7 / 4.0 / 6.6 ms with the VNNI kernel (int8_vnni_linear) and 5.4 / 6.9 /
# 10.8 ms with the fp32 one (int8_linear's AVX-512 path) against 5.6 / 5.6 / 6.3 for our bf16 kernel's layers and
# 6.1 / 6.6 / 9.0 for fbgemm's fp16 weights, the many-rows layers of bf16 and fp32 models there; the AVX2 build
# (int8_linear's path without AVX-512) took 5.0 / 5.9 / 11.0 ms at 1 / 2 / 4 rows against 8.7 / 8.7 / 9.2 ms for
# fbgemm's fp16 weights, the many-rows layers of such CPUs. With AMX (a 2-vCPU Emerald Rapids), where our bf16
# kernel multiplies in tiles: 7.6 / 8.2 / 9.5-9.8 / 10.9 / 12.0-12.5 ms at 1 / 2 / 4 / 6 / 8 rows with the VNNI kernel
# against 10.0-10.5 ms for the bf16 layers at any of those, so the bound stays there too.
INT8_KERNEL_MAX_ROWS = 4 if {"avx512_vnni", "avx512bw"} <= cpu_flags() else 1 if "avx512f" in cpu_flags() else 2
GROUP_SIZE = 32  # weights per scale, as llama.cpp's Q8_0 (SmolLM2 in bf16: mean |log-prob change| 0.054 nats
# per token from exact fp32 with groups of 32, 0.095 with one scale per row; bf16 alone 0.038)


def _quantize_symmetric(weight: torch.Tensor, group: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 ``(qdata, scale [out, in / group])`` of a ``[out, in]`` weight within +-``qmax``, one fp32
    scale per ``group`` weights of a row (``in`` a multiple of ``group``)."""
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

    block_size = (1, group)
    weight = weight.detach().float()
    scale, zero_point = choose_qparams_affine(
        weight, MappingType.SYMMETRIC, block_size, torch.int8, -qmax, qmax, scale_dtype=torch.float32,
    )
    qdata = quantize_affine(weight, block_size, scale, zero_point, torch.int8, -qmax, qmax)
    return qdata, scale.reshape(weight.shape[0], -1)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 7-bit ``(qdata, scale)`` of a ``[out, in]`` weight in int8, one fp32 scale per output row."""
    qdata, scale = _quantize_symmetric(weight, weight.shape[1], _WEIGHT_MAX)
    return qdata, scale.reshape(-1)


def quantize_weight_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 8-bit ``(qdata [out, in], scale [out, ceil(in / GROUP_SIZE)])`` of a ``[out, in]`` weight, one fp32
    scale per ``GROUP_SIZE`` weights of a row (the last group of a row may be shorter)."""
    in_features = weight.shape[1]
    padded = F.pad(weight.detach().float(), (0, -in_features % GROUP_SIZE))  # zeros change no group's maximum
    qdata, scale = _quantize_symmetric(padded, GROUP_SIZE, 127)
    return qdata[:, :in_features].contiguous(), scale


def dequantize_weight_groups(qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 ``[out, in]`` weight that ``quantize_weight_groups``'s ``(qdata, scale)`` stand for."""
    return qdata.float() * scale.repeat_interleave(GROUP_SIZE, dim=1)[:, :qdata.shape[1]]


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` in int8 and ``x`` quantized per row on each call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        qdata, scale = quantize_weight(weight)
        self.packed_weight = torch.ops.onednn.qlinear_prepack(qdata, None)
        self.weight_scale = scale
        self.weight_zero_point = torch.zeros(self.out_features, dtype=torch.int32)
        self.input_scale = torch.ones((), dtype=torch.float32)
        self.input_zero_point = torch.full((), _ACTIVATION_ZERO_POINT, dtype=torch.int32)
        self.bias = bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, self.in_features).float()  # oneDNN's bf16 output is wrong here; fp32 is not
        # each row gets its own scale; oneDNN sees scale 1 and the rows are rescaled after the matmul
        row_scale = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(_ACTIVATION_MAX)
        quantized = (rows / row_scale).round_().add_(_ACTIVATION_ZERO_POINT).to(torch.uint8)
        out = torch.ops.onednn.qlinear_pointwise.tensor(
            quantized, self.input_scale, self.input_zero_point, self.packed_weight, self.weight_scale,
            self.weight_zero_point, None, 1.0, 0, torch.float32, "none", [], "",
        ).mul_(row_scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*hidden.shape[:-1], self.out_features).to(hidden.dtype)


class Int8WeightOnlyLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` quantized to int8, one scale per ``GROUP_SIZE`` weights of an output channel (as
    llama.cpp's Q8_0), and ``x`` kept in the model's dtype (summed in fp32). Up to ``INT8_KERNEL_MAX_ROWS`` rows the
    compiled kernel reads the int8 weights; more rows run ``many_rows``, an ``nn.Linear`` over the same quantized
    weights dequantized to the model's dtype (which weight packing then replaces by its packed layer). The two agree
    up to rounding (bf16 keeps 8 significant bits of each dequantized weight; the kernel multiplies it in fp32, the
    VNNI kernel with the rows rounded to int16 in groups of 32), so a sequence's tokens can depend on how many rows
    its steps had."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        kernels = cpu_kernels()
        if kernels is None:
            raise RuntimeError("quantization='int8_weight_only' needs the CPU's compiled kernels, which could not be "
                               "built here (see the warning above); use quantization=None")
        # with AVX512-VNNI the integer kernel (rows quantized to int16 in groups of 32), else the fp32 one
        vnni = kernels.has_int8_vnni_linear()
        pack = kernels.int8_vnni_pack_weight if vnni else kernels.int8_pack_weight
        self.linear = kernels.int8_vnni_linear if vnni else kernels.int8_linear
        self.out_features, self.in_features = weight.shape
        qdata, scale = quantize_weight_groups(weight)
        self.packed_weight, self.packed_scale = pack(qdata, scale)
        self.fp32_bias = torch.empty(0) if bias is None else bias.detach().float().contiguous()
        self.many_rows = torch.nn.utils.skip_init(  # no random init: the weights are copied in next
            nn.Linear, self.in_features, self.out_features, bias=bias is not None, dtype=weight.dtype)
        with torch.no_grad():
            self.many_rows.weight.copy_(dequantize_weight_groups(qdata, scale))
            if bias is not None:
                self.many_rows.bias.copy_(bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.numel() > INT8_KERNEL_MAX_ROWS * self.in_features:  # more rows than the kernel takes
            return self.many_rows(hidden)
        rows = hidden.reshape(-1, self.in_features)
        out = self.linear(rows, self.packed_weight, self.packed_scale, self.fp32_bias, self.in_features,
                          self.out_features)
        return out.reshape(*hidden.shape[:-1], self.out_features)


def quantize_weights_only(model: LlamaForCausalLM) -> int:
    """Replace every ``nn.Linear`` of ``model`` and its LM head (tied: a copy of the embedding; lookups keep the
    embedding in full precision) by an ``Int8WeightOnlyLinear``; returns how many were replaced."""
    count = replace_linear_layers(model, Int8WeightOnlyLinear)
    if model.lm_head is None:
        model.lm_head = Int8WeightOnlyLinear(model.embed_tokens.weight, None)
        count += 1
    return count


def quantize_linear_layers(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by an ``Int8Linear``; returns how many were replaced.

    A tied LM head stays in full precision: it reads the embedding matrix, which lookups need anyway."""
    return replace_linear_layers(model, Int8Linear)
