"""Reference generations from Hugging Face transformers on the same weights (fp32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList


def hf_greedy(
    folder: Path, prompts: list[str], max_tokens: int, logits_processor: Any = None, **generate_kwargs: Any
) -> list[list[int]]:
    """Greedy continuations, one prompt at a time (no padding), eos disabled."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    results = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                do_sample=False, pad_token_id=0,
                logits_processor=LogitsProcessorList([logits_processor] if logits_processor else []),
                **generate_kwargs,
            )
        results.append(out[0, ids.shape[1] :].tolist())
    return results


def hf_logprobs(folder: Path, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """Log-softmax of the model's next-token logits at each generated position ``[len(out), vocab]``."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.inference_mode():
        logits = model(ids).logits[0]
    start = len(prompt_ids) - 1
    return logits[start : start + len(output_ids)].float().log_softmax(-1)
