"""Structured outputs: what a request may constrain its output to, and the llguidance grammar each one compiles to.

Torch-free, so that the API checks a request's grammar when it is created (a 4xx naming the field, before the job
exists) and the engine builds its token masks from the very same grammar text. llguidance (the library behind
vLLM's "guidance" backend) parses JSON schemas, regexes and Lark/GBNF grammars; this module only maps vLLM's names
onto it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

# vLLM's StructuredOutputsParams fields, each one way to constrain the output; a request sets exactly one
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's options beside the kind: no whitespace between JSON tokens (compact JSON, fewer tokens for a small model
# to wander in)
OPTIONS = ("disable_any_whitespace",)
# any JSON object, as vLLM's json_object (OpenAI's response_format {"type": "json_object"})
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
# llguidance converts a grammar recursively, native stack frames per nested rule: a chain of rules within a request's
# 400 000 characters overflows a thread's default 8 MiB stack, a segfault that ends the process (found with 3 000
# rules), not an exception. Compiles run on a thread with this much stack (reserved address space, touched only as
# deep as a grammar goes; the longest chain a request can carry, 19 000 rules, fits).
COMPILE_STACK_BYTES = 512 * 2**20
_stack_size_lock = threading.Lock()
T = TypeVar("T")


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
        except RecursionError:
            raise StructuredOutputError("json", "is nested too deeply") from None
    if not isinstance(value, (dict, bool)):
        raise StructuredOutputError("json", f"must be a JSON schema (an object), got {type(value).__name__}")
    return value


def checked_value(kind: str, value: Any) -> Any:
    """The constraint's value with its shape checked (a JSON schema given as text parsed), without building its
    grammar: cheap enough for a request's validation on the event loop."""
    if kind == "json":
        return _json_schema(value)
    if kind == "json_object":
        if value is not True:
            raise StructuredOutputError(kind, f"must be true, got {value!r}")
    elif kind == "regex":
        if not isinstance(value, str) or not value:
            raise StructuredOutputError(kind, "must be a non-empty regular expression")
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise StructuredOutputError(kind, "must be a non-empty list of non-empty strings")
    elif not isinstance(value, str) or not value.strip():
        raise StructuredOutputError(kind, "must be a non-empty Lark or GBNF grammar")
    return value


def _grammar_text(kind: str, value: Any, compact: bool) -> str:
    """The llguidance grammar of a checked value."""
    overrides: Any = {"whitespace_flexible": False} if compact else None
    if kind in ("json", "json_object"):
        schema = ANY_JSON_OBJECT if kind == "json_object" else value
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=overrides)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    try:  # Lark as it is; llama.cpp's GBNF converted to Lark
        return LLMatcher.grammar_from_lark(any_to_lark(value))
    except Exception as exc:  # the converter raises what its parser raises
        raise StructuredOutputError(kind, f"is not a valid GBNF grammar: {exc}") from None


def _validated_grammar(kind: str, value: Any, compact: bool) -> tuple[str, str]:
    grammar = _grammar_text(kind, value, compact)
    return grammar, LLMatcher.validate_grammar(grammar)


def on_compile_stack(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``function(*args, **kwargs)`` run on a thread of its own with ``COMPILE_STACK_BYTES`` of stack; its result
    returned, its exception raised here. The calling thread waits (llguidance releases the GIL meanwhile)."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, function(*args, **kwargs)))
        except BaseException as exc:  # handed to the caller
            outcome.append((False, exc))

    with _stack_size_lock:  # the size applies to the threads started while it is set: only this one
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    succeeded, value = outcome[0]
    if not succeeded:
        raise value
    return value


def grammar_of(spec: dict[str, Any]) -> tuple[str, str]:
    """The kind `spec` uses and its llguidance grammar, checked; StructuredOutputError names the field otherwise."""
    kind = only_kind(spec)
    value = checked_value(kind, spec[kind])
    grammar, error = on_compile_stack(_validated_grammar, kind, value, spec.get("disable_any_whitespace", False))
    if error:
        raise StructuredOutputError(kind, f"cannot be used: {error.strip()}")
    return kind, grammar
