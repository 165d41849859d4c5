"""Tool calls as vLLM makes them. Forced (tool_choice "required" or a named function): the output is constrained to
a JSON schema built from the tools, and the finished text becomes the message's tool_calls. Automatic (tool_choice
"auto" on a server started with a tool-call parser): the output is free, and the parser finds the calls in it.

Torch-free: the API builds the constraint when the request arrives; the response builders (API, batch output files)
turn a job's text back into tool calls. A job keeps its mode in its metadata: "required", "function:<name>" or
"auto:<parser>".
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from core.tool_parsers import TOOL_CALL_PARSERS, ParsedCall, ParsedOutput

REQUIRED = "required"
NAMED_PREFIX = "function:"  # a job's tool-choice mode for a named function: "function:<name>"
AUTO_PREFIX = "auto:"  # tool_choice "auto" read by a parser: "auto:<parser name>"
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema (a function without parameters takes an empty object)."""
    return tool["function"].get("parameters") or EMPTY_PARAMETERS


def call_schema(tools: list[dict[str, Any]], mode: str, parallel: bool) -> dict[str, Any]:
    """The JSON schema the output must follow: a named function's arguments, or for "required" a list of one call
    or more (just one unless `parallel`), each naming one of the tools with that tool's arguments."""
    if mode.startswith(NAMED_PREFIX):
        name = mode.removeprefix(NAMED_PREFIX)
        return parameters_of(next(tool for tool in tools if tool["function"]["name"] == name))
    calls = [{"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                               "parameters": parameters_of(tool)},
              "required": ["name", "parameters"], "additionalProperties": False} for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    # llguidance reads its options ("x-guidance", e.g. whitespace_flexible) at the root only: the tools' apply
    options = {k: v for tool in tools for k, v in parameters_of(tool).get("x-guidance", {}).items()}
    if options:
        schema["x-guidance"] = options
    return schema if parallel else {**schema, "maxItems": 1}


def parsed_output(mode: str, text: str) -> ParsedOutput | None:
    """The tool calls a finished output holds under `mode`, with any content beside them; None if it holds none
    (forced calls cut off by max_tokens or a stop string, or free text)."""
    if mode.startswith(AUTO_PREFIX):
        return TOOL_CALL_PARSERS[mode.removeprefix(AUTO_PREFIX)].parse(text)
    if mode.startswith(NAMED_PREFIX):  # the text is the arguments, unless a stop string cut them short
        try:
            json.loads(text)
        except ValueError:
            return None
        return ParsedOutput(None, [ParsedCall(mode.removeprefix(NAMED_PREFIX), text)])
    try:
        return ParsedOutput(None, [ParsedCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
                                   for call in json.loads(text)])
    except (ValueError, TypeError, KeyError):
        return None


def streamable_content(mode: str, text: str) -> int:
    """How much of a partial output a stream may send as content now: none of a forced call's, a parser's content
    until a tool call may begin."""
    return TOOL_CALL_PARSERS[mode.removeprefix(AUTO_PREFIX)].content_end(text) if mode.startswith(AUTO_PREFIX) else 0


def tool_calls(mode: str, text: str, call_id_prefix: str, offered: Collection[str] | None = None,
               ) -> tuple[str | None, list[dict[str, Any]]] | None:
    """(content, tool calls) of a finished output under `mode`; None if it holds no calls, or calls a function not
    `offered` (the output is then content, as one whose calls do not parse: a client never gets a call to a function
    it did not offer). Call ids are `call_id_prefix` plus the call's position, so the same job always answers with
    the same ids."""
    parsed = parsed_output(mode, text)
    if parsed is None or offered is not None and any(call.name not in offered for call in parsed.calls):
        return None
    return parsed.content, [{"id": f"{call_id_prefix}{i}", "type": "function",
                             "function": {"name": call.name, "arguments": call.arguments}}
                            for i, call in enumerate(parsed.calls)]
