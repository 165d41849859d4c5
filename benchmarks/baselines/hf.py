"""Hugging Face transformers baselines: static padded ``generate`` and built-in continuous batching."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks.workloads import Request


def load_hf_model(folder: Path, dtype: torch.dtype) -> Any:
    """The model as transformers' ``AutoModelForCausalLM``, in eval mode on the CPU."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def _padded_batch(batch: list[Request], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input ids and attention mask of a static batch."""
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        ids[row, width - len(request.prompt_token_ids):] = torch.tensor(request.prompt_token_ids)
        mask[row, width - len(request.prompt_token_ids):] = 1
    return ids, mask


@torch.inference_mode()
def run_static(model: Any, requests: list[Request], batch_size: int, pad_id: int) -> dict[str, Any]:
    """Static batches in arrival order; each batch decodes until its longest output is done."""
    filled_slots = reserved_slots = 0
    model.generate(input_ids=torch.arange(1000, 1040)[None], max_new_tokens=4, pad_token_id=pad_id)  # warm-up
    start = time.monotonic()
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    for batch in tqdm(batches, desc="hf-static", unit="batch", leave=False):
        ids, mask = _padded_batch(batch, pad_id)
        new_tokens = max(r.output_len for r in batch)
        # min_new_tokens suppresses EOS, so every row runs the batch's full length (ignore_eos)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=pad_id)
        filled_slots += sum(r.total_len for r in batch)
        reserved_slots += len(batch) * (ids.shape[1] + new_tokens)
    elapsed = time.monotonic() - start
    output_tokens = sum(r.output_len for r in requests)
    return {
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed,
        "requests_per_s": len(requests) / elapsed,
        "mean_batch_size": len(requests) / len(batches),
        "peak_batch_size": max(len(b) for b in batches),
        # the padded [batch, prompt + new] rectangle that a static batch's KV cache spans
        "mean_kv_waste": 1 - filled_slots / reserved_slots,
        "note": "only each request's own output tokens count; rows padded to the batch's longest run",
    }


@torch.inference_mode()
def run_continuous(model: Any, requests: list[Request], num_blocks: int, block_size: int,
                   max_num_seqs: int) -> dict[str, Any]:
    """transformers' continuous batching manager with per-request output lengths and EOS disabled."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen_config = GenerationConfig(max_new_tokens=max(r.output_len for r in requests), do_sample=False,
                                  eos_token_id=-1)
    cb_config = ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks,
                                         max_requests_per_batch=max_num_seqs)
    output_tokens = 0
    start = time.monotonic()
    with model.continuous_batching_context_manager(generation_config=gen_config, continuous_batching_config=cb_config,
                                                   block=True, timeout=5) as manager:
        for index, request in enumerate(requests):
            manager.add_request(request.prompt_token_ids, request_id=str(index), max_new_tokens=request.output_len,
                                eos_token_id=-1)
        with tqdm(total=len(requests), desc="hf-continuous", unit="req", leave=False) as bar:
            for _ in range(len(requests)):
                result = manager.get_result(timeout=600)
                while result is not None and not result.is_finished():
                    result = manager.get_result(timeout=600)
                if result is None or result.error:
                    raise RuntimeError(f"continuous batching returned {result and result.error or 'no result'}")
                output_tokens += len(result.generated_tokens)
                bar.update(1)
    elapsed = time.monotonic() - start
    return {
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed,
        "requests_per_s": len(requests) / elapsed,
        "note": f"ContinuousBatchingConfig(page_size={block_size}, num_blocks={num_blocks}): the same KV budget",
    }
