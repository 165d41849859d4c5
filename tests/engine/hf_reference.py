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


def hf_beam(folder: Path, prompt: str, beam_width: int, max_tokens: int) -> list[int]:
    """The best beam of a beam search of exactly ``max_tokens`` tokens, eos disabled."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), num_beams=beam_width, do_sample=False,
            max_new_tokens=max_tokens, min_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0,
            early_stopping=False, length_penalty=1.0,
        )
    return out[0, ids.shape[1] :].tolist()


def hf_logprobs(folder: Path, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """Log-softmax of the model's next-token logits at each generated position ``[len(out), vocab]``."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.inference_mode():
        logits = model(ids).logits[0]
    start = len(prompt_ids) - 1
    return logits[start : start + len(output_ids)].float().log_softmax(-1)
