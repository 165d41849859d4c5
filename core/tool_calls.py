"""Forced tool calls (OpenAI's tool_choice "required" or a named function), as vLLM makes them: the output is
constrained to a JSON schema built from the tools, and the finished text becomes the message's tool_calls.

Torch-free: the API builds the constraint when the request arrives; the response builders (API, batch output files)
turn a job's text back into tool calls.
"""

from __future__ import annotations

import json
from typing import Any

REQUIRED = "required"
NAMED_PREFIX = "function:"  # a job's tool-choice mode for a named function: "function:<name>"
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


def tool_calls(mode: str, text: str, call_id_prefix: str) -> list[dict[str, Any]] | None:
    """The tool calls a finished output holds under `mode`; None if it is not whole (cut off by max_tokens).
    Call ids are `call_id_prefix` plus the call's position, so the same job always answers with the same ids."""
    if mode.startswith(NAMED_PREFIX):
        calls = [(mode.removeprefix(NAMED_PREFIX), text)]
    else:
        try:
            parsed = json.loads(text)
            calls = [(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in parsed]
        except (ValueError, TypeError, KeyError):
            return None
    return [{"id": f"{call_id_prefix}{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(calls)]
