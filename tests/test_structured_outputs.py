"""core.structured_outputs compiles the largest grammars a request may carry without overflowing a native stack."""

from __future__ import annotations

import threading

import pytest

from core.structured_outputs import StructuredOutputError, grammar_of, on_compile_stack


def _chain(rules: int) -> str:
    return "start:r0\n" + "\n".join(f'r{i}:"a" r{i + 1}|"b"' for i in range(rules)) + f'\nr{rules}:"z"'


def test_a_grammar_of_thousands_of_chained_rules_compiles() -> None:
    """llguidance recurses per nested rule: on a thread's default stack 3 000 of these were a segfault of the API
    process (and `pagedserve up` stopped every process). 19 000 is about the most 400 000 characters can chain."""
    grammar = _chain(19_000)
    assert len(grammar) <= 400_000
    kind, compiled = grammar_of({"grammar": grammar})
    assert kind == "grammar" and compiled


def test_the_compile_thread_passes_results_and_exceptions_back() -> None:
    assert on_compile_stack(lambda: threading.current_thread().name) == "grammar-compile"
    with pytest.raises(StructuredOutputError, match="structured_outputs.regex"):
        grammar_of({"regex": "[0-9"})
