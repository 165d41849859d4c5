"""OpenAI request bodies of /v1/completions and /v1/chat/completions, and how each becomes a job."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from api.errors import ApiError
from api.prompts import prompt_model
from api.schemas import (
    JobCreate,
    MetadataValue,
    StorableStr,
    StructuredOutputsIn,
    TruncatePromptTokens,
    sampling_bounds,
)
from core.openai_responses import CHAT_COMPLETIONS, COMPLETIONS, served_model_names
from core.prompts import ChatTemplateOptions, PromptFieldError
from core.settings import get_settings
from core.structured_outputs import KINDS
from core.tool_calls import AUTO_PREFIX, NAMED_PREFIX, REQUIRED, call_schema
from core.tool_parsers import TOOL_CALL_PARSERS

# Unknown fields (vLLM's extras, newer OpenAI ones) are kept aside and ignored with a warning, as vLLM does.
_OPENAI = ConfigDict(extra="allow", allow_inf_nan=False)
MAX_PROMPTS = 64


def check_served_model(model: str) -> None:
    """OpenAI's 404 model_not_found unless `model` is one of the served names."""
    if model not in served_model_names():
        served = ", ".join(f"'{name}'" for name in served_model_names())
        raise ApiError(404, f"model '{model}' does not exist; this server serves {served}", "model")


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the fields a request carried that no schema here declares, nested ones included."""
    names = [prefix + name for name in model.model_extra or {}]
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            names += ignored_fields(value, f"{prefix}{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    names += ignored_fields(item, f"{prefix}{name}.{i}.")
    return names


def bounded_as(job_field: str) -> Any:
    """An optional OpenAI field bounded as the job field it becomes, so that its error names the OpenAI field."""
    return Field(None, **sampling_bounds(job_field))


_JOB_FIELD = re.compile(r"(?:jobs\.(\d+)\.)?(.+)")  # a job field, prefixed with its index in a batch of jobs


def openai_named(error: ApiError, sent_as: dict[str, str] | None = None) -> ApiError:
    """A job's creation error with the field named as the OpenAI request names it: a prompt given as text or ids is
    `prompt`, prompt i of several `prompt.i`; the other fields are the request's own, shared by every prompt, under
    the name the client used (`sent_as`: job field -> request field)."""
    match = _JOB_FIELD.fullmatch(error.field or "")
    if match is None:
        return error
    index, name = match.groups()
    if name in ("prompt", "prompt_token_ids"):
        name = "prompt" if index is None else f"prompt.{index}"
    name = (sent_as or {}).get(name, name)
    return ApiError(error.status_code, error.message.replace(error.field or "", name), name, error.headers)


class OpenAIBody(BaseModel):
    """An OpenAI request object. OpenAI's spec marks its optional fields nullable and clients send unset ones as null,
    so a null is the field's default, as in vLLM; a required field sent as null is missing."""

    model_config = _OPENAI

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {name: value for name, value in data.items() if value is not None or name not in cls.model_fields}


class StreamOptions(OpenAIBody):
    """Options of a streamed response; continuous_usage_stats (vLLM's) needs include_usage, as in vLLM."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIBody):
    """OpenAI's response_format.json_schema; `strict` is implied (the output always follows the schema)."""

    name: str | None = Field(None, max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBody):
    """OpenAI's response_format: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is json_schema")
        return self

    def constraint(self) -> tuple[dict[str, Any], dict[str, str]] | None:
        """The structured outputs it asks for, and the request field that holds each kind; None for text."""
        if self.type == "text":
            return None
        if self.type == "json_schema" and self.json_schema is not None and self.json_schema.schema_ is not None:
            return {"json": self.json_schema.schema_}, {"json": "response_format.json_schema.schema"}
        return {"json_object": True}, {"json_object": "response_format"}


# Fields a client may send that this server does not honour, and why (a 400 naming them, not a different answer).
NOT_SERVED = {
    "prompt_logprobs": "prompt_logprobs is not served on the OpenAI routes: send echo with logprobs to "
                       "/v1/completions (the prompt's tokens are scored), or prompt_logprobs to /v1/jobs",
    "chat_template": "a request's own chat template is not served (it would run the client's Jinja on the server); "
                     "the server's --chat-template applies",
    "functions": "the legacy functions field is not served: send tools",
    "function_call": "the legacy function_call field is not served: send tool_choice",
}

# vLLM's older per-kind fields (before structured_outputs), still sent by many clients
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _only_with(flag: str) -> Any:
    """A field validator refusing its field unless the request's earlier field `flag` is true, as vLLM and OpenAI
    refuse stream_options without stream and top_logprobs without logprobs."""
    def check(value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get(flag):
            raise ValueError(f"{info.field_name} can only be given with {flag}: true")
        return value
    return check


def not_served(reasons: dict[str, str]) -> Any:
    """A field validator refusing each of its fields that is given, with the reason `reasons` holds for it (fields
    a client may send that the server does not honour: a 400 naming them, not a different answer)."""
    def check(value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(reasons[info.field_name or ""])
        return value
    return check


class OpenAIRequest(OpenAIBody):
    """Fields shared by completions and chat completions, plus vLLM's extra sampling fields."""

    model: str | None = Field(None, min_length=1, max_length=1024, description="a served name; omitted: the first")
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: StorableStr | None = Field(None, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias, clamped to [-100, 100] as vLLM does
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # vLLM's: words the output may not contain
    # constrained output: OpenAI's response_format, vLLM's structured_outputs, or one of its guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    priority: int | None = Field(None, ge=-1000, le=1000, description="lower runs earlier (vLLM's); omitted: 0, or "
                                 "the API key's priority floor when above it")
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens as "token_id:<id>"
    truncate_prompt_tokens: TruncatePromptTokens | None = None  # vLLM's: keep the prompt's last N tokens
    use_beam_search: bool = False  # vLLM's; false is accepted, true refused: beam search is a job's beam_width
    # refused rather than ignored (each would change the answer): NOT_SERVED
    prompt_logprobs: int | None = None
    chat_template: str | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    _only_when_streaming = field_validator("stream_options")(_only_with("stream"))
    _refused = field_validator(*NOT_SERVED)(not_served(NOT_SERVED))

    @field_validator("use_beam_search")
    @classmethod
    def _no_beam_search(cls, value: bool) -> bool:
        if value:
            raise ValueError("beam search is not served on the OpenAI routes; submit a job to /v1/jobs with "
                             "beam_width (its beams come back as the job's choices, best first)")
        return value

    def _job(self, endpoint: str, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
             **prompt: Any) -> JobCreate:
        if self.model is not None:
            check_served_model(self.model)
        sampling = self._sampling()
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        metadata: dict[str, MetadataValue] = {"openai_endpoint": endpoint, "user": self.user, **self._metadata()}
        if self.return_tokens_as_token_ids:
            metadata["openai_token_ids"] = True
        if self.model is not None:  # the served name asked for, which a batch line's answer carries
            metadata["openai_model"] = self.model
        priority = {} if self.priority is None else {"priority": self.priority}  # unset: the key's default
        return JobCreate(**sampling, **prompt, **priority, truncate_prompt_tokens=self.truncate_prompt_tokens,
                         stop=stop, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                         structured_outputs=self._structured_outputs(), metadata=metadata)

    def _sampling(self) -> dict[str, Any]:
        """The sampling fields the job takes as they are."""
        return self.model_dump(include={
            "n", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
            "repetition_penalty", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "min_tokens",
            "stop_token_ids", "allowed_token_ids", "bad_words",
        }) | self._logit_bias()

    def _logit_bias(self) -> dict[str, Any]:
        if self.logit_bias is None:
            return {}
        return {"logit_bias": {token: min(100.0, max(-100.0, bias)) for token, bias in self.logit_bias.items()}}

    def _constraint_sources(self) -> dict[str, tuple[dict[str, Any], dict[str, str]]]:
        """Each field of this request that constrains the output: the structured outputs it asks for, and the
        request field that holds each kind (for naming errors)."""
        sources = {}
        if self.response_format is not None and (constraint := self.response_format.constraint()) is not None:
            sources["response_format"] = constraint
        if self.structured_outputs is not None:
            sources["structured_outputs"] = self.structured_outputs, {}
        for field, kind in GUIDED_FIELDS.items():
            if (value := getattr(self, field)) is not None:
                sources[field] = {kind: value}, {kind: field}
        return sources

    def _structured_outputs(self) -> StructuredOutputsIn | None:
        """The job's structured outputs, from the one field that asks for them, their shape checked here (a 400
        names the field sent; their grammar is compiled when the job is built, see `sent_as`)."""
        sources = self._constraint_sources()
        if len(sources) > 1:
            raise ApiError(400, f"give only one of {', '.join(sources)}: each constrains the output",
                           list(sources)[1])
        if not sources:
            return None
        (source, (spec, fields)), = sources.items()
        try:  # checked here, not by the job, so that the error names the field this request sent
            return StructuredOutputsIn.model_validate(spec)
        except ValidationError as exc:
            error = exc.errors()[0]
            kind = str(error["loc"][0]) if error["loc"] else None
            field = fields.get(kind or "", f"{source}.{kind}" if kind else source)
            raise ApiError(400, f"{field}: {error['msg']}", field) from None

    def _metadata(self) -> dict[str, MetadataValue]:
        """Endpoint-specific job metadata the response builder reads back."""
        return {}

    def sent_as(self) -> dict[str, str]:
        """Job fields this request gave under another name (job field -> request field), for naming errors: the
        output constraint (whose grammar is compiled with the job) under the field that asked for it."""
        sources = self._constraint_sources()
        if len(sources) != 1:
            return {}
        (source, (_spec, fields)), = sources.items()
        return {f"structured_outputs.{kind}": fields.get(kind, f"{source}.{kind}") for kind in KINDS}


class CompletionRequest(OpenAIRequest):
    """Body of POST /v1/completions: a prompt as text or token ids, or a list of them (a choice set per prompt)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_count(cls, value: str | list[str] | list[int] | list[list[int]]) -> Any:
        if isinstance(value, list) and (not value or any(isinstance(item, list) and not item for item in value)):
            raise ValueError("must not be empty, nor hold an empty list of token ids")
        if isinstance(value, list) and not isinstance(value[0], int) and len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}; use the Batch API")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(f"best_of other than n is not supported (got best_of={value}, n={n}); "
                             "ask for n completions and pick the best yourself")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (text insertion) is not supported; send the text before the gap as prompt")
        return value

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: text or token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]  # one prompt: text, or one list of token ids
        return list(self.prompt)

    def to_jobs(self) -> list[JobCreate]:
        """One job per prompt; token-id prompts reach the engine as the ids given."""
        prompts = self.prompts()
        # echo with logprobs gives the prompt's tokens their logprobs too (the first has none), as lm-eval's
        # loglikelihood requests expect; the prompt is computed whole for it (no cached prefix)
        prompt_logprobs = self.logprobs if self.echo else None
        # echo with max_tokens 0 answers with the prompt alone (OpenAI's legacy scoring request, as vLLM): the job
        # makes one token, which the answer leaves out
        max_tokens = 1 if self.echo_only else self.max_tokens
        return [self._job(COMPLETIONS, max_tokens, self.logprobs, prompt_logprobs,
                          **_prompt_field(p, "prompt" if len(prompts) == 1 else f"prompt.{i}"))
                for i, p in enumerate(prompts)]

    def to_job(self) -> JobCreate:
        """The job of a one-prompt request (a Batch API line)."""
        jobs = self.to_jobs()
        if len(jobs) != 1:
            raise ApiError(400, f"give one prompt per batch line, got {len(jobs)}", "prompt")
        return jobs[0]

    @property
    def echo_only(self) -> bool:
        """Whether the request asks for its prompt alone: echo with max_tokens 0."""
        return self.echo and self.max_tokens == 0

    def _metadata(self) -> dict[str, MetadataValue]:
        if not self.echo:
            return {}
        return {"openai_echo": True, **({"openai_echo_only": True} if self.echo_only else {})}


def _prompt_field(prompt: str | list[int], field: str) -> dict[str, str | list[int]]:
    """The job field of one prompt: text, or token ids checked against the vocabulary (named as OpenAI's field)."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    try:
        prompt_model().check_token_ids(prompt, field)
    except ValueError as exc:
        raise ApiError(400, str(exc), field) from exc
    return {"prompt_token_ids": prompt}


class TextPart(OpenAIBody):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str

    @property
    def content(self) -> str:
        return self.text


class RefusalPart(OpenAIBody):
    """A refusal part of an earlier assistant turn, as OpenAI answers it; the template reads its text."""

    type: Literal["refusal"]
    refusal: str

    @property
    def content(self) -> str:
        return self.refusal


class ToolCallFunction(OpenAIBody):
    """The function an assistant's tool call named, with its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(OpenAIBody):
    """A tool call of an earlier assistant turn, as a tool-using client sends its history back."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessageIn(OpenAIBody):
    """One chat message as OpenAI clients send it (content as a string or text parts); a tool-using conversation's
    history too: assistant turns with tool_calls (content may then be null) and tool results (role tool)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | RefusalPart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_unless_tool_calls(self) -> ChatMessageIn:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if self.role != "assistant" and isinstance(self.content, list) and any(
                isinstance(part, RefusalPart) for part in self.content):
            raise ValueError(f"refusal parts belong to assistant messages, not to a {self.role} message")
        return self

    def as_job_message(self) -> dict[str, Any]:
        """The message as the job store keeps it (developer counts as system), what the chat template reads."""
        # text parts joined by newlines, as vLLM renders them for a template that takes a string
        text = "" if self.content is None else self.content if isinstance(self.content, str) else "\n".join(
            p.content for p in self.content)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
                "name": call.function.name, "arguments": call.function.arguments}} for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class FunctionDef(OpenAIBody):
    """A function a chat request offers the model."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; forced calls always follow the schema, "auto" ones are not constrained


class ToolDef(OpenAIBody):
    """One of a chat request's tools."""

    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(OpenAIBody):
    """The function a named tool_choice forces."""

    name: str


class NamedToolChoice(OpenAIBody):
    """tool_choice forcing one function: {"type": "function", "function": {"name": ...}}."""

    type: Literal["function"] = "function"
    function: FunctionName


def template_tools(tools: list[ToolDef] | None) -> list[dict[str, Any]] | None:
    """A request's tools as the chat template reads them (`tools=`, as transformers and vLLM pass them)."""
    if not tools:
        return None
    return [{"type": "function", "function": tool.function.model_dump(include={"name", "description", "parameters"},
                                                                      exclude_none=True)} for tool in tools]


class ChatCompletionRequest(OpenAIRequest):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = bounded_as("max_tokens")
    max_completion_tokens: int | None = bounded_as("max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = bounded_as("logprobs")
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    echo: bool = False  # vLLM's: the final message's text starts the answer when it has the answer's role
    # vLLM's: how the chat template renders the messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    _needs_logprobs = field_validator("top_logprobs")(_only_with("logprobs"))

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, value: list[ToolDef] | None) -> list[ToolDef] | None:
        names = [tool.function.name for tool in value or []]
        if len(set(names)) < len(names):
            raise ValueError(f"function names must be distinct, got {names}")
        return value

    def to_job(self) -> JobCreate:
        """The job that answers this request; without a token limit it may fill the rest of the context."""
        messages = [m.as_job_message() for m in self.messages]
        tools = self._chat_tools()
        options = self._template_options()
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        max_tokens = limit if limit is not None else self._rest_of_context(messages, tools, options)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._job(CHAT_COMPLETIONS, max_tokens, logprobs, messages=messages, tools=tools,
                         **self.model_dump(include={"add_generation_prompt", "continue_final_message",
                                                    "chat_template_kwargs"}))

    def _chat_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them; every tool_choice shows them, as vLLM does by default ("none"
        too: the model still sees what it may not call)."""
        return template_tools(self.tools)

    def _tool_mode(self) -> str | None:
        """How the output becomes tool calls (core.tool_calls' modes: forced "required" or "function:<name>", or
        "auto:<parser>" with the server's tool-call parser), or None: free text, answered as content."""
        if self.tool_choice is None or self.tool_choice == "auto":  # with tools, no tool_choice means auto
            settings = get_settings()
            parses = self.tools and settings.enable_auto_tool_choice and settings.tool_call_parser
            if self.tools and self.tool_choice == "auto" and not parses:  # as vLLM: no call would ever be read
                raise ApiError(400, 'tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                               '--tool-call-parser; send "required", a named function or "none"', "tool_choice")
            return AUTO_PREFIX + settings.tool_call_parser if parses else None  # type: ignore[operator]
        if self.tool_choice == "none":
            return None
        names = [tool.function.name for tool in self.tools or []]
        if not names:
            raise ApiError(400, "tool_choice other than none/auto needs tools to choose from", "tool_choice")
        if self.tool_choice == "required":
            return REQUIRED
        name = self.tool_choice.function.name  # type: ignore[union-attr]
        if name not in names:
            raise ApiError(400, f"tool_choice.function.name '{name}' is not one of the tools ({', '.join(names)})",
                           "tool_choice.function.name")
        return NAMED_PREFIX + name

    def _sampling(self) -> dict[str, Any]:
        sampling = super()._sampling()
        mode = self._tool_mode() or ""
        if ("skip_special_tokens" not in self.model_fields_set and mode.startswith(AUTO_PREFIX)
                and TOOL_CALL_PARSERS[mode.removeprefix(AUTO_PREFIX)].keeps_special_tokens):
            sampling["skip_special_tokens"] = False  # as vLLM's hermes: some models' markers are special tokens
        return sampling

    def _constraint_sources(self) -> dict[str, tuple[dict[str, Any], dict[str, str]]]:
        sources = super()._constraint_sources()
        mode = self._tool_mode()
        if mode is not None and not mode.startswith(AUTO_PREFIX):
            tools = [tool.model_dump(exclude_none=True) for tool in self.tools or []]
            named = [i for i, tool in enumerate(tools) if NAMED_PREFIX + tool["function"]["name"] == mode]
            # a named function's own schema is named by its place; "required" joins every tool's into one schema
            field = f"tools.{named[0]}.function.parameters" if named else "tools"
            sources["tool_choice"] = {"json": call_schema(tools, mode, self.parallel_tool_calls)}, {"json": field}
        return sources

    def _metadata(self) -> dict[str, MetadataValue]:
        # vLLM's echo: the final message's text when it has the answer's role (the assistant's, or the final
        # message's own when no generation prompt starts a new one)
        final = self.messages[-1]
        echoes = self.echo and (final.role == "assistant" or not self.add_generation_prompt)
        kept: dict[str, MetadataValue] = {"openai_chat_echo": final.as_job_message()["content"]} if echoes else {}
        if not self.parallel_tool_calls:  # "required"'s grammar admits one call, a parser's first is kept; echoed
            kept["openai_parallel_tool_calls"] = False
        mode = self._tool_mode()
        if not mode:
            return kept
        if not mode.startswith(AUTO_PREFIX):  # a forced call's grammar admits the tools' names alone
            return {**kept, "openai_tool_choice": mode}
        # a parser reads whatever name the model writes: only the tools' names become calls
        return {**kept, "openai_tool_choice": mode,
                "openai_tool_names": ",".join(t.function.name for t in self.tools or [])}

    def sent_as(self) -> dict[str, str]:
        renamed = {"max_tokens": "max_completion_tokens"} if self.max_completion_tokens is not None else {}
        return {**super().sent_as(), **renamed}

    def _template_options(self) -> ChatTemplateOptions:
        try:
            return ChatTemplateOptions.of(self)
        except PromptFieldError as exc:
            raise ApiError(400, str(exc), exc.field) from exc

    def _rest_of_context(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                         options: ChatTemplateOptions) -> int:
        model = prompt_model()
        try:
            num_prompt_tokens = model.count_tokens(model.render_chat(messages, tools=tools, options=options))
        except PromptFieldError as exc:
            raise ApiError(400, str(exc), exc.field) from exc
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens > 0:  # what remains of it runs
            num_prompt_tokens = min(num_prompt_tokens, self.truncate_prompt_tokens)
        return max(1, model.max_model_len - num_prompt_tokens)


REQUEST_SCHEMAS: dict[str, type[CompletionRequest] | type[ChatCompletionRequest]] = {
    COMPLETIONS: CompletionRequest,
    CHAT_COMPLETIONS: ChatCompletionRequest,
}
