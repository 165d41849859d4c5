"""vLLM's ``bad_words``: words the output may not contain.

Each word is tokenized as it would start the text and as it would follow a space (BPE vocabularies spell the two
differently); a token sequence is banned by masking its last token wherever the output already ends with the
tokens before it (a one-token word is masked always). The output alone is checked, as vLLM does: a word that began
in the prompt may still be completed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def bad_words_token_ids(tokenizer: Any, words: Sequence[str], vocab_size: int) -> list[list[int]]:
    """The distinct token sequences that spell ``words`` (leading spaces dropped, then with one space and without),
    leaving out any with an id past the logits."""
    sequences: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and all(0 <= i < vocab_size for i in ids) and ids not in sequences:
                sequences.append(ids)
    return sequences


def banned_next_tokens(sequences: Sequence[Sequence[int]], token_ids: Sequence[int], prompt_len: int) -> list[int]:
    """The tokens that would complete one of ``sequences`` right after the output (``token_ids`` past
    ``prompt_len``)."""
    banned = []
    for ids in sequences:
        prefix = len(ids) - 1
        if prefix == 0 or (prefix <= len(token_ids) - prompt_len and list(token_ids[-prefix:]) == list(ids[:-1])):
            banned.append(ids[-1])
    return banned
