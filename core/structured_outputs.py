"""Structured outputs: what a request may constrain its output to, and the llguidance grammar each one compiles to.

Torch-free, so that the API checks a request's grammar when it is created (a 4xx naming the field, before the job
exists) and the engine builds its token masks from the very same grammar text. llguidance (the library behind
vLLM's "guidance" backend) parses JSON schemas, regexes and Lark/GBNF grammars; this module only maps vLLM's names
onto it.
"""

from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

# vLLM's StructuredOutputsParams fields, each one way to constrain the output; a request sets exactly one
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's options beside the kind: no whitespace between JSON tokens (compact JSON, fewer tokens for a small model
# to wander in)
OPTIONS = ("disable_any_whitespace",)
# any JSON object, as vLLM's json_object (OpenAI's response_format {"type": "json_object"})
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


class StructuredOutputError(ValueError):
    """A structured-output constraint that cannot be used; `field` is its name (``structured_outputs.regex``…)."""

    def __init__(self, kind: str, reason: str) -> None:
        self.field, self.reason = f"structured_outputs.{kind}", reason  # reason: the message without the field
        super().__init__(f"{self.field} {reason}")


def set_fields(spec: dict[str, Any]) -> dict[str, Any]:
    """The fields of `spec` that are set: None and False (an option off, json_object false) are unset."""
    return {name: value for name, value in spec.items() if value is not None and value is not False}


def only_kind(spec: dict[str, Any]) -> str:
    """The one kind of constraint `spec` sets (its keys among KINDS; a None or False value is unset)."""
    unknown = sorted(set(spec) - set(KINDS) - set(OPTIONS))
    if unknown:
        raise StructuredOutputError(unknown[0], f"is not a structured output field; use one of "
                                                f"{', '.join(KINDS)} (and {', '.join(OPTIONS)})")
    for option in OPTIONS:
        if not isinstance(spec.get(option, False), bool):
            raise StructuredOutputError(option, f"must be true or false, got {spec[option]!r}")
    chosen = [kind for kind in KINDS if kind in set_fields(spec)]
    if len(chosen) != 1:
        raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}, got "
                         f"{', '.join(chosen) if chosen else 'none'}")
    return chosen[0]


def _json_schema(value: Any) -> dict[str, Any] | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise StructuredOutputError("json", f"is not valid JSON: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise StructuredOutputError("json", f"must be a JSON schema (an object), got {type(value).__name__}")
    return value


def _grammar_text(kind: str, value: Any, compact: bool) -> str:
    overrides: Any = {"whitespace_flexible": False} if compact else None
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(json.dumps(_json_schema(value)), overrides=overrides)
    if kind == "json_object":
        if value is not True:
            raise StructuredOutputError(kind, f"must be true, got {value!r}")
        return LLMatcher.grammar_from_json_schema(json.dumps(ANY_JSON_OBJECT), overrides=overrides)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise StructuredOutputError(kind, "must be a non-empty regular expression")
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise StructuredOutputError(kind, "must be a non-empty list of non-empty strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if not isinstance(value, str) or not value.strip():
        raise StructuredOutputError(kind, "must be a non-empty Lark or GBNF grammar")
    try:  # Lark as it is; llama.cpp's GBNF converted to Lark
        return LLMatcher.grammar_from_lark(any_to_lark(value))
    except Exception as exc:  # the converter raises what its parser raises
        raise StructuredOutputError(kind, f"is not a valid GBNF grammar: {exc}") from None


def grammar_of(spec: dict[str, Any]) -> tuple[str, str]:
    """The kind `spec` uses and its llguidance grammar, checked; StructuredOutputError names the field otherwise."""
    kind = only_kind(spec)
    grammar = _grammar_text(kind, spec[kind], compact=spec.get("disable_any_whitespace", False))
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise StructuredOutputError(kind, f"cannot be used: {error.strip()}")
    return kind, grammar
