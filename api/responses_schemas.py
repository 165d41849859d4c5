"""The body of POST /v1/responses (OpenAI's Responses API, as vLLM serves it) and the chat request it runs as.

A response is a chat completion underneath: `instructions` become a system message, the `input` items (messages,
function calls and their outputs) the conversation, `previous_response_id` puts an earlier response's conversation
and answer before them, `text.format` is the response format and the function tools are the chat's tools.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError, ValidationInfo, field_validator

from api.errors import ApiError
from api.openai_schemas import ChatCompletionRequest, OpenAIBody, bounded_as, not_served
from api.schemas import JobCreate, MetadataValue
from core.openai_responses import RESPONSES

# Fields of OpenAI's Responses API this server does not honour, and why (a 400 naming them, not another answer).
NOT_SERVED = {
    "conversation": "stored conversations are not served: send the earlier items in input, or previous_response_id",
    "prompt": "stored prompt templates are not served: send instructions and input",
    "max_tool_calls": "max_tool_calls is not served: the model's calls are not counted across a response",
}

# A job field -> the Responses field that gave it, for naming errors found while the job is built.
RENAMED = {"max_tokens": "max_output_tokens", "messages": "input", "logprobs": "top_logprobs",
           "structured_outputs.json": "text.format.schema", "structured_outputs.json_object": "text.format"}


class TextContent(OpenAIBody):
    """A text part of a message: input_text (what users and instructions say) or output_text (an earlier answer)."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(OpenAIBody):
    """A message of the conversation; an earlier answer's message item may come back with its id and status."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        """Its content as one text (parts joined by newlines, as the chat routes join them)."""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class FunctionCallItem(OpenAIBody):
    """A function call the model made in an earlier answer, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenAIBody):
    """What the client's function returned for a call (`call_id`)."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str
    id: str | None = None
    status: str | None = None


def _item_type(value: Any) -> str:
    """An input item's kind; a message may leave out its type (OpenAI's EasyInputMessage)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return str(kind)


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


class FunctionTool(OpenAIBody):
    """A function the model may call (the Responses API's flat tool shape)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(OpenAIBody):
    """tool_choice forcing one function."""

    type: Literal["function"]
    name: str


class TextFormat(OpenAIBody):
    """text.format: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        """The chat request's response_format asking for the same."""
        if self.type != "json_schema":
            return {"type": self.type}
        if self.schema_ is None:
            raise ApiError(400, "text.format.schema is required when text.format.type is json_schema",
                           "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.schema_}}


class TextOptions(OpenAIBody):
    """The `text` field: the output's format."""

    format: TextFormat | None = None
    verbosity: str | None = None  # accepted; nothing here reasons about length


class ResponsesRequest(OpenAIBody):
    """Body of POST /v1/responses."""

    model: str | None = Field(None, min_length=1, max_length=1024, description="a served name; omitted: the first")
    input: list[InputItem] = Field(min_length=1, description="the conversation's items, or a text: one user message")
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    max_output_tokens: int | None = bounded_as("max_tokens")
    temperature: float = 1.0
    top_p: float = 1.0
    top_logprobs: int | None = bounded_as("logprobs")
    stream: bool = False
    background: bool = False  # true: answered at once as queued, to be fetched by GET /v1/responses/{id}
    store: bool = True  # every response is kept as its job (GET /v1/jobs/{id}); false is accepted
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256)
    priority: int | None = Field(None, ge=-1000, le=1000)
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None  # accepted: nothing it may ask for (reasoning, search results) is made here
    reasoning: dict[str, Any] | None = None  # accepted: the served models do not reason
    # refused rather than ignored: each would change the answer
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None

    _refused = field_validator(*NOT_SERVED)(not_served(NOT_SERVED))

    @field_validator("input", mode="before")
    @classmethod
    def _text_is_a_user_message(cls, value: Any) -> Any:
        # a text becomes its one item before validation, so that an invalid item's error names the item's field
        return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value

    @field_validator("metadata")
    @classmethod
    def _metadata_keys(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value and any(not 1 <= len(key) <= 64 or key.startswith("openai_") or key == "user" for key in value):
            raise ValueError("keys must be 1 to 64 characters and not begin with 'openai_' nor be 'user'")
        return value

    @field_validator("background")
    @classmethod
    def _not_streamed(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("stream"):
            raise ValueError("a background response is fetched with GET /v1/responses/{id}, not streamed: give "
                             "stream or background, not both")
        return value

    def to_job(self, earlier: list[dict[str, Any]]) -> JobCreate:
        """The job answering this request after the `earlier` conversation (chat messages, from
        previous_response_id): run as a chat completion, marked as a response."""
        _check_calls(earlier, self.input)
        try:
            job = self._chat_request(earlier).to_job()
        except ApiError as exc:
            raise responses_named(exc) from exc
        job.metadata = {**(job.metadata or {}), **self._metadata(len(earlier), _calls_joined(earlier, job))}
        return job

    def _chat_request(self, earlier: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion request this response runs as."""
        messages = chat_messages(self.input, [*earlier, *([{"role": "system", "content": self.instructions}]
                                                          if self.instructions else [])])
        chat = {
            "model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "user": self.user, "priority": self.priority,
            "logprobs": self.top_logprobs is not None, "top_logprobs": self.top_logprobs,
            "parallel_tool_calls": self.parallel_tool_calls, "truncate_prompt_tokens": None,
        }
        if self.tools:
            chat["tools"] = [{"type": "function", "function": tool.model_dump(
                include={"name", "description", "parameters", "strict"}, exclude_none=True)} for tool in self.tools]
        if self.tool_choice is not None:
            choice = self.tool_choice
            chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                          "function": {"name": choice.name}}
        if self.text is not None and self.text.format is not None:
            chat["response_format"] = self.text.format.response_format()
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as exc:  # what the items' own checks let through, named as this request's field
            raise ApiError(400, f"input: {exc.errors()[0]['msg']}", "input") from exc

    def _metadata(self, history: int, joined_calls: int) -> dict[str, MetadataValue]:
        """What the job keeps to answer as a response: the endpoint, how many of its messages came before this
        request's (an earlier response's conversation), whether the next one is the instructions (which a later
        response does not inherit), how many of its function calls joined the earlier answer's turn, the earlier
        response's id, and the client's own metadata."""
        kept: dict[str, MetadataValue] = {"openai_endpoint": RESPONSES, "openai_history": history,
                                          **(self.metadata or {})}
        if joined_calls:
            kept["openai_joined_calls"] = joined_calls
        if self.instructions:
            kept["openai_instructions"] = True
        if self.previous_response_id is not None:
            kept["openai_previous_response_id"] = self.previous_response_id
        if self.background:
            kept["openai_background"] = True
        if self.tool_choice == "none":  # no mode of its own: the job keeps it to echo it
            kept["openai_tool_choice_none"] = True
        return kept

    def sent_as(self) -> dict[str, str]:
        """Job fields this request gave under another name, for naming a refusal found by the worker: the chat
        request's names (a forced call's schema is its tool's parameters), as this request names them."""
        chat_names = self._chat_request([]).sent_as()
        return RENAMED | {job_field: _responses_field(name) or name for job_field, name in chat_names.items()}


# a chat request's field -> this request's, most specific first
_CHAT_NAMES = (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
               ("messages", "input"), ("response_format.json_schema.schema", "text.format.schema"),
               ("response_format", "text.format"), ("tool_choice.function.name", "tool_choice.name"))


def responses_named(error: ApiError) -> ApiError:
    """An error of the chat request a response runs as (or of its job), in this request's names."""
    message = error.message
    for chat_name, name in _CHAT_NAMES:
        message = message.replace(chat_name, name)
    return ApiError(error.status_code, message, _responses_field(error.field), error.headers)


def _calls_joined(earlier: list[dict[str, Any]], job: JobCreate) -> int:
    """How many of the input's function calls ``chat_messages`` merged into the earlier conversation's last turn
    (an assistant turn right before them): the calls that turn holds in the job beyond those it held before."""
    if not earlier or not job.messages:
        return 0
    return len(job.messages[len(earlier) - 1].tool_calls or []) - len(earlier[-1].get("tool_calls") or [])


def _check_calls(earlier: list[dict[str, Any]], items: list[Any]) -> None:
    """400 naming the item unless each function call's arguments are JSON and each function output answers a call
    made before it (in the earlier conversation or the input)."""
    called = {call["id"] for message in earlier for call in message.get("tool_calls") or []}
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            try:
                json.loads(item.arguments)
            except ValueError as exc:
                raise ApiError(400, f"input.{i}.arguments: not JSON ({exc})", f"input.{i}.arguments") from exc
            called.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in called:
            raise ApiError(400, f"input.{i}.call_id: no function call with call_id {item.call_id!r} comes before it",
                           f"input.{i}.call_id")


def _responses_field(field: str | None) -> str | None:
    """A chat request's field as this request names it."""
    if field is None:
        return None
    for chat_name, name in _CHAT_NAMES:
        if field == chat_name or field.startswith(chat_name + "."):
            return name + field[len(chat_name):]
    if field.startswith("tools.") and ".function." in field:
        return field.replace(".function.", ".", 1)
    return RENAMED.get(field, field)


def chat_messages(items: list[InputMessage | FunctionCallItem | FunctionCallOutputItem],
                  before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages `before`, then the items as chat messages: a function call joins the assistant turn just before
    it (its text, or the calls before it) as one of its tool calls, as a chat completion answers text and calls."""
    messages = list(before)
    for item in items:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                         "arguments": item.arguments}}
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant":  # a copy: `before` may be a stored job's messages
                messages[-1] = {**last, "tool_calls": [*(last.get("tool_calls") or []), call]}
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
    return messages

