"""Build a model from a Hugging Face folder: config, then safetensors weights fused into our layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from engine.models.cpu_decode_stack import CompiledDecodeStack
from engine.models.cpu_packing import pack_linear_layers, packed_layer_type
from engine.models.llama import FUSED_DTYPES, LlamaForCausalLM
from engine.models.quantization import quantize_linear_layers, quantize_weights_only
from paged_kernels.backend import KernelBackend

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM"}
# fused parameter -> the checkpoint's separate projections, concatenated along the output dim
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def load_config(folder: Path) -> PretrainedConfig:
    """The model's transformers config, checked to be an architecture we implement."""
    config = AutoConfig.from_pretrained(folder)
    architectures = set(getattr(config, "architectures", None) or [])
    if not architectures & SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model architecture {sorted(architectures)} is not supported; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return config


def _read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {folder} has no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return {name.removeprefix("model."): tensor for name, tensor in tensors.items()}


def _fuse(checkpoint: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    for layer in range(num_layers):
        for fused, parts in _FUSED.items():
            for suffix in ("weight", "bias"):
                names = [f"layers.{layer}.{part}.{suffix}" for part in parts]
                if all(name in checkpoint for name in names):
                    checkpoint[f"layers.{layer}.{fused}.{suffix}"] = torch.cat([checkpoint.pop(n) for n in names])
    return checkpoint


def load_model(
    folder: Path, dtype: torch.dtype, device: torch.device, ops: KernelBackend, weight_packing: str = "auto",
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """Instantiate the model on ``device`` in ``dtype`` with the folder's weights; linear layers are
    quantized as ``quantization`` says (``EngineConfig.quantization``) and the others prepacked as
    ``weight_packing`` (``EngineConfig.cpu_weight_packing``) says. With the ``cpu`` kernel backend the model's
    norms, rotary embedding and SiLU run fused too (the backend's ``fused_layer_ops``), unless ``weight_packing``
    asks for exact numerics, and where every projection runs one of our compiled kernels, decode steps run the
    layers in one compiled call (``CompiledDecodeStack``)."""
    config = load_config(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, ops)
    checkpoint = _fuse(_read_checkpoint(folder), config.num_hidden_layers)
    if model.tie_word_embeddings:
        checkpoint.pop("lm_head.weight", None)
    expected = {name for name, _ in model.named_parameters()}
    missing = expected - checkpoint.keys()
    if missing:
        raise ValueError(f"model folder {folder} lacks weights: {sorted(missing)[:5]}")
    state = {name: checkpoint[name].to(dtype) for name in expected}
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = type(model.rotary)(config, model.head_dim)  # buffers were built on meta
    model = model.to(device).eval()
    if quantization == "int8":
        quantize_linear_layers(model)
    elif quantization == "int8_weight_only":
        quantize_weights_only(model)
    layer_type = packed_layer_type(dtype, device, weight_packing)
    if layer_type is not None:
        pack_linear_layers(model, layer_type)
    if dtype in FUSED_DTYPES and weight_packing != "exact" and (layer_ops := ops.fused_layer_ops()) is not None:
        model.fuse_cpu_layer_ops(layer_ops)
        model.decode_stack = CompiledDecodeStack.for_model(model)
    return model


def eos_token_ids(folder: Path, config: PretrainedConfig, tokenizer: Any) -> set[int]:
    """Every end-of-sequence id the config, the tokenizer and ``generation_config.json`` name."""
    ids: set[int] = set()
    for source in (config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        ids.update([value] if isinstance(value, int) else value or [])
    try:
        value = GenerationConfig.from_pretrained(folder).eos_token_id
        ids.update([value] if isinstance(value, int) else value or [])
    except OSError:
        pass
    # an id past the logits (a stale config) could never be sampled, and would break suppression
    return {i for i in ids if 0 <= i < config.vocab_size}
