"""vLLM's POST /tokenize and POST /detokenize with the served model's tokenizer and chat template."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.auth import CurrentKey
from api.errors import ApiError
from api.openai_errors import OpenAIRoute
from api.openai_schemas import ChatMessageIn, ToolDef, check_served_model, template_tools
from api.prompts import prompt_model
from core.prompts import ChatTemplateOptions, PromptFieldError

router = APIRouter(tags=["openai"], route_class=OpenAIRoute)
_VLLM = ConfigDict(extra="forbid")


class TokenizeRequest(BaseModel):
    """Body of POST /tokenize: a prompt, or chat messages rendered through the chat template (as vLLM)."""

    model_config = _VLLM

    model: str | None = None
    prompt: str | None = Field(None, max_length=400_000)
    messages: list[ChatMessageIn] | None = Field(None, min_length=1, max_length=256)
    tools: list[ToolDef] | None = Field(None, max_length=128)  # shown to the chat template, as a chat request's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_xor_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    """The token ids of a prompt, their count and the model's context length."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """Body of POST /detokenize."""

    model_config = _VLLM

    model: str | None = None
    tokens: list[int] = Field(max_length=400_000)


class DetokenizeResponse(BaseModel):
    """The text of some token ids."""

    prompt: str


@router.post("/tokenize")
def tokenize(body: TokenizeRequest, key: CurrentKey) -> TokenizeResponse:
    """Tokenize a prompt or chat messages as the engine will."""
    if body.model is not None:
        check_served_model(body.model)
    model = prompt_model()
    if body.messages is None:
        text = body.prompt or ""
    else:
        try:
            text = model.render_chat([m.as_job_message() for m in body.messages], tools=template_tools(body.tools),
                                     options=ChatTemplateOptions.of(body))
        except PromptFieldError as exc:
            raise ApiError(400, str(exc), exc.field) from exc
    encoding = model.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    return TokenizeResponse(count=len(encoding.ids), max_model_len=model.max_model_len, tokens=encoding.ids,
                            token_strs=encoding.tokens if body.return_token_strs else None)


@router.post("/detokenize")
def detokenize(body: DetokenizeRequest, key: CurrentKey) -> DetokenizeResponse:
    """The text of token ids (special tokens included), each checked against the vocabulary."""
    if body.model is not None:
        check_served_model(body.model)
    model = prompt_model()
    try:
        model.check_token_ids(body.tokens, "tokens")
    except ValueError as exc:
        raise ApiError(400, str(exc), "tokens") from exc
    return DetokenizeResponse(prompt=model.tokenizer.decode(body.tokens, skip_special_tokens=False))
