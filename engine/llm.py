"""The offline API: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Batch generation over a paged engine; every argument is an ``EngineConfig`` field."""

    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer."""
        return self.engine.tokenizer

    def generate(
        self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True, priorities: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); one output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(
                f"sampling_params must be one object or one per prompt ({len(prompts)}), got {len(params_list)}"
            )
        priorities = list(priorities) if priorities is not None else [0] * len(prompts)
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p, priority in zip(ids, prompts, params_list, priorities):
                self.engine.add_request(request_id, prompt, p, priority)
        except ValueError:
            for request_id in ids:
                self.engine.abort_request(request_id)
            self.engine.step()  # flush the aborted outputs
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm or len(ids) < 2) as bar:
            while len(finished) < len(ids):
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in ids]

    def beam_search(
        self, prompts: Prompt | Seq[Prompt], beam_width: int, max_tokens: int, length_penalty: float = 1.0,
        ignore_eos: bool = False, use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Beam search per prompt; ``outputs`` holds the ``beam_width`` best beams, best first."""
        params = SamplingParams(
            beam_width=beam_width, max_tokens=max_tokens, length_penalty=length_penalty,
            temperature=0.0, ignore_eos=ignore_eos,
        )
        return self.generate(prompts, params, use_tqdm)

    def chat(
        self, messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.encode_chat(conversation) for conversation in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    def encode_chat(self, messages: list[Message]) -> list[int]:
        """Token ids of a conversation rendered with the chat template, ready for the reply."""
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stats(self) -> Any:
        """The engine's ``EngineStats`` right now."""
        return self.engine.stats()
