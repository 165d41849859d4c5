"""Checks a request against the loaded model before it can reach a shared engine step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from engine.utils import cdiv


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """The model- and cache-derived bounds every request must respect (mirrored by the API)."""

    # rows of the embedding table = width of the logits: model config.json's ``vocab_size``,
    # which may be larger than the tokenizer's vocabulary (padded)
    vocab_size: int
    max_model_len: int
    block_size: int
    # device blocks one request may ever hold (the watermark stays free)
    max_kv_blocks: int
    # sequences one engine step runs: a request's samples or beams must fit in one step together
    max_num_seqs: int
    # the model's end-of-sequence tokens, which min_tokens holds back like stop_token_ids
    eos_token_ids: frozenset[int] = frozenset()

    def kv_blocks_needed(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Blocks a request needs at worst: its prompt plus every sample or beam at full length."""
        per_seq = cdiv(params.max_tokens, self.block_size) + 1
        return cdiv(num_prompt_tokens, self.block_size) + max(params.n, params.beam_width) * per_seq


def _check_token_ids(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{field} must be token ids in [0, {vocab_size}), got {bad}")


def validate_request(prompt_token_ids: Sequence[int], params: SamplingParams, limits: ModelLimits) -> None:
    """Raise ``ValueError`` naming the argument unless the request can run on this model and cache."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise ValueError("prompt must not be empty")
    _check_token_ids("prompt", prompt_token_ids, limits.vocab_size)
    _check_token_ids("stop_token_ids", params.stop_token_ids, limits.vocab_size)
    _check_token_ids("logit_bias", list(params.logit_bias or {}), limits.vocab_size)
    _check_token_ids("allowed_token_ids", params.allowed_token_ids or [], limits.vocab_size)
    if params.min_tokens and params.allowed_token_ids is not None:
        held_back = set(params.stop_token_ids) | (set() if params.ignore_eos else limits.eos_token_ids)
        if set(params.allowed_token_ids) <= held_back:
            raise ValueError(f"allowed_token_ids holds only stop tokens (EOS or stop_token_ids), which min_tokens "
                             f"({params.min_tokens}) holds back: no token could be sampled")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limits.vocab_size:
            raise ValueError(f"{name} must be at most the vocabulary size {limits.vocab_size}, got {value}")
    if num_prompt + params.max_tokens > limits.max_model_len:
        raise ValueError(
            f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
            f"context of {limits.max_model_len} tokens"
        )
    for name in ("n", "beam_width"):
        value = getattr(params, name)
        if value > limits.max_num_seqs:
            raise ValueError(f"{name} ({value}) exceeds max_num_seqs ({limits.max_num_seqs}), the most sequences one "
                             "engine step runs: its sequences run together")
    worst_case = limits.kv_blocks_needed(num_prompt, params)
    if worst_case > limits.max_kv_blocks:
        raise ValueError(
            f"request needs up to {worst_case} KV blocks but kv_cache_memory holds {limits.max_kv_blocks}; "
            "raise kv_cache_memory or lower max_tokens / n / beam_width"
        )
