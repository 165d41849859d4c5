"""The long-lived engine: add requests, step the batch, get outputs; used by ``LLM`` and workers."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.bad_words import bad_words_token_ids
from engine.block_manager import BlockManager
from engine.cache_engine import CacheEngine, blocks_in_budget, default_kv_cache_bytes, kv_block_bytes
from engine.config import EngineConfig, resolve_dtype
from engine.cuda_graphs import capture_decode_graphs, uses_cuda_graphs
from engine.detokenizer import start_offsets
from engine.fault_isolation import FaultIsolator, StepFunctions
from engine.kernel_warmup import compile_attention_kernels
from engine.model_files import resolve_model
from engine.model_runner import ModelRunner
from engine.models.llama import kv_heads_and_head_dim
from engine.models.loader import eos_token_ids, load_config, load_model
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.prompt_logprobs import record as record_prompt_logprobs
from engine.request_validation import ModelLimits, validate_request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import SequenceGroup
from engine.stats import EngineStats, snapshot
from engine.step_sampler import StepSampler
from engine.structured_output import GrammarCompiler
from paged_kernels import select_backend

logger = logging.getLogger(__name__)

GPU_TOKEN_BUDGET = 2048  # vLLM's
# a CPU's: a 2,048-token prefill step stalls every running sequence for seconds (3.3 s for SmolLM2 on 2 AVX2 cores),
# while 256-token steps keep the throughput and let a burst's prompts finish (and stream) one after another
# (benchmarks.token_budget; BENCHMARKS.md, thirty-first session)
CPU_TOKEN_BUDGET = 256

StepObserver = Callable[[SchedulerOutput], None]


def default_token_budget(device: torch.device, chunked_prefill: bool, max_model_len: int) -> int:
    """The tokens one step computes when ``max_num_batched_tokens`` is unset: GPU_TOKEN_BUDGET on CUDA,
    CPU_TOKEN_BUDGET elsewhere; without chunked prefill a prompt is computed whole, so the budget holds the longest
    one (vLLM's rule), and short steps would gain nothing."""
    if not chunked_prefill:
        return max(GPU_TOKEN_BUDGET, max_model_len)
    return GPU_TOKEN_BUDGET if device.type == "cuda" else CPU_TOKEN_BUDGET


def check_kv_cache_budget(config: EngineConfig, folder: Path) -> None:
    """Fail as the engine would when ``config.kv_cache_memory`` holds fewer than two KV blocks of the model in
    ``folder``, from its config.json alone (no weights loaded), so that a service can refuse it before serving.
    The default budget is left to the engine: on CUDA it depends on what the weights leave."""
    if config.kv_cache_memory is None:
        return
    model_config = load_config(folder)
    num_kv_heads, head_dim = kv_heads_and_head_dim(model_config)
    block_bytes = kv_block_bytes(model_config.num_hidden_layers, config.block_size, num_kv_heads, head_dim,
                                 config.kv_cache_torch_dtype())
    blocks_in_budget(int(config.kv_cache_memory), block_bytes)


class LLMEngine:
    """Holds the model, the paged KV cache and the scheduler; each ``step`` runs one batch."""

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = config.torch_device()
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_cache_dtype = config.kv_cache_torch_dtype()
        self.ops = select_backend(self.device, config.attention_backend)
        folder = resolve_model(config.model)
        self.model_name = config.model
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or folder)
        self.model = load_model(
            folder, self.dtype, self.device, self.ops, config.cpu_weight_packing, config.quantization)
        model_config = self.model.config
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.eos_token_ids = eos_token_ids(folder, model_config, tokenizer)
        self._init_cache()
        self.limits = ModelLimits(
            vocab_size=model_config.vocab_size, max_model_len=self.max_model_len, block_size=config.block_size,
            max_kv_blocks=self.num_gpu_blocks - self.block_manager.watermark_blocks, max_num_seqs=config.max_num_seqs,
            eos_token_ids=frozenset(self.eos_token_ids),
        )
        token_budget = config.max_num_batched_tokens or default_token_budget(
            self.device, config.enable_chunked_prefill, self.max_model_len)
        self.scheduler = Scheduler(config, self.block_manager, max(token_budget, config.max_num_seqs))
        if self.ops.compiles_on_first_launch():  # every attention variant compiles now, not in a request's step
            attention = self.model.layers[0].self_attn
            compile_attention_kernels(self.ops, self.cache, attention.num_heads, attention.head_dim,
                                      min(self.scheduler.token_budget, self.max_model_len), self.max_model_len)
        graphs = None
        if uses_cuda_graphs(self.device, config.enforce_eager):  # after the KV cache: graphs take what is left
            max_blocks_per_seq = -(-self.max_model_len // config.block_size)
            graphs = capture_decode_graphs(self.model, self.cache, self.ops, max_blocks_per_seq,
                                           min(config.cuda_graph_max_batch, config.max_num_seqs))
        self.runner = ModelRunner(self.model, self.cache, config.block_size, self.device, graphs)
        self.sampler = StepSampler(self.eos_token_ids, self.ops.fused_layer_ops())
        self.grammars = GrammarCompiler(tokenizer, model_config.vocab_size, self.eos_token_ids)
        self.output_processor = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len)
        self.groups = self.output_processor.groups  # live requests by id
        self.isolator = FaultIsolator(self.scheduler)
        # called with every step's SchedulerOutput, right after scheduling (benchmarks sample the cache here)
        self.step_observers: list[StepObserver] = []
        self.generator = torch.Generator().manual_seed(config.seed)
        self.num_steps = 0
        self._aborted: list[SequenceGroup] = []
        logger.info(
            "engine ready: model=%s dtype=%s kv_cache_dtype=%s device=%s blocks=%d cpu_blocks=%d block_size=%d "
            "max_num_seqs=%d max_num_batched_tokens=%d decode graphs=%s",
            self.model_name, self.dtype, self.kv_cache_dtype, self.device, self.num_gpu_blocks, self.num_cpu_blocks,
            config.block_size, config.max_num_seqs, self.scheduler.token_budget,
            graphs.sizes if graphs else "off",
        )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        """Build an engine from ``EngineConfig`` keyword arguments."""
        return cls(EngineConfig(**kwargs))

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (the output processor's, which detokenizes with it)."""
        return self.output_processor.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self.output_processor.tokenizer = tokenizer

    def _init_cache(self) -> None:
        cfg = self.config
        model = self.model
        block_bytes = kv_block_bytes(len(model.layers), cfg.block_size, model.num_kv_heads, model.head_dim,
                                     self.kv_cache_dtype)
        budget = cfg.kv_cache_memory
        if budget is None:
            budget = default_kv_cache_bytes(self.device, cfg.gpu_memory_utilization)
        self.num_gpu_blocks = blocks_in_budget(int(budget), block_bytes)
        self.num_cpu_blocks = int(cfg.swap_space) // block_bytes
        self.block_manager = BlockManager(
            cfg.block_size, self.num_gpu_blocks, self.num_cpu_blocks, cfg.watermark, cfg.enable_prefix_caching
        )
        self.cache = CacheEngine(
            len(model.layers), self.num_gpu_blocks, self.num_cpu_blocks, cfg.block_size,
            model.num_kv_heads, model.head_dim, self.kv_cache_dtype, self.device,
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
        grammar = None if params.structured_outputs is None else self.grammars.start(params.structured_outputs)
        group = SequenceGroup.create(request_id, text, token_ids, params, priority, grammar)
        group.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words, self.limits.vocab_size)
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
        """True while any request is waiting, running or swapped out, or an aborted one's last output is still to
        come from ``step``."""
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def num_running(self) -> int:
        """Sequences running now: ``stats().num_running`` without the rest of the snapshot."""
        return len(self.scheduler.running_seqs())

    # ---- stepping ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule → run → update → output: the outputs of the requests that changed (aborted ones included).
        A request that makes the step raise fails alone (finish_reason "error"); the others go on."""
        touched, self._aborted = self._aborted, []
        touched += self.isolator.step(StepFunctions(self._schedule, self._run))  # more than once while isolating
        return self.output_processor.make_outputs(touched)

    def _schedule(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        for observe in self.step_observers:
            observe(out)
        # swap-out before swap-in and copies: a block freed by swap-out may be refilled below
        self.cache.swap_out(out.blocks_to_swap_out)
        self.cache.swap_in(out.blocks_to_swap_in)
        self.cache.copy(out.blocks_to_copy)
        return out

    def _run(self, out: SchedulerOutput) -> None:
        self.num_steps += 1
        logits, sampled, prompt_logprobs = self.runner.execute(out)
        record_prompt_logprobs(prompt_logprobs)
        self.scheduler.update_from_output(out, self.sampler.sample(logits, sampled),
                                          self.output_processor.finish_reason)

    # ---- observability -------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Cache usage and waste, queue sizes and cumulative counters right now."""
        return snapshot(self.scheduler, self.block_manager, self.num_steps)
