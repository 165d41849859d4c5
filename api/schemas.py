"""Request and response schemas of the REST API, with the bounds every input is checked against."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from core.job_payload import JobOut
from core.models import DeliveryStatus
from core.prompts import ChatTemplateOptions
from core.sampling_fields import SAMPLING_FIELDS
from core.structured_outputs import StructuredOutputError, checked_value, only_kind, set_fields

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def is_storable(value: str) -> bool:
    """Whether every store and JSON response can hold the text: PostgreSQL's text cannot hold NUL, and no store nor
    response can hold a lone UTF-16 surrogate ("\\ud800", which JSON can spell)."""
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return "\x00" not in value


def _storable(value: str) -> str:
    # refusing what no store can hold here keeps every store's answer a 422, not a 500 after the job was stored
    if "\x00" in value:
        raise ValueError("must not contain the NUL character (\\u0000)")
    if not is_storable(value):
        raise ValueError("must be Unicode text: a lone surrogate is not")
    return value


StorableStr = Annotated[str, AfterValidator(_storable)]


def _storable_json(value: dict[str, Any]) -> dict[str, Any]:
    # a JSON object rendered into the prompt, which is stored (JSON writes NUL as an escape even unescaped)
    text = json.dumps(value, ensure_ascii=False)
    _storable(text.replace("\\u0000", "\x00"))
    return value


StorableJsonObject = Annotated[dict[StorableStr, Any], AfterValidator(_storable_json)]
MetadataValue = StorableStr | int | float | bool | None


def sampling_bounds(name: str) -> dict[str, Any]:
    """The service's bounds of sampling parameter `name` as pydantic Field arguments (ge or gt, le)."""
    bounds = SAMPLING_FIELDS[name].service
    low_bound = {"gt" if bounds.low_exclusive else "ge": bounds.low} if bounds.low is not None else {}
    return {**low_bound, "le": bounds.high}


def _sampling_field(name: str) -> Any:
    """The field of sampling parameter `name`: default and bounds as core/sampling_fields.py declares them."""
    spec = SAMPLING_FIELDS[name]
    if spec.max_items is not None:  # a list: its items are checked by the validators below
        return Field(spec.default, max_length=spec.max_items, description=spec.description)
    return Field(spec.default, **sampling_bounds(name), description=spec.description)


class StructuredOutputsIn(BaseModel):
    """vLLM's structured outputs: exactly one way to constrain the output, compiled here so that a constraint the
    engine could not use is a 422 naming its field before any job exists."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_schema: dict[str, Any] | StorableStr | bool | None = Field(
        None, alias="json", description="a JSON schema (an object, or its JSON text) the output must satisfy")
    regex: StorableStr | None = Field(None, min_length=1, max_length=65_536)
    choice: list[Annotated[StorableStr, Field(min_length=1, max_length=4096)]] | None = Field(
        None, min_length=1, max_length=1024, description="the output is exactly one of these strings")
    grammar: StorableStr | None = Field(None, min_length=1, max_length=400_000, description="Lark or GBNF")
    json_object: bool | None = Field(None, description="true: any JSON object")
    disable_any_whitespace: bool = Field(False, description="compact JSON: no whitespace between its tokens")

    @field_validator("json_schema", "regex", "choice", "grammar", "json_object")
    @classmethod
    def _usable(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or value is False:  # not set (json_object false)
            return value
        if isinstance(value, dict) and "\\u0000" in json.dumps(value):  # PostgreSQL's JSON cannot hold NUL
            raise ValueError("must not contain the NUL character (\\u0000)")
        kind = "json" if info.field_name == "json_schema" else str(info.field_name)
        try:  # its grammar is compiled when the job is built, off the event loop (a large one takes seconds)
            checked_value(kind, value)
        except StructuredOutputError as exc:
            raise ValueError(exc.reason) from None
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsIn:
        only_kind(self.model_dump(by_alias=True))
        return self

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # stored with the job as the engine takes it: the kind that is set (and the option, when on)
        return set_fields(handler(self))


# sampling fields newer than the first workers deployed; a job leaves them out when unset
ADDED_LATER = frozenset({"bad_words"})


class SamplingParamsIn(BaseModel):
    """Sampling parameters, as the engine's SamplingParams takes them."""

    model_config = _STRICT

    n: int = _sampling_field("n")
    max_tokens: int = _sampling_field("max_tokens")
    temperature: float = _sampling_field("temperature")
    top_p: float = _sampling_field("top_p")
    top_k: int = _sampling_field("top_k")
    min_p: float = _sampling_field("min_p")
    seed: int | None = _sampling_field("seed")
    stop: list[StorableStr] | None = _sampling_field("stop")
    stop_token_ids: list[int] | None = _sampling_field("stop_token_ids")
    ignore_eos: bool = _sampling_field("ignore_eos")
    skip_special_tokens: bool = _sampling_field("skip_special_tokens")
    include_stop_str_in_output: bool = _sampling_field("include_stop_str_in_output")
    min_tokens: int = _sampling_field("min_tokens")
    logprobs: int | None = _sampling_field("logprobs")
    prompt_logprobs: int | None = _sampling_field("prompt_logprobs")
    repetition_penalty: float = _sampling_field("repetition_penalty")
    presence_penalty: float = _sampling_field("presence_penalty")
    frequency_penalty: float = _sampling_field("frequency_penalty")
    beam_width: int = _sampling_field("beam_width")
    length_penalty: float = _sampling_field("length_penalty")
    logit_bias: dict[Annotated[int, Field(strict=False, ge=0)], Annotated[float, Field(ge=-100, le=100)]] | None = (
        _sampling_field("logit_bias"))  # keys come as JSON's text: "50256"
    allowed_token_ids: list[int] | None = _sampling_field("allowed_token_ids")
    bad_words: list[StorableStr] | None = _sampling_field("bad_words")
    structured_outputs: StructuredOutputsIn | None = _sampling_field("structured_outputs")


    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: list[str] | None) -> list[str] | None:
        if value and any(not 1 <= len(s) <= 256 for s in value):
            raise ValueError("each stop string must be 1 to 256 characters long")
        return value

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, value: list[str] | None) -> list[str] | None:
        if value and any(not word.strip() or len(word) > 256 for word in value):
            raise ValueError("each bad word must be 1 to 256 characters long and not blank")
        return value

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _token_ids(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if value and any(i < 0 for i in value):
            raise ValueError(f"{info.field_name} must be non-negative token ids")
        if value is not None and not value and info.field_name == "allowed_token_ids":
            raise ValueError("allowed_token_ids must name at least one token (omit it to allow all)")
        return value

    # Checks of one field against another declared before it (in info.data once valid): field validators, so that
    # the error names the field, not the body.
    @field_validator("min_tokens")
    @classmethod
    def _min_below_max(cls, value: int, info: ValidationInfo) -> int:
        max_tokens = info.data.get("max_tokens")
        if max_tokens is not None and value > max_tokens:
            raise ValueError(f"min_tokens ({value}) must not exceed max_tokens ({max_tokens})")
        return value

    @field_validator("beam_width")
    @classmethod
    def _one_sample_per_beam_search(cls, value: int, info: ValidationInfo) -> int:
        n = info.data.get("n")
        if value > 1 and n is not None and n != 1:
            raise ValueError(f"n must be 1 with beam search (beam_width best beams are returned), got n={n}")
        return value

    @field_validator("structured_outputs", "logit_bias", "allowed_token_ids", "bad_words")
    @classmethod
    def _not_with_beam_search(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("beam_width", 1) > 1:
            raise ValueError(f"{info.field_name} cannot be combined with beam search (beam_width > 1)")
        return value


class ToolCallFunctionIn(BaseModel):
    """The function a tool call named, with its arguments as JSON text."""

    model_config = _STRICT

    name: StorableStr = Field(min_length=1, max_length=256)
    arguments: StorableStr = Field(max_length=400_000)


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn."""

    model_config = _STRICT

    id: StorableStr = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunctionIn


class ChatMessage(BaseModel):
    """One chat message: an assistant turn may carry tool calls, a tool message answers one (tool_call_id)."""

    model_config = _STRICT

    role: Literal["system", "user", "assistant", "tool"]
    content: StorableStr = Field(max_length=400_000)
    name: StorableStr | None = Field(None, min_length=1, max_length=256)  # the speaker, for templates that show it
    tool_calls: list[ToolCallIn] | None = Field(None, min_length=1, max_length=128)
    tool_call_id: StorableStr | None = Field(None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not to a {self.role} message")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id belongs to tool messages, not to a {self.role} message")
        return self


class FunctionIn(BaseModel):
    """A function the model may call: its name, what it does and its parameters' JSON schema."""

    model_config = _STRICT

    name: StorableStr = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: StorableStr | None = Field(None, max_length=8192)
    parameters: StorableJsonObject | None = None


class ToolIn(BaseModel):
    """A tool definition, passed to the chat template as `tools` (as vLLM and transformers do)."""

    model_config = _STRICT

    type: Literal["function"] = "function"
    function: FunctionIn


def _not_zero(value: int) -> int:
    if value == 0:
        raise ValueError("must be a number of tokens to keep (1 or more), or -1 for as many as fit")
    return value


TruncatePromptTokens = Annotated[int, Field(ge=-1, le=131_072), AfterValidator(_not_zero)]


class JobCreate(SamplingParamsIn):
    """Body of POST /v1/jobs: a prompt or chat messages, sampling parameters and delivery options."""

    prompt: StorableStr | None = Field(None, min_length=1, max_length=400_000)
    prompt_token_ids: list[int] | None = Field(
        None, min_length=1, max_length=131_072, description="the prompt as token ids, passed to the engine as given")
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=256)
    tools: list[ToolIn] | None = Field(
        None, min_length=1, max_length=128, description="with messages: tool definitions for the chat template")
    add_generation_prompt: bool = Field(True, description="with messages: end the prompt with the assistant's turn")
    continue_final_message: bool = Field(
        False, description="with messages: leave the final message open for the model to continue "
        "(needs add_generation_prompt false)")
    chat_template_kwargs: StorableJsonObject | None = Field(
        None, max_length=64, description="with messages: extra variables for the chat template (enable_thinking...)")
    truncate_prompt_tokens: TruncatePromptTokens | None = Field(
        None, description="keep only the prompt's last N tokens (vLLM's; -1: as many as fit beside max_tokens); a "
        "chat's rendered prompt is cut alike")
    priority: int = Field(0, ge=-1000, le=1000)
    metadata: dict[StorableStr, MetadataValue] | None = Field(None, max_length=32)
    webhook_url: StorableStr | None = Field(None, min_length=1, max_length=2048)

    @model_validator(mode="after")
    def _prompt_xor_messages(self) -> JobCreate:
        if sum(value is not None for value in (self.prompt, self.prompt_token_ids, self.messages)) != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools are rendered by the chat template: give them with messages")
        options = self.chat_template_options()  # which checks them
        if self.messages is None and options != ChatTemplateOptions():
            raise ValueError("add_generation_prompt, continue_final_message and chat_template_kwargs shape how the "
                             "chat template renders messages: give them with messages")
        return self

    def chat_template_options(self) -> ChatTemplateOptions:
        """How the chat template renders this job's messages."""
        return ChatTemplateOptions.of(self)

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The tool definitions as the chat template reads them (unset fields left out)."""
        return None if self.tools is None else [tool.model_dump(exclude_none=True) for tool in self.tools]

    def sampling_params(self) -> dict[str, Any]:
        """The sampling parameters alone, as stored with the job and passed to the engine (without those added
        later that are unset: a worker from before them still runs the job, as during a rolling upgrade)."""
        params = self.model_dump(include=set(SamplingParamsIn.model_fields), by_alias=True)
        return {name: value for name, value in params.items() if value is not None or name not in ADDED_LATER}


class JobRequest(JobCreate):
    """Body of POST /v1/jobs: a job as a client asks for it, whose metadata may not use the keys the OpenAI routes
    keep there (`openai_...`: how a job answers as a chat completion or a response)."""

    @field_validator("metadata")
    @classmethod
    def _no_reserved_keys(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(key for key in value or {} if key.startswith("openai_"))
        if reserved:
            raise ValueError(f"keys beginning with 'openai_' are the server's own, got {reserved[0]!r}")
        return value


class JobBatchCreate(BaseModel):
    """Body of POST /v1/jobs/batch: jobs accepted all together or not at all."""

    model_config = _STRICT

    jobs: list[JobRequest] = Field(min_length=1, max_length=1000)


class JobList(BaseModel):
    """A page of jobs, newest first; pass next_cursor back as cursor for the next page."""

    data: list[JobOut]
    next_cursor: str | None


class JobBatchOut(BaseModel):
    """The jobs created by one batch request, in request order."""

    data: list[JobOut]


class Deleted(BaseModel):
    """OpenAI's answer to a DELETE: the id, and that it is gone; each kind names its object."""

    id: str
    deleted: bool = True


class JobDeleted(Deleted):
    """The answer to DELETE /v1/jobs/{id}, shaped as OpenAI's deletions are."""

    object: Literal["job"] = "job"


class ResponseDeleted(Deleted):
    """OpenAI's answer to DELETE /v1/responses/{id}."""

    object: Literal["response"] = "response"


class WebhookAttemptOut(BaseModel):
    """One recorded webhook attempt."""

    model_config = ConfigDict(from_attributes=True)

    attempt_number: int
    status_code: int | None
    error: str | None
    duration_ms: int
    created_at: datetime


class WebhookDeliveryOut(BaseModel):
    """A webhook delivery of a job with every attempt made."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    event: str
    url: str
    status: DeliveryStatus
    num_attempts: int
    created_at: datetime
    finished_at: datetime | None
    attempts: list[WebhookAttemptOut]
