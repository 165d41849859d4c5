"""A CPU decode step's decoder layers in one compiled call (``decode_layers``, ``paged_kernels/csrc/
decode_stack_cpu.cpp``).

With fused layer ops and every projection in one of our compiled kernels' layouts, a decode step's layer is a dozen
calls of compiled code, and the Python around them (module calls, views, argument checks, dispatch) cost about as
much as the norms and the attention together: 2-3 ms of a 15 ms SmolLM2 step at one sequence on a 2-vCPU Zen 3. The
compiled loop calls the same kernels in the same order on the same tensors, so its results are bit-identical to the
layers'. Steps with prefill rows, and models whose layers it does not know, keep the Python layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.models.cpu_packing import CompiledLinear
from engine.models.llama import CosSin, LlamaForCausalLM
from engine.models.quantization import INT8_KERNEL_MAX_ROWS, Int8WeightOnlyLinear
from paged_kernels import cpu_ops
from paged_kernels.checks import check_cache_write, check_decode
from paged_kernels.cpu_extension import cpu_kernels

# decode_stack_cpu.cpp's LinearKind: the kernel function each code stands for
LINEAR_KINDS = {"fp16_linear": 0, "bf16_linear": 1, "int8_linear": 2, "int8_vnni_linear": 3}


def _linear_args(layer: nn.Module, kernels: ModuleType) -> tuple[list[torch.Tensor], list[int]] | None:
    """A projection as ``decode_layers`` takes it (its packed weight, packed scale and bias; its kind, in and out
    features), or None where it is not one of our compiled kernels' layers."""
    if not isinstance(layer, CompiledLinear | Int8WeightOnlyLinear):
        return None
    name = getattr(layer.linear, "__name__", None)
    if name not in LINEAR_KINDS or layer.linear is not getattr(kernels, name):
        return None
    scale = layer.packed_scale if isinstance(layer, Int8WeightOnlyLinear) else torch.empty(0)
    return [layer.packed_weight, scale, layer.fp32_bias], [LINEAR_KINDS[name], layer.in_features, layer.out_features]


@dataclass(frozen=True, slots=True)
class StackLinears:
    """Every layer's projections as ``decode_layers`` takes them, flattened: ``tensors`` 3 and ``shapes`` 3 per
    projection."""

    tensors: list[torch.Tensor]
    shapes: list[int]

    @classmethod
    def of(cls, projections: list[nn.Module], kernels: ModuleType) -> StackLinears | None:
        """``projections`` (qkv, o, gate_up and down of each layer in turn), or None where one is not compiled."""
        linears = [args for projection in projections if (args := _linear_args(projection, kernels)) is not None]
        if len(linears) < len(projections):
            return None
        return cls([tensor for tensors, _ in linears for tensor in tensors],
                   [value for _, shapes in linears for value in shapes])


class CompiledDecodeStack:
    """The decoder layers of a model (with fused layer ops, on the CPU kernel backend, every projection compiled) as
    the arguments of one ``decode_layers`` call, gathered once. ``int8_weight_only`` layers run their kernel up to
    ``INT8_KERNEL_MAX_ROWS`` rows and their ``many_rows`` layer past it: the stack keeps both sets of projections."""

    def __init__(self, model: LlamaForCausalLM, kernels: ModuleType, few_rows: StackLinears,
                 many_rows: StackLinears | None, max_few_rows: int | None) -> None:
        attention = model.layers[0].self_attn
        self.decode_layers = kernels.decode_layers
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        self.head_dim = attention.head_dim
        self.scale = attention.attn.scale
        self.eps = model.norm.eps
        self.norm_weights = [norm.weight for layer in model.layers
                             for norm in (layer.input_layernorm, layer.post_attention_layernorm)] + [model.norm.weight]
        self.few_rows, self.many_rows, self.max_few_rows = few_rows, many_rows, max_few_rows

    @classmethod
    def for_model(cls, model: LlamaForCausalLM) -> CompiledDecodeStack | None:
        """The stack of ``model``, or None where its decode steps must stay on the Python layers: layer ops not fused,
        another kernel backend, a projection in another layout, norms of differing eps."""
        kernels = cpu_kernels()
        if model.fused_ops is None or kernels is None or model.fused_ops is not kernels:
            return None
        if any(layer.self_attn.attn.ops is not cpu_ops for layer in model.layers):
            return None
        norms = [norm for layer in model.layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        if any(norm.eps != model.norm.eps for norm in norms):
            return None
        projections = [projection for layer in model.layers
                       for projection in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                          layer.mlp.down_proj)]
        few_rows = StackLinears.of(projections, kernels)
        if few_rows is None:
            return None
        if not any(isinstance(projection, Int8WeightOnlyLinear) for projection in projections):
            return cls(model, kernels, few_rows, None, None)
        many_rows = StackLinears.of([projection.many_rows if isinstance(projection, Int8WeightOnlyLinear)
                                     else projection for projection in projections], kernels)
        return cls(model, kernels, few_rows, many_rows, INT8_KERNEL_MAX_ROWS)

    def _linears(self, rows: int) -> StackLinears | None:
        """The projections a step of ``rows`` rows runs (None: some are not compiled for so many rows)."""
        return self.few_rows if self.max_few_rows is None or rows <= self.max_few_rows else self.many_rows

    def takes(self, hidden: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              meta: AttentionMetadata) -> bool:
        """Whether this step runs here: decode rows only, with compiled projections for so many rows, over caches the
        compiled decode reads (contiguous CPU tensors in the model's dtype, or 16-bit under an fp32 model)."""
        rows = hidden.shape[0]
        key_cache, value_cache = kv_caches[0]
        return (rows > 0 and not meta.has_prefill and meta.num_decode_tokens == rows
                and self._linears(rows) is not None
                and cpu_ops.runs_compiled(hidden, key_cache, value_cache))

    def __call__(self, hidden: torch.Tensor, cos_sin: CosSin, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 meta: AttentionMetadata) -> torch.Tensor:
        """The final norm of the residual stream after every layer, ``[rows, hidden]``, as the model's layers give
        it; ``hidden`` (the embedded tokens) is summed into in place. Checks the step's slots and tables against
        the first layer's caches as the layers' first calls do (the compiled loop checks that the others are alike)."""
        rows = hidden.shape[0]
        key_cache, value_cache = kv_caches[0]
        key_like = hidden.new_empty((rows, self.num_kv_heads, self.head_dim))
        check_cache_write(key_like, key_like, key_cache, value_cache, meta.slot_mapping, meta.slot_range)
        check_decode(hidden.new_empty((rows, self.num_heads, self.head_dim)), key_cache, value_cache,
                     meta.decode_block_tables, meta.decode_context_lens, meta.decode_host)
        linears = self._linears(rows)
        assert linears is not None  # takes() said so
        return self.decode_layers(
            hidden, *cos_sin, [cache for cache, _ in kv_caches], [cache for _, cache in kv_caches],
            meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens, self.norm_weights,
            linears.tensors, linears.shapes, self.num_heads, self.num_kv_heads, self.head_dim, self.eps,
            self.scale)
