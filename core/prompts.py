"""Torch-free prompt handling: chat templates, token counts against the model's context, token texts."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders

from core.model_files import prepared_folder
from core.settings import get_settings


class PromptFieldError(ValueError):
    """A prompt that cannot be made or run; `field` is the request field to blame."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class PromptTooLongError(PromptFieldError):
    """The prompt plus max_tokens does not fit the model's context window; `field` is the one to blame: the prompt
    when it leaves no room for a single token, else max_tokens."""


class TokenIdError(ValueError):
    """A token id outside the model's vocabulary (the engine would index past its embeddings)."""


class ChatTemplateRequest(Protocol):
    """A request that carries vLLM's chat template fields."""

    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class ChatTemplateOptions:
    """How chat messages are rendered, as vLLM's chat requests ask: a generation prompt after them (or the final
    message left open for the model to continue), and extra variables for the template (`enable_thinking`...)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, request: ChatTemplateRequest) -> ChatTemplateOptions:
        """The options a request's fields of the same names (vLLM's) ask for."""
        return cls(request.add_generation_prompt, request.continue_final_message, request.chat_template_kwargs or {})

    def __post_init__(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise PromptFieldError("continue_final_message needs add_generation_prompt false: the model either "
                                   "continues the final message or starts a new one", "continue_final_message")


# appended to the final message's text to find where it ends in the rendering (transformers' and vLLM's scheme): its
# text alone may also occur in the template's own markers ("end" in "<|im_end|>")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tagged_final_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with the tag after the final message's text."""
    final = messages[-1]
    return [*messages[:-1], {**final, "content": str(final.get("content") or "") + _CONTINUE_TAG}]


def _cut_at_tag(rendered: str) -> str:
    """The rendering up to where the final message's text ends, left open for the model to continue it."""
    at = rendered.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise PromptFieldError("continue_final_message: the chat template does not show the final message's text, "
                               "so there is nothing to continue", "continue_final_message")
    # a template that trims the message trims the tag's space too, and the message's own trailing space with it
    return rendered[:at] if rendered.startswith(_CONTINUE_TAG, at) else rendered[:at].rstrip()


@dataclass(frozen=True, slots=True)
class PromptModel:
    """What the API needs of the model: its tokenizer, context length, vocabulary size and chat template."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    chat_template: str | None
    special_tokens: dict[str, str]
    # what the engine stops at (config, generation config, tokenizer), which min_tokens holds back
    eos_token_ids: frozenset[int] = frozenset()
    byte_level: bool = False  # GPT-2's byte-level vocabulary: each byte spelled as one printable character

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    options: ChatTemplateOptions | None = None) -> str:
        """The prompt text for chat messages (and tool definitions, for templates that show them), through the
        model's own chat template; PromptFieldError naming the field at fault."""
        if not self.chat_template:
            raise PromptFieldError("messages: this model has no chat template; send a prompt instead", "messages")
        options = options or ChatTemplateOptions()
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        variables = {**self.special_tokens, "messages": messages,
                     "add_generation_prompt": options.add_generation_prompt}
        if tools:  # templates test `tools is defined` or `tools`: only given tools are passed
            variables["tools"] = tools
        clash = sorted(set(options.template_kwargs) & (set(variables) | {"tools"}))
        if clash:
            raise PromptFieldError(f"chat_template_kwargs.{clash[0]}: set by the server, not by chat_template_kwargs",
                                   f"chat_template_kwargs.{clash[0]}")
        if options.continue_final_message:
            variables["messages"] = _tagged_final_message(messages)
        try:
            rendered = env.from_string(self.chat_template).render(**options.template_kwargs, **variables)
        except Exception as exc:  # TemplateError, or a TypeError of the template's own code on the values it got
            raise PromptFieldError(f"messages: the model's chat template failed: {exc}", "messages") from exc
        return _cut_at_tag(rendered) if options.continue_final_message else rendered

    def count_tokens(self, prompt: str) -> int:
        """Number of prompt tokens the engine will see."""
        return len(self.tokenizer.encode(prompt).ids)

    def check_token_ids(self, token_ids: list[int], field: str) -> None:
        """TokenIdError naming `field` unless every id is in [0, vocab_size)."""
        bad = next((i for i in token_ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise TokenIdError(f"{field}: token id {bad} is outside the model's vocabulary [0, {self.vocab_size})")

    def check_fits(
        self, prompt: str, max_tokens: int, field: str = "prompt", max_tokens_field: str = "max_tokens",
    ) -> int:
        """The prompt's token count; PromptTooLongError past the context, TokenIdError for ids past the vocabulary."""
        return self.check_fits_ids(self.tokenizer.encode(prompt).ids, max_tokens, field, max_tokens_field)

    def check_fits_ids(self, token_ids: list[int], max_tokens: int, field: str = "prompt",
                       max_tokens_field: str = "max_tokens") -> int:
        """``check_fits`` for a prompt given as token ids."""
        self.check_token_ids(token_ids, field)
        num_tokens = len(token_ids)
        if num_tokens + max_tokens > self.max_model_len:
            room = self.max_model_len - num_tokens
            blamed, hint = (field, "") if room < 1 else (max_tokens_field, f"; max_tokens can be at most {room}")
            raise PromptTooLongError(
                f"{blamed}: {num_tokens} prompt tokens + max_tokens {max_tokens} exceed the model's "
                f"context of {self.max_model_len} tokens{hint}", blamed,
            )
        return num_tokens

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes, also where it holds only part of a character (which its decoded text shows as
        U+FFFD): a byte-level vocabulary's piece mapped back to bytes, a byte-fallback piece (<0xF0>) its byte,
        else the decoded text's UTF-8."""
        piece = self.tokenizer.id_to_token(token_id)
        if piece is not None:
            if (byte := _BYTE_PIECE.fullmatch(piece)) is not None:
                return bytes([int(byte.group(1), 16)])
            if self.byte_level and all(char in _BYTE_OF_CHAR for char in piece):
                return bytes(_BYTE_OF_CHAR[char] for char in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def check_samplable(self, allowed_token_ids: list[int] | None, stop_token_ids: list[int], ignore_eos: bool,
                        min_tokens: int) -> None:
        """PromptFieldError naming allowed_token_ids when min_tokens holds back every token it allows (the engine
        refuses such a request: no token could be sampled)."""
        if not min_tokens or allowed_token_ids is None:
            return
        held_back = set(stop_token_ids) | (set() if ignore_eos else self.eos_token_ids)
        if set(allowed_token_ids) <= held_back:
            raise PromptFieldError(f"allowed_token_ids holds only stop tokens (EOS or stop_token_ids), which "
                                   f"min_tokens ({min_tokens}) holds back: no token could be sampled",
                                   "allowed_token_ids")


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable bytes stand for themselves, the other 68 for the characters
    from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {chr(byte): byte for byte in printable} | {chr(256 + i): byte for i, byte in enumerate(others)}


_BYTE_OF_CHAR = _byte_of_char()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _eos_token_ids(folder: Path, config: dict[str, Any], tokenizer: Tokenizer,
                   special_tokens: dict[str, str], vocab_size: int) -> frozenset[int]:
    """Every end-of-sequence id config.json, generation_config.json and the tokenizer name, as the engine's loader
    gathers them (without transformers: the API is torch-free)."""
    values: list[Any] = [config.get("eos_token_id")]
    generation_config = folder / "generation_config.json"
    if generation_config.exists():
        values.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    if "eos_token" in special_tokens:
        values.append(tokenizer.token_to_id(special_tokens["eos_token"]))
    ids = {i for value in values for i in ([value] if isinstance(value, int) else value or [])}
    return frozenset(i for i in ids if 0 <= i < vocab_size)


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    tokens = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _context_length(config: dict[str, Any], max_model_len: int | None) -> int:
    model_len = int(config.get("max_position_embeddings", 2048))
    if max_model_len is not None and max_model_len > model_len:
        raise ValueError(f"max_model_len (--max-model-len) must not exceed the model's context of {model_len} "
                         f"tokens, got {max_model_len}")
    return max_model_len or model_len


def _given_chat_template(value: str) -> str:
    """The template of --chat-template: a file's text, or the value itself (as vLLM), checked to compile."""
    path = Path(value).expanduser()
    template = path.read_text() if path.is_file() else value
    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateError as exc:
        message = f"chat_template (--chat-template) is neither a file nor a valid Jinja template: {exc}"
        raise ValueError(message) from exc
    return template


@lru_cache(maxsize=4)
def load_prompt_model(
    model: str, tokenizer_dir: Path | None = None, chat_template: str | None = None, max_model_len: int | None = None,
    cache_root: Path | None = None,
) -> PromptModel:
    """Load tokenizer and limits of a model once per process; the optional arguments override the model's own.

    A GGUF model is read from its converted folder; ModelNotPreparedError until a worker or `pagedserve
    prepare` made it (the API never converts: that needs torch).
    """
    folder = prepared_folder(model, cache_root)
    tok_folder = tokenizer_dir.expanduser() if tokenizer_dir is not None else folder
    config = json.loads((folder / "config.json").read_text())
    tok_config_path = tok_folder / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text()) if tok_config_path.exists() else {}
    template = tok_config.get("chat_template")
    template_file = tok_folder / "chat_template.jinja"
    if template is None and template_file.exists():
        template = template_file.read_text()
    if chat_template is not None:
        template = _given_chat_template(chat_template)
    tokenizer = Tokenizer.from_file(str(tok_folder / "tokenizer.json"))
    # the engine's embedding table has config's vocab_size rows (often padded past the tokenizer's)
    vocab_size = int(config.get("vocab_size") or tokenizer.get_vocab_size(with_added_tokens=True))
    special_tokens = _special_tokens(tok_config)
    return PromptModel(
        name=model,
        tokenizer=tokenizer,
        max_model_len=_context_length(config, max_model_len),
        vocab_size=vocab_size,
        chat_template=template if isinstance(template, str) else None,
        special_tokens=special_tokens,
        eos_token_ids=_eos_token_ids(folder, config, tokenizer, special_tokens, vocab_size),
        byte_level=isinstance(tokenizer.decoder, decoders.ByteLevel),
    )


def configured_prompt_model() -> PromptModel:
    """The configured model's prompt handling; ModelNotPreparedError while the model is not prepared."""
    settings = get_settings()
    return load_prompt_model(settings.model, settings.tokenizer, settings.chat_template, settings.max_model_len,
                             settings.cache_dir)
