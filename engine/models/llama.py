"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral-style) over a paged KV cache."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.attention import AttentionMetadata, PagedAttention
from engine.models.rotary import RotaryEmbedding, apply_rotary
from paged_kernels.backend import KernelBackend

if TYPE_CHECKING:
    from engine.models.cpu_decode_stack import CompiledDecodeStack

CosSin = tuple[torch.Tensor, torch.Tensor]
# what paged_kernels/csrc/layer_ops_cpu.cpp takes
FUSED_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as the reference implementation does, of the residual stream
    after adding a block's output to it."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused_ops: ModuleType | None = None  # the CPU's compiled layer ops (fuse_cpu_layer_ops)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm of ``residual + hidden`` (of ``hidden`` without a residual) and that sum, the new residual."""
        if self.fused_ops is not None:
            residual_sum = hidden if residual is None else residual  # summed in place: the step owns both
            added = hidden[:0] if residual is None else hidden
            return self.fused_ops.add_rms_norm_(added, residual_sum, self.weight, self.eps), residual_sum
        residual_sum = hidden if residual is None else residual + hidden
        dtype = residual_sum.dtype
        hidden32 = residual_sum.float()
        variance = hidden32.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden32 * torch.rsqrt(variance + self.eps)).to(dtype), residual_sum


def kv_heads_and_head_dim(config: PretrainedConfig) -> tuple[int, int]:
    """The key/value heads and the head size of a Llama-style config (what one token's KV takes per layer)."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    return num_kv_heads, getattr(config, "head_dim", None) or config.hidden_size // num_heads


class LlamaAttention(nn.Module):
    """Fused QKV projection, rotary embedding and paged attention."""

    def __init__(self, config: PretrainedConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads, self.head_dim = kv_heads_and_head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, ops)
        self.fused_ops: ModuleType | None = None  # the CPU's compiled layer ops (fuse_cpu_layer_ops)

    def forward(
        self, hidden: torch.Tensor, cos_sin: CosSin,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.fused_ops is not None:
            self.fused_ops.rotary_(q, k, *cos_sin)
        else:
            q, k = apply_rotary(q, k, cos_sin)
        out = self.attn(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with a fused gate/up projection."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.fused_ops: ModuleType | None = None  # the CPU's compiled layer ops (fuse_cpu_layer_ops)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fused_ops is not None:
            return self.down_proj(self.fused_ops.silu_and_mul(self.gate_up_proj(hidden)))
        gate, up = self.gate_up_proj(hidden).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections."""

    def __init__(self, config: PretrainedConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, ops)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin: CosSin,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP's output and the residual stream before it is added (the next norm adds it, as vLLM's
        layers do, so that a fused add + norm can run there)."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos_sin, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """The whole decoder: embeddings, layers, final norm and (possibly tied) LM head."""

    def __init__(self, config: PretrainedConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, ops) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # a tied head reads the embedding matrix (None here), unless packing gave it a copy
        self.lm_head: nn.Module | None = None
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        attn = self.layers[0].self_attn
        self.rotary = RotaryEmbedding(config, attn.head_dim)
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.fused_ops: ModuleType | None = None  # the CPU's compiled layer ops (fuse_cpu_layer_ops)
        # the layers as one compiled call for decode steps (set by the loader where it applies)
        self.decode_stack: CompiledDecodeStack | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` for the flattened batch."""
        hidden = self.embed_tokens(input_ids)
        # the fused rotary reads fp32 cos/sin whatever the model's dtype, and rounds each result once
        cos_sin = self.rotary.table(positions, hidden.dtype if self.fused_ops is None else torch.float32)
        if self.decode_stack is not None and self.decode_stack.takes(hidden, kv_caches, meta):
            return self.decode_stack(hidden, cos_sin, kv_caches, meta)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, cos_sin, kv_cache, meta)
        return self.norm(hidden, residual)[0]

    def fuse_cpu_layer_ops(self, fused_ops: ModuleType) -> None:
        """Run the norms (with the residual adds), the rotary embedding and the MLP's SiLU through the CPU's compiled
        layer ops (``paged_kernels.cpu_extension``): fp32, bf16 or fp16 models on the CPU, not token-exact with
        transformers (the norm sums in another order, and reduced precision rounds once per result
        instead of per op)."""
        weight = self.embed_tokens.weight
        if weight.dtype not in FUSED_DTYPES or weight.device.type != "cpu":
            raise ValueError(f"the CPU's fused layer ops run {sorted(map(str, FUSED_DTYPES))} models on the CPU "
                             f"only, not {weight.dtype} on {weight.device}")
        self.fused_ops = fused_ops
        for module in self.modules():
            if isinstance(module, RMSNorm | LlamaAttention | LlamaMLP):
                module.fused_ops = fused_ops

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[rows, vocab]`` for the selected hidden states."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()
