"""The long-lived engine: add requests, step the batch, get outputs; used by ``LLM`` and workers."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from engine.beam_search import beam_step
from engine.block_manager import BlockManager
from engine.cache_engine import CacheEngine, default_kv_cache_bytes, kv_block_bytes
from engine.config import EngineConfig, resolve_dtype
from engine.detokenizer import decode_new_text, find_stop_string, start_offsets
from engine.fault_isolation import FaultIsolator
from engine.model_files import resolve_model
from engine.model_runner import ModelRunner
from engine.models.loader import load_model
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.request_validation import ModelLimits, validate_request
from engine.sampler import SamplingRow, sample
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.stats import EngineStats
from kernels import select_backend

logger = logging.getLogger(__name__)

DEFAULT_TOKEN_BUDGET = 2048


class LLMEngine:
    """Holds the model, the paged KV cache and the scheduler; each ``step`` runs one batch."""

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer, GenerationConfig

        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = config.torch_device()
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.ops = select_backend(self.device, config.attention_backend)
        folder = resolve_model(config.model)
        self.model_name = config.model
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or folder)
        self.model = load_model(
            folder, self.dtype, self.device, self.ops, config.cpu_weight_packing, config.quantization)
        model_config = self.model.config
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.eos_token_ids = self._eos_token_ids(folder, GenerationConfig)
        self._init_cache()
        self.limits = ModelLimits(
            vocab_size=model_config.vocab_size, max_model_len=self.max_model_len, block_size=config.block_size,
            max_kv_blocks=self.num_gpu_blocks - self.block_manager.watermark_blocks,
        )
        token_budget = config.max_num_batched_tokens or (
            DEFAULT_TOKEN_BUDGET if config.enable_chunked_prefill else max(DEFAULT_TOKEN_BUDGET, self.max_model_len)
        )
        self.scheduler = Scheduler(config, self.block_manager, max(token_budget, config.max_num_seqs))
        self.runner = ModelRunner(self.model, self.cache, self.block_manager, self.device)
        self.isolator = FaultIsolator(self.scheduler, self._schedule, self._execute)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.groups: dict[str, SequenceGroup] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_steps = 0
        self._aborted: list[SequenceGroup] = []
        logger.info(
            "engine ready: model=%s dtype=%s device=%s blocks=%d cpu_blocks=%d block_size=%d",
            self.model_name, self.dtype, self.device, self.num_gpu_blocks, self.num_cpu_blocks, config.block_size,
        )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        """Build an engine from ``EngineConfig`` keyword arguments."""
        return cls(EngineConfig(**kwargs))

    def _eos_token_ids(self, folder: Any, generation_config_cls: Any) -> set[int]:
        ids: set[int] = set()
        for source in (self.model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            ids.update([value] if isinstance(value, int) else value or [])
        try:
            value = generation_config_cls.from_pretrained(folder).eos_token_id
            ids.update([value] if isinstance(value, int) else value or [])
        except OSError:
            pass
        # an id past the logits (a stale config) could never be sampled, and would break suppression
        return {i for i in ids if 0 <= i < self.model.config.vocab_size}

    def _init_cache(self) -> None:
        cfg = self.config
        model = self.model
        block_bytes = kv_block_bytes(len(model.layers), cfg.block_size, model.num_kv_heads, model.head_dim, self.dtype)
        budget = cfg.kv_cache_memory
        if budget is None:
            budget = default_kv_cache_bytes(self.device, cfg.gpu_memory_utilization)
        self.num_gpu_blocks = int(budget) // block_bytes
        self.num_cpu_blocks = int(cfg.swap_space) // block_bytes
        if self.num_gpu_blocks < 2:
            raise ValueError(
                f"kv_cache_memory of {budget} bytes holds {self.num_gpu_blocks} blocks of {block_bytes} bytes; "
                "at least 2 are needed"
            )
        self.block_manager = BlockManager(
            cfg.block_size, self.num_gpu_blocks, self.num_cpu_blocks, cfg.watermark, cfg.enable_prefix_caching
        )
        self.cache = CacheEngine(
            len(model.layers), self.num_gpu_blocks, self.num_cpu_blocks, cfg.block_size,
            model.num_kv_heads, model.head_dim, self.dtype, self.device,
        )

    # ---- requests ------------------------------------------------------------------
    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise ValueError("prompt must be a string or a list of token ids")
        return None, list(prompt)

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, priority: int = 0,
    ) -> None:
        """Queue a request; raises ``ValueError`` on bad input or a request that can never fit."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):  # queues are ordered by it
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        validate_request(token_ids, params, self.limits)
        group = SequenceGroup.create(request_id, text, token_ids, params, priority)
        if group.generator is None:
            group.generator = self.generator
        start_offsets(group.seqs[0])
        self.groups[request_id] = group
        self.scheduler.add(group)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; its last output reports ``abort``."""
        group = self.groups.get(request_id)
        if group is None or group.is_finished:
            return
        self.scheduler.remove(group)
        group.finish("abort", time.monotonic())
        self._aborted.append(group)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or swapped out."""
        return self.scheduler.has_unfinished()

    # ---- stepping ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, move blocks, run the model once, sample; outputs of requests that changed.
        A request that makes the step raise fails alone (finish_reason "error"); the others go on."""
        touched = {group.request_id: group for group in self._aborted}
        self._aborted = []
        touched.update((group.request_id, group) for group in self.isolator.step())
        return [self._output(group) for group in touched.values()]

    def _schedule(self) -> list[ScheduledSeq]:
        out = self.scheduler.schedule()
        # swap-out before swap-in and copies: a block freed by swap-out may be refilled below
        self.cache.swap_out(out.blocks_to_swap_out)
        self.cache.swap_in(out.blocks_to_swap_in)
        self.cache.copy(out.blocks_to_copy)
        return out.scheduled

    def _execute(self, scheduled: list[ScheduledSeq]) -> None:
        self.num_steps += 1
        logits, sampled = self.runner.execute(scheduled)
        now = time.monotonic()
        for item in scheduled:
            seq = item.seq
            self.prompt_tokens += max(0, min(seq.prompt_len, seq.num_computed_tokens + item.num_new_tokens)
                                      - seq.num_computed_tokens)
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.register_computed_blocks(seq)
            if item.group.first_scheduled_time is None:
                item.group.first_scheduled_time = now
        self._append_samples(logits, sampled)

    def _sampling_row(self, group: SequenceGroup, seq: Sequence) -> SamplingRow:
        params = group.params
        suppressed: list[int] = []
        if seq.num_output_tokens < params.min_tokens:
            suppressed = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_token_ids))
        return SamplingRow(params, seq.generator or group.generator, seq.token_ids, seq.prompt_len, suppressed)

    def _append_samples(self, logits: torch.Tensor, sampled: list[ScheduledSeq]) -> None:
        row_of_logits: list[int] = []
        targets: list[tuple[SequenceGroup, Sequence]] = []
        beam_rows: dict[str, list[int]] = {}
        for i, item in enumerate(sampled):
            group, seq = item.group, item.seq
            if group.params.is_beam_search:
                beam_rows.setdefault(group.request_id, []).append(i)
                continue
            seqs = [seq]
            if group.awaits_fork:  # the prompt is computed once; n samples share its blocks
                for _ in range(group.params.n - 1):
                    child = group.add_sample(seq)
                    self.block_manager.fork(seq, child)
                    seqs.append(child)
            for target in seqs:
                row_of_logits.append(i)
                targets.append((group, target))
        now = time.monotonic()
        for rows_of_group in beam_rows.values():
            group = sampled[rows_of_group[0]].group
            pending = group.pending_beam_logits
            pending.update((sampled[i].seq.seq_id, logits[i]) for i in rows_of_group)
            beams = group.seqs_with_status(SequenceStatus.RUNNING)
            if len(pending) < len(beams):  # after a recompute, beams may catch up in different steps
                continue
            beam_logits = torch.stack([pending.pop(beam.seq_id) for beam in beams])
            self._advance_beams(group, beams, beam_logits, now)
        if not targets:
            return
        rows = [self._sampling_row(group, seq) for group, seq in targets]
        forked = row_of_logits != list(range(len(sampled)))
        results = sample(logits[row_of_logits] if forked else logits, rows)
        for (group, seq), result in zip(targets, results):
            self._append_token(group, seq, result.token_id, result.logprobs, now)

    def _advance_beams(self, group: SequenceGroup, beams: list[Sequence], logits: torch.Tensor, now: float) -> None:
        """One beam-search step: fork kept beams (sharing blocks), drop the rest, record hypotheses."""
        params = group.params
        eos = set() if params.ignore_eos else self.eos_token_ids
        result = beam_step(beams, logits, params.beam_width, params.max_tokens, params.length_penalty,
                           eos, group.beam_hypotheses)
        group.beam_hypotheses += result.finished
        self.generation_tokens += len(result.choices)
        if group.first_token_time is None:
            group.first_token_time = now
        children: dict[int, list] = {}
        for choice in result.choices:
            children.setdefault(choice.parent, []).append(choice)
        kept: list[Sequence] = []
        for index, beam in enumerate(beams):
            extensions = [] if result.done else children.get(index, [])
            if not extensions:  # a dropped beam frees only the blocks it alone held
                beam.status = SequenceStatus.FINISHED
                self.scheduler.free_seq(beam)
                continue
            forks = [beam.fork() for _ in extensions[1:]]
            for fork in forks:
                self.block_manager.fork(beam, fork)
            for seq, choice in zip([beam, *forks], extensions):
                seq.token_ids.append(choice.token_id)
                seq.cumulative_logprob = choice.cumulative_logprob
                kept.append(seq)
        group.seqs = kept
        if result.done:
            group.finished_time = now
            self.scheduler.running.remove(group)

    def _append_token(
        self, group: SequenceGroup, seq: Sequence, token: int, logprobs: dict[int, float] | None, now: float
    ) -> None:
        seq.token_ids.append(token)
        self.generation_tokens += 1
        if group.first_token_time is None:
            group.first_token_time = now
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token]
        reason = self._finish_reason(group, seq, token)
        if reason is None:
            return
        if reason != "stop_string":
            decode_new_text(self.tokenizer, seq, final=True)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "stop" if reason == "stop_string" else reason
        self.scheduler.free_seq(seq)
        if group.is_finished:
            group.finished_time = now
            self.scheduler.running.remove(group)

    def _finish_reason(self, group: SequenceGroup, seq: Sequence, token: int) -> str | None:
        params = group.params
        may_stop = seq.num_output_tokens >= params.min_tokens
        if may_stop and (token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)):
            return "stop"
        delta = decode_new_text(self.tokenizer, seq)
        if may_stop and params.stop and delta:
            index = find_stop_string(seq.text, len(delta), params.stop)
            if index is not None:
                seq.text = seq.text[:index]
                return "stop_string"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _beam_outputs(self, group: SequenceGroup) -> list[CompletionOutput]:
        ranked = sorted(group.beam_hypotheses, key=lambda h: h.score, reverse=True)[: group.params.beam_width]
        return [
            CompletionOutput(
                index=i, text=self.tokenizer.decode(h.token_ids, skip_special_tokens=True), token_ids=h.token_ids,
                finish_reason=h.finish_reason, cumulative_logprob=h.cumulative_logprob,
            )
            for i, h in enumerate(ranked)
        ]

    def _output(self, group: SequenceGroup) -> RequestOutput:
        if group.params.is_beam_search:  # beams reorder every step: report them once, when final
            return self._request_output(group, self._beam_outputs(group) if group.is_finished else [])
        want_logprobs = group.params.logprobs is not None
        outputs = [
            CompletionOutput(
                index=i, text=seq.text, token_ids=seq.output_token_ids, finish_reason=seq.finish_reason,
                logprobs=list(seq.logprobs) if want_logprobs else None, cumulative_logprob=seq.cumulative_logprob,
            )
            for i, seq in enumerate(group.seqs)
        ]
        return self._request_output(group, outputs)

    def _request_output(self, group: SequenceGroup, outputs: list[CompletionOutput]) -> RequestOutput:
        finished = group.is_finished
        if finished:
            self.groups.pop(group.request_id, None)
        metrics = RequestMetrics(
            group.arrival_time, group.first_scheduled_time, group.first_token_time, group.finished_time)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, finished, metrics,
                             error=group.error)

    # ---- observability -------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Cache usage and waste, queue sizes and cumulative counters right now."""
        scheduler, manager = self.scheduler, self.block_manager
        running = [seq for group in scheduler.running for seq in group.seqs_with_status(SequenceStatus.RUNNING)]
        usage = manager.usage(running)
        slots = usage.num_used_blocks * self.config.block_size
        counters = scheduler.counters
        num_free_cpu = manager.cpu.num_free_blocks
        return EngineStats(
            num_total_blocks=self.num_gpu_blocks,
            num_free_blocks=manager.num_free_gpu_blocks,
            num_cached_blocks=usage.num_cached_free_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
            num_free_cpu_blocks=num_free_cpu,
            block_size=self.config.block_size,
            kv_cache_usage=usage.num_used_blocks / self.num_gpu_blocks,
            cpu_cache_usage=(1 - num_free_cpu / self.num_cpu_blocks) if self.num_cpu_blocks else 0.0,
            kv_cache_waste_ratio=(1 - usage.num_filled_slots / slots) if slots else 0.0,
            num_running=len(running),
            num_waiting=sum(len(g.unfinished_seqs) for g in scheduler.waiting),
            num_swapped=sum(len(g.unfinished_seqs) for g in scheduler.swapped),
            num_preemptions=counters.num_preemptions,
            num_preemptions_swap=counters.num_preemptions_swap,
            num_preemptions_recompute=counters.num_preemptions_recompute,
            num_blocks_swapped_out=counters.num_blocks_swapped_out,
            num_blocks_swapped_in=counters.num_blocks_swapped_in,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            prefix_cache_queries=manager.num_prefix_queries,
            prefix_cache_hits=manager.num_prefix_hits,
            num_steps=self.num_steps,
        )
