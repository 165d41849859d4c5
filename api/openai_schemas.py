"""OpenAI request bodies of /v1/completions and /v1/chat/completions, and how each becomes a job."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.errors import ApiError
from api.prompts import prompt_model
from api.schemas import JobCreate, MetadataValue

_OPENAI = ConfigDict(extra="forbid", allow_inf_nan=False)
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


def served_model_id() -> str:
    """The one model id this server answers to (the configured model name or path)."""
    return prompt_model().name


class StreamOptions(BaseModel):
    """Options of a streamed response."""

    model_config = _OPENAI

    include_usage: bool = False


class OpenAIRequest(BaseModel):
    """Fields shared by completions and chat completions, plus vLLM's extra sampling fields."""

    model_config = _OPENAI

    model: str = Field(min_length=1, max_length=1024)
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = Field(None, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None

    def _job(self, endpoint: str, max_tokens: int, logprobs: int | None, **prompt: Any) -> JobCreate:
        if self.model != served_model_id():
            raise ApiError(404, f"model '{self.model}' does not exist; this server serves '{served_model_id()}'",
                           "model")
        if self.stream and logprobs is not None:
            raise ApiError(400, "logprobs are not supported with stream: true; request them without streaming",
                           "logprobs")
        sampling = self.model_dump(include={
            "n", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
            "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
        })
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        metadata: dict[str, MetadataValue] = {"openai_endpoint": endpoint, "user": self.user}
        return JobCreate(**sampling, **prompt, stop=stop, max_tokens=max_tokens, logprobs=logprobs,
                         metadata=metadata)


class CompletionRequest(OpenAIRequest):
    """Body of POST /v1/completions (one prompt per request; the Batch API takes many)."""

    prompt: str | list[str]
    max_tokens: int = 16
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError(f"give one prompt per request (got {len(value)}); use the Batch API for many")
        return value

    def to_job(self) -> JobCreate:
        """The job that answers this request."""
        prompt = self.prompt[0] if isinstance(self.prompt, list) else self.prompt
        return self._job(COMPLETIONS, self.max_tokens, self.logprobs, prompt=prompt)


class TextPart(BaseModel):
    """A text part of a message's content."""

    model_config = _OPENAI

    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    """One chat message as OpenAI clients send it (content as a string or text parts)."""

    model_config = _OPENAI

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_job_message(self) -> dict[str, str]:
        """The message as the job store keeps it (developer counts as system)."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(OpenAIRequest):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def to_job(self) -> JobCreate:
        """The job that answers this request; without a token limit it may fill the rest of the context."""
        messages = [m.as_job_message() for m in self.messages]
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        max_tokens = limit if limit is not None else self._rest_of_context(messages)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._job(CHAT_COMPLETIONS, max_tokens, logprobs, messages=messages)

    def _rest_of_context(self, messages: list[dict[str, str]]) -> int:
        model = prompt_model()
        try:
            num_prompt_tokens = model.count_tokens(model.render_chat(messages))
        except ValueError as exc:
            raise ApiError(400, str(exc), "messages") from exc
        return max(1, model.max_model_len - num_prompt_tokens)


REQUEST_SCHEMAS: dict[str, type[CompletionRequest] | type[ChatCompletionRequest]] = {
    COMPLETIONS: CompletionRequest,
    CHAT_COMPLETIONS: ChatCompletionRequest,
}
