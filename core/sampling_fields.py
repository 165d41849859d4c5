"""The one declaration of the sampling parameters: each one's default, the range the service accepts, and the range
the engine accepts.

`api/schemas.py` builds its fields from it; the engine (`engine/sampling_params.py`, which stands on nothing of the
service) and the OpenAI schemas are tested against it (tests/test_sampling_fields.py). The service's ranges lie
inside the engine's: what the API accepts, a worker can run; the engine's are wider where the offline `LLM` allows
more (64 completions, repetition penalties up to 100, seeds up to 2**64 - 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Bounds:
    """A closed range [low, high] (open at low when `low_exclusive`); None is unbounded on that side."""

    low: int | float | None = None
    high: int | float | None = None
    low_exclusive: bool = False

    def contains(self, other: Bounds) -> bool:
        """Whether every value inside `other` is inside this range."""
        low_ok = self.low is None or (other.low is not None and (
            other.low > self.low or (other.low == self.low and (other.low_exclusive or not self.low_exclusive))))
        high_ok = self.high is None or (other.high is not None and other.high <= self.high)
        return low_ok and high_ok


@dataclass(frozen=True, slots=True)
class SamplingField:
    """One sampling parameter: its default, the service's and the engine's range, and what both refuse."""

    name: str
    default: Any
    service: Bounds  # of the value, or of each item of a list
    engine: Bounds
    max_items: int | None = None  # a list's length the service accepts (the engine takes any)
    description: str | None = None


_SEED_MAX = 2**63 - 1
_TOKENS_MAX = 2**31 - 1
SAMPLING_FIELDS: dict[str, SamplingField] = {field.name: field for field in (
    SamplingField("n", 1, Bounds(1, 64), Bounds(1, 64)),  # and at most max_num_seqs (checked with the job)
    # the model's context is the real limit (checked with the prompt, naming both); this bound only keeps the number
    # a 32-bit int, so a long-context model's whole window can be asked for, as vLLM allows
    SamplingField("max_tokens", 16, Bounds(1, _TOKENS_MAX), Bounds(1)),
    SamplingField("temperature", 1.0, Bounds(0.0, 10.0), Bounds(0.0)),
    SamplingField("top_p", 1.0, Bounds(0.0, 1.0, low_exclusive=True), Bounds(0.0, 1.0, low_exclusive=True)),
    SamplingField("top_k", -1, Bounds(-1, 100_000), Bounds(-1)),  # 0 and -1 both leave every token in, as vLLM
    SamplingField("min_p", 0.0, Bounds(0.0, 1.0), Bounds(0.0, 1.0)),
    # torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; the service takes a signed 64-bit int, as vLLM does
    SamplingField("seed", None, Bounds(-(2**63), _SEED_MAX), Bounds(-(2**63), 2**64 - 1)),
    SamplingField("stop", None, Bounds(), Bounds(), max_items=64),
    SamplingField("stop_token_ids", None, Bounds(0), Bounds(0), max_items=64),
    SamplingField("ignore_eos", False, Bounds(), Bounds()),
    SamplingField("skip_special_tokens", True, Bounds(), Bounds(),
                  description="false: special tokens' text (tool-call markers of some models) stays in the output"),
    SamplingField("include_stop_str_in_output", False, Bounds(), Bounds(),
                  description="the stop string (or stop token's text) that ended the output stays at its end"),
    SamplingField("min_tokens", 0, Bounds(0, _TOKENS_MAX), Bounds(0)),  # both also cap it at max_tokens
    SamplingField("logprobs", None, Bounds(0, 20), Bounds(0, 20)),
    SamplingField("prompt_logprobs", None, Bounds(0, 20), Bounds(0, 20),
                  description="the prompt's tokens' logprobs too, with this many alternatives each"),
    # logits are divided or multiplied by it: below 0.01 they overflow
    SamplingField("repetition_penalty", 1.0, Bounds(0.01, 10.0), Bounds(0.01, 100.0)),
    SamplingField("presence_penalty", 0.0, Bounds(-2.0, 2.0), Bounds(-2.0, 2.0)),
    SamplingField("frequency_penalty", 0.0, Bounds(-2.0, 2.0), Bounds(-2.0, 2.0)),
    SamplingField("beam_width", 1, Bounds(1, 16), Bounds(1, 64),
                  description="beam search with this many beams when > 1"),
    SamplingField("length_penalty", 1.0, Bounds(-10.0, 10.0), Bounds(-10.0, 10.0),
                  description="beam score = logprob / length**penalty"),
    # the service takes biases in [-100, 100] (OpenAI's range; its OpenAI routes clamp to it, as vLLM's)
    SamplingField("logit_bias", None, Bounds(), Bounds(), max_items=1024,
                  description="token id -> bias in [-100, 100] added to its logit before sampling"),
    SamplingField("allowed_token_ids", None, Bounds(0), Bounds(0), max_items=16_384,
                  description="only these token ids may be sampled"),
    SamplingField("bad_words", None, Bounds(), Bounds(), max_items=64,
                  description="words the output may not contain (each word's last token is masked after the rest)"),
    SamplingField("structured_outputs", None, Bounds(), Bounds(),
                  description="the output follows a JSON schema, regex, choice or grammar"),
)}
