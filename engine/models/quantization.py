"""int8 linear layers on the CPU: int8 weights per output channel, int8 activations per token.

Weights are quantized once with torchao's affine primitives; the matmul runs oneDNN's int8 linear
(``onednn::qlinear_pointwise``, the kernel torchao's x86 PT2E path lowers to). torchao's eager int8
configs do not speed up a CPU here (torchao 0.18, torch 2.13): ``Int8WeightOnlyConfig`` dequantizes the
whole weight on every call (0.5-0.9x fp32) and ``Int8DynamicActivationInt8WeightConfig`` runs
``torch._int_mm``'s CPU fallback (14-50x slower). ``torch.ao``'s fbgemm dynamic linear is deprecated.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.cpu_packing import replace_linear_layers

# Weights use 7 bits: on x86 without VNNI, oneDNN multiplies u8 activations by s8 weights in pairs
# summed into int16, which saturates at 255 * 127 * 2 but not at 255 * 63 * 2. Keeping activations at
# 8 bits costs less quality (SmolLM2: mean |log-prob change| 0.24 vs 0.39 with 7-bit activations).
_WEIGHT_MAX = 63
_ACTIVATION_MAX = 127
_ACTIVATION_ZERO_POINT = 128


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 7-bit ``(qdata, scale)`` of a ``[out, in]`` weight in int8, one fp32 scale per output row."""
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

    block_size = (1, weight.shape[1])
    weight = weight.detach().float()
    scale, zero_point = choose_qparams_affine(
        weight, MappingType.SYMMETRIC, block_size, torch.int8, -_WEIGHT_MAX, _WEIGHT_MAX, scale_dtype=torch.float32,
    )
    qdata = quantize_affine(weight, block_size, scale, zero_point, torch.int8, -_WEIGHT_MAX, _WEIGHT_MAX)
    return qdata, scale.reshape(-1)


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


def quantize_linear_layers(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by an ``Int8Linear``; returns how many were replaced.

    A tied LM head stays in full precision: it reads the embedding matrix, which lookups need anyway."""
    return replace_linear_layers(model, Int8Linear)
