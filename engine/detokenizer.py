"""Incremental detokenisation and stop-string matching for generated tokens."""

from __future__ import annotations

from typing import Any

from engine.sequence import Sequence

# tokens of left context decoded with the new ones, so word-joining rules see their neighbours
_CONTEXT_TOKENS = 5


def start_offsets(seq: Sequence) -> None:
    """Position the decode window at the end of the prompt."""
    seq.read_offset = seq.prompt_len
    seq.prefix_offset = max(seq.prompt_len - _CONTEXT_TOKENS, 0)


def decode_new_text(tokenizer: Any, seq: Sequence, final: bool = False, skip_special_tokens: bool = True,
                    drop_last: bool = False) -> str:
    """Append and return the text the latest tokens add (held back while a character is
    incomplete, unless ``final``); ``drop_last`` leaves out the last token, a stop token, as vLLM does."""
    end = len(seq.token_ids) - 1 if drop_last else len(seq.token_ids)
    prefix = tokenizer.decode(seq.token_ids[seq.prefix_offset : seq.read_offset],
                              skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(seq.token_ids[seq.prefix_offset : end], skip_special_tokens=skip_special_tokens)
    if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
        return ""
    delta = full[len(prefix) :]
    seq.prefix_offset = seq.read_offset
    seq.read_offset = end
    seq.text += delta
    return delta


def find_stop_string(text: str, delta_len: int, stop: list[str]) -> tuple[int, int] | None:
    """Where in ``text`` the earliest stop string that the latest delta completed starts and ends."""
    best: tuple[int, int] | None = None
    for s in stop:
        search_from = max(0, len(text) - delta_len - len(s) + 1)
        index = text.find(s, search_from)
        if index != -1 and (best is None or index < best[0]):
            best = index, index + len(s)
    return best
