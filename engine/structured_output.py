"""Constrained decoding: each sequence with structured outputs walks its grammar token by token, and the sampler
keeps only the tokens the grammar allows next.

The grammar (core/structured_outputs.py) compiles against the model's tokenizer once per distinct constraint: a
small LRU keeps compiled matchers and every sequence starts from a deep copy (microseconds), so a service sending
the same schema with every request compiles it once. Masks are computed on the host, one bit per token, only for
the rows that carry a grammar; unconstrained steps pay nothing.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
import torch

from core.structured_outputs import StructuredOutputError, grammar_of, on_compile_stack, only_kind

COMPILED_GRAMMARS_KEPT = 64
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarState:
    """Where one sequence stands in its grammar: the tokens it took so far."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def advance(self, token_id: int, spec: dict[str, Any]) -> None:
        """Advance past a sampled token; StructuredOutputError naming the constraint ``spec`` when the grammar does
        not take it: the grammar broke down (llguidance gave up on it), or the token is outside it (a row left with
        no allowed token, its stop tokens suppressed by min_tokens)."""
        if self.matcher.consume_token(token_id) and not self.matcher.is_error():  # it takes a token it then fails on
            return
        # llguidance's first line says why (a dump of its state follows)
        why = self.matcher.get_error().strip().splitlines()[0] if self.matcher.is_error() else \
            f"token {token_id} is outside it"
        raise StructuredOutputError(only_kind(spec), f"could not be followed: {why}")

    @property
    def is_complete(self) -> bool:
        """True once the grammar is satisfied and allows nothing more (nothing but end of sequence)."""
        return self.matcher.is_stopped()

    def copy(self) -> GrammarState:
        """An independent state at the same place (for a forked sequence)."""
        return GrammarState(self.matcher.deep_copy())

    def replay(self, token_ids: list[int]) -> None:
        """Start over and take ``token_ids`` (a rolled-back step's sequence, restored to its earlier tokens)."""
        self.matcher.reset()
        self.matcher.consume_tokens(token_ids)


class TokenizerMismatchError(RuntimeError):
    """llguidance reads the model's tokens as other bytes than its tokenizer decodes them to: no grammar could be
    followed (the server's model, not a request, is at fault)."""


# spaces, punctuation, a digit and a two-byte character: what byte-level and sentencepiece tokenizers spell apart
TOKENIZER_PROBE = " a b, 1 é"


def check_tokens_read_alike(tokenizer: llguidance.LLTokenizer, hf_tokenizer: Any) -> None:
    """TokenizerMismatchError unless llguidance decodes ``TOKENIZER_PROBE``'s tokens to the bytes the tokenizer
    decodes them to. transformers 5.17 converted SmolLM2's GGUF tokenizer (byte-level BPE) with sentencepiece
    byte-fallback pieces: llguidance then read "Ġb" as those two bytes and refused every token with a space."""
    ids = hf_tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False)
    expected = hf_tokenizer.decode(ids, clean_up_tokenization_spaces=False).encode()
    got = tokenizer.decode_bytes(ids)
    # a sentencepiece tokenizer's decode drops the space its first piece begins with ("▁a"), llguidance keeps it
    if got.lstrip() != expected.lstrip():
        raise TokenizerMismatchError(
            f"structured outputs cannot be used with this model: llguidance reads the tokens {ids} of "
            f"{TOKENIZER_PROBE!r} as {got!r}, the tokenizer as {expected!r} (a GGUF tokenizer converted by "
            "transformers < 5.25 does this: delete the model's converted folder in the cache directory "
            "(PAGEDSERVE_CACHE_DIR, default ~/.cache/pagedserve) and run `pagedserve prepare` with "
            "transformers >= 5.25)")


@functools.cache
def _executor() -> llguidance.LLExecutor:
    # the masks are filled while torch's threads idle (the sampler waits for them): as many threads as torch's
    return llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))


def allowed_tokens(states: list[GrammarState], vocab_size: int) -> torch.Tensor:
    """``[len(states), vocab_size]`` booleans on the CPU: which tokens each state allows next (the rows filled in
    parallel by llguidance's thread pool)."""
    # a prompt forking into n samples has n rows on one state: each state is filled once (and must be: the pool
    # borrows each matcher mutably)
    unique = list({id(state): state for state in states}.values())
    words = torch.empty(len(unique), -(-vocab_size // 32), dtype=torch.int32)
    row_bytes = words.shape[1] * words.element_size()
    _executor().unsafe_compute_mask_ptr([(state.matcher, i) for i, state in enumerate(unique)],
                                        words.data_ptr(), row_bytes, len(unique))
    if len(unique) < len(states):
        row_of = {id(state): i for i, state in enumerate(unique)}
        words = words[[row_of[id(state)] for state in states]]
    bits = (words[:, :, None] >> _BIT_SHIFTS) & 1
    return bits.reshape(len(states), -1)[:, :vocab_size].bool()


class GrammarCompiler:
    """Compiles structured-output constraints against the model's tokenizer and hands out grammar states.

    Thread-safe: a service compiles a request's grammar on the request's own thread (llguidance drops the GIL while
    it compiles), so that a large schema never holds up the engine's steps; the engine thread then finds it kept.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (the model's, which may pad the tokenizer's)
        self._eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built at the first constraint (about a second)
        self._mismatch: TokenizerMismatchError | None = None  # why that tokenizer was refused, once found
        # by constraint (its JSON text); never advanced, only copied from
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._mismatch is not None:  # the model cannot change: every later constraint is refused alike
                raise self._mismatch
            if self._tokenizer is None:
                tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_ids)
                try:
                    check_tokens_read_alike(tokenizer, self._hf_tokenizer)
                except TokenizerMismatchError as mismatch:
                    self._mismatch = mismatch
                    raise
                self._tokenizer = tokenizer
            return self._tokenizer

    def is_compiled(self, spec: dict[str, Any]) -> bool:
        """Whether the grammar of ``spec`` is kept compiled (``start`` then costs a copy)."""
        with self._lock:
            return _key(spec) in self._compiled

    def compile(self, spec: dict[str, Any]) -> llguidance.LLMatcher:
        """The compiled start state of the grammar ``spec`` describes (compiled now unless kept); a
        StructuredOutputError names the field this model cannot use. Kept by the spec itself, so that finding a
        kept grammar (the engine thread, after the worker compiled it) neither converts nor checks it again."""
        key = _key(spec)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        kind, grammar = grammar_of(spec)
        compiled = on_compile_stack(llguidance.LLMatcher, self._llg_tokenizer(), grammar, log_level=0)  # unlocked
        if compiled.is_error():
            raise StructuredOutputError(kind, f"cannot be used with this model: {compiled.get_error().strip()}")
        with self._lock:
            self._compiled[key] = compiled
            if len(self._compiled) > COMPILED_GRAMMARS_KEPT:
                self._compiled.popitem(last=False)
        return compiled

    def start(self, spec: dict[str, Any]) -> GrammarState:
        """A fresh state of the grammar ``spec`` describes; StructuredOutputError names the field it cannot use."""
        return GrammarState(self.compile(spec).deep_copy())


def _key(spec: dict[str, Any]) -> str:
    """One text per constraint, whatever the order of its fields (and of a schema's keys)."""
    return json.dumps(spec, sort_keys=True)
