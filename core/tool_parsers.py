"""Tool calls in a model's free text, for tool_choice "auto": the formats of vLLM's --tool-call-parser.

Each parser reads a finished output (`parse`) and tells a stream how much of a partial output is surely content
(`content_end`), so content streams while a tool call is held back until the output is whole. A text that does not
parse as the format is content, whole, as in vLLM: a model that meant to call a tool but wrote broken JSON answers
with its text instead of an error.

Written here rather than taken from vLLM: its parsers need its tokenizer and request classes (and torch).
"""

from __future__ import annotations

import ast
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """An output that holds tool calls, and the content beside them (None when there is none)."""

    content: str | None
    calls: list[ParsedCall]


# what a function offered in `tools` may be called (the API's FunctionDef); a call naming anything else is not one
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _call_of(obj: Any) -> ParsedCall | None:
    """A call from {"name": ..., "arguments" | "parameters": {...}} (arguments may come as JSON text)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not _FUNCTION_NAME.fullmatch(obj["name"]):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except Exception:  # not JSON, or nested past the recursion limit
            return None
    return ParsedCall(obj["name"], arguments_text) if (arguments_text := _arguments_text(arguments)) else None


def _arguments_text(arguments: Any) -> str | None:
    """Arguments as strict JSON text (no NaN) that UTF-8 can carry, or None unless they are an object."""
    if not isinstance(arguments, dict):
        return None
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        text.encode()  # a lone surrogate ("\ud800" in the model's JSON) cannot be sent
    except Exception:  # NaN, a value JSON has no form for (a set, bytes), a surrogate, nesting past the recursion limit
        return None
    return text


def _calls_of(objs: list[Any]) -> list[ParsedCall] | None:
    """Every object as a call, or None if any is not one."""
    calls = [_call_of(obj) for obj in objs]
    return None if not calls or any(call is None for call in calls) else calls  # type: ignore[return-value]


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could begin `marker` (held back until the next tokens say)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


class ToolCallParser(ABC):
    """One model family's tool-call format."""

    name: ClassVar[str]
    # the model's markers are special tokens in some models: its requests keep special tokens' text (as vLLM's)
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput | None:
        """The tool calls a finished output holds; None if it holds none (it is then content, whole)."""

    @abstractmethod
    def content_end(self, text: str) -> int:
        """How many leading characters of a partial output are content whatever follows; grows with the text."""


def _listed(text: str) -> list[Any]:
    """The JSON text of one call object or of a list of them, as a list."""
    obj = json.loads(text)
    return obj if isinstance(obj, list) else [obj]


class _MarkedCallsParser(ToolCallParser):
    """Formats whose output is content, then a marker (a special token in the model's vocabulary) that opens the
    tool calls: everything from the first marker on is calls, everything before it content."""

    keeps_special_tokens = True
    START: ClassVar[str]

    @abstractmethod
    def _objects(self, calls: str) -> list[Any]:
        """The call objects of the output from its first marker on; raises if it holds none."""

    def parse(self, text: str) -> ParsedOutput | None:
        start = text.find(self.START)
        if start < 0:
            return None
        try:
            calls = _calls_of(self._objects(text[start:]))
        except Exception:  # not the format, or nested past the recursion limit: the output is content
            return None
        return None if calls is None else ParsedOutput(text[:start] or None, calls)

    def content_end(self, text: str) -> int:
        start = text.find(self.START)
        return start if start >= 0 else len(text) - _held_prefix(text, self.START)


class HermesParser(_MarkedCallsParser):
    """Hermes, Qwen 2.5/3 and SmolLM2: content, then one JSON call per <tool_call>...</tool_call> block (a block
    holding a list of calls, as SmolLM2 writes them, counts as those calls). An unclosed last block is read to the
    end of the output, as when the model stopped on its end-of-turn token."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)

    def _objects(self, calls: str) -> list[Any]:
        return [obj for block in self._BLOCK.findall(calls) for obj in _listed(block)]


class MistralParser(_MarkedCallsParser):
    """Mistral's: [TOOL_CALLS] and a JSON list of calls, or (tokenizer v11 and later) one `name[ARGS]{arguments}` after
    each [TOOL_CALLS]."""

    name = "mistral"
    START, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def _objects(self, calls: str) -> list[Any]:
        body = calls.removeprefix(self.START).strip()
        if body.startswith(("[", "{")):
            return _listed(body)
        named = [part.split(self.ARGS, 1) for part in calls.split(self.START)[1:]]
        return [{"name": name.strip(), "arguments": json.loads(arguments)} for name, arguments in named]


class GraniteParser(_MarkedCallsParser):
    """IBM Granite 3's: <|tool_call|> and a JSON list of calls."""

    name = "granite"
    START = "<|tool_call|>"

    def _objects(self, calls: str) -> list[Any]:
        return _listed(calls.removeprefix(self.START).strip())


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1-3.3's JSON tool calls: the output is `{"name": ..., "parameters": {...}}` (after an optional
    <|python_tag|>), several separated by ";"; an output that starts otherwise is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedOutput | None:
        body = text.strip().removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return None
        decoder, objs, at = json.JSONDecoder(), [], 0
        try:
            while at < len(body):
                obj, at = decoder.raw_decode(body, at)
                objs.append(obj)
                at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        except Exception:  # not JSON, or nested past the recursion limit: the output is content
            return None
        calls = _calls_of(objs)
        return None if calls is None else ParsedOutput(None, calls)

    def content_end(self, text: str) -> int:
        head = text.lstrip()
        return 0 if head.startswith(("{", self.TAG)) or self.TAG.startswith(head) else len(text)


class PythonicParser(ToolCallParser):
    """Llama 3.2 and 4's Python-style calls: the output is a list of calls with keyword arguments,
    `[get_weather(city="Paris"), get_time()]` (inside <|python_start|>...<|python_end|> for Llama 4)."""

    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"

    def parse(self, text: str) -> ParsedOutput | None:
        body = text.strip().removeprefix(self.START).removesuffix(self.END).strip()
        if not body.startswith("["):
            return None
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            calls = [self._call(node) for node in tree.elts]
        except Exception:  # not Python, not literals, or too deep for the parser (MemoryError, RecursionError)
            return None
        return ParsedOutput(None, calls)

    @staticmethod
    def _call(node: ast.expr) -> ParsedCall:
        """A call node with literal keyword arguments; ValueError for anything else (names, positional args)."""
        if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name | ast.Attribute) or node.args
                or any(k.arg is None for k in node.keywords)):
            raise ValueError("not a call of a name with keyword arguments")
        name = ast.unparse(node.func)  # a dotted name too (function names may hold dots)
        if not _FUNCTION_NAME.fullmatch(name):
            raise ValueError(f"not a function name: {name}")
        arguments = _arguments_text({k.arg: ast.literal_eval(k.value) for k in node.keywords})
        if arguments is None:
            raise ValueError("arguments JSON cannot hold")
        return ParsedCall(name, arguments)

    def content_end(self, text: str) -> int:
        head = text.lstrip()
        return 0 if head.startswith(("[", self.START)) or self.START.startswith(head) else len(text)


TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {
    parser.name: parser for parser in (HermesParser(), MistralParser(), GraniteParser(), Llama3JsonParser(),
                                       PythonicParser())}
