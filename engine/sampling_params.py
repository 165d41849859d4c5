"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from core.structured_outputs import only_kind, set_fields

MAX_LOGPROBS = 20
MAX_N = 64
# Below this temperature, dividing the logits overflows fp32 (and 1e-40 is subnormal): decode greedily.
MIN_SAMPLING_TEMPERATURE = 1e-5
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # logits are divided or multiplied by it
LENGTH_PENALTY_RANGE = (-10.0, 10.0)  # beam scores divide by length ** length_penalty
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _token_id(key: object) -> object:
    """A logit_bias key as a token id: an int, or its decimal text (JSON's keys are text); anything else as given,
    for the check to name."""
    return int(key) if isinstance(key, str) and key.isdecimal() else key


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """vLLM's class of the same name, for ``SamplingParams(structured_outputs=...)``: exactly one of a JSON schema,
    a regex, a list of choices, a Lark or GBNF grammar, or any JSON object (``json_object=True``)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The fields that are set, as SamplingParams keeps them."""
        return set_fields(asdict(self))


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request: decoding knobs, stop conditions and outputs wanted."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # False: special tokens' text stays in the output (vLLM's field)
    include_stop_str_in_output: bool = False  # True: the stop string or stop token's text ends the text (vLLM's)
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the prompt's tokens' logprobs too (and this many alternatives), as vLLM's
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    beam_width: int = 1
    length_penalty: float = 1.0
    # vLLM's logit_bias: added to these tokens' logits before sampling (keys may be decimal text, as JSON keeps them)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be sampled
    bad_words: list[str] = field(default_factory=list)  # vLLM's: words the output may not contain (bad_words.py)
    # vLLM's structured outputs: exactly one of {"json": schema, "regex": ..., "choice": [...], "grammar": Lark or
    # GBNF, "json_object": True} (or a StructuredOutputsParams); the output then follows it
    # (engine/structured_output.py)
    structured_outputs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_token_id(key): value for key, value in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, StructuredOutputsParams):
            self.structured_outputs = self.structured_outputs.as_dict()
        self._validate()

    def _validate(self) -> None:
        _require(
            _is_int(self.beam_width) and 1 <= self.beam_width <= MAX_N,
            f"beam_width must be an integer between 1 and {MAX_N}, got {self.beam_width!r}",
        )
        low, high = LENGTH_PENALTY_RANGE
        _require(
            _is_finite_number(self.length_penalty) and low <= self.length_penalty <= high,
            f"length_penalty must be between {low} and {high}, got {self.length_penalty!r}",
        )
        _require(
            self.beam_width == 1 or self.n == 1,
            f"n must be 1 with beam search (the beam_width best beams are returned), got n={self.n!r}",
        )
        _require(
            _is_int(self.n) and 1 <= self.n <= MAX_N,
            f"n must be an integer between 1 and {MAX_N}, got {self.n!r}",
        )
        _require(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        _require(
            _is_finite_number(self.temperature) and self.temperature >= 0,
            f"temperature must be a finite number >= 0, got {self.temperature!r}",
        )
        _require(
            _is_finite_number(self.top_p) and 0 < self.top_p <= 1,
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        _require(
            _is_int(self.top_k) and self.top_k >= -1,
            f"top_k must be -1 or 0 (disabled) or an integer >= 1, got {self.top_k!r}",
        )
        _require(
            _is_finite_number(self.min_p) and 0 <= self.min_p <= 1,
            f"min_p must be in [0, 1], got {self.min_p!r}",
        )
        _require(
            self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
            f"seed must be None or an integer between {SEED_RANGE[0]} and {SEED_RANGE[1]}, got {self.seed!r}",
        )
        _require(
            all(isinstance(s, str) and s for s in self.stop),
            f"stop must be a list of non-empty strings, got {self.stop!r}",
        )
        _require(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}",
        )
        _require(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens!r}",
        )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _require(isinstance(getattr(self, name), bool), f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                f"{name} must be None or an integer between 0 and {MAX_LOGPROBS}, got {value!r}",
            )
        if self.logit_bias is not None:
            _require(isinstance(self.logit_bias, dict), f"logit_bias must be None or a dict, got {self.logit_bias!r}")
            bad = next(((k, v) for k, v in self.logit_bias.items() if not (_is_int(k) and k >= 0
                                                                          and _is_finite_number(v))), None)
            _require(bad is None, f"logit_bias must map token ids >= 0 to finite numbers, got {bad!r}")
        if self.allowed_token_ids is not None:
            _require(len(self.allowed_token_ids) > 0 and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                     f"allowed_token_ids must be a non-empty list of token ids >= 0, got {self.allowed_token_ids!r}")
        _require(
            all(isinstance(word, str) and word.strip() for word in self.bad_words),
            f"bad_words must be a list of strings that are not blank, got {self.bad_words!r}",
        )
        _require(not self.bad_words or not self.is_beam_search, "bad_words cannot be combined with beam search "
                 "(beam_width > 1)")
        for name in ("logit_bias", "allowed_token_ids"):
            _require(getattr(self, name) is None or not self.is_beam_search,
                     f"{name} cannot be combined with beam search (beam_width > 1)")
        if self.structured_outputs is not None:
            _require(isinstance(self.structured_outputs, dict),
                     f"structured_outputs must be None or a dict, got {type(self.structured_outputs).__name__}")
            only_kind(self.structured_outputs)
            _require(not self.is_beam_search, "structured_outputs cannot be combined with beam search (beam_width > 1)")
        low, high = REPETITION_PENALTY_RANGE
        _require(
            _is_finite_number(self.repetition_penalty) and low <= self.repetition_penalty <= high,
            f"repetition_penalty must be between {low} and {high}, got {self.repetition_penalty!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(
                _is_finite_number(value) and -2 <= value <= 2,
                f"{name} must be between -2 and 2, got {value!r}",
            )

    @property
    def is_beam_search(self) -> bool:
        """True when the request keeps ``beam_width > 1`` beams instead of sampling."""
        return self.beam_width > 1

    @property
    def greedy(self) -> bool:
        """True when decoding takes the arg-max token (temperature 0, or too small to divide by)."""
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def edits_logits(self) -> bool:
        """True when sampling changes this request's logits before drawing (penalties, bias, allowed tokens)."""
        return self.has_penalties or self.logit_bias is not None or self.allowed_token_ids is not None

    @property
    def has_penalties(self) -> bool:
        """True when any repetition/presence/frequency penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
