"""Tokens of text: the ids of a piece, and the first or last n of a long text without tokenizing all of it."""
from __future__ import annotations

import functools

IGNORE = -100  # the label of a position the loss leaves out
MARGIN_TOKENS = 64  # first_ids/last_ids tokenize this many longest tokens' worth of characters past what they keep, twice


def ids(tokenizer, text: str) -> list[int]:
    return many_ids(tokenizer, [text])[0] if text else []


def many_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """`ids` of each text, in one call to the tokenizer: to its Rust backend's batched call without
    character offsets where it has one (the same ids, a fifth to a third less time), else through transformers."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def firsts(tokenizer, texts: list[str], ns: list[int | None]) -> list[list[int]]:
    """`first_ids(tokenizer, text, n)` of each text (n None: `ids`, all of it): those short enough
    tokenized whole in one call."""
    whole = [k for k, (text, n) in enumerate(zip(texts, ns))
             if n is None or n > 0 and (len(text) <= bound(tokenizer, n) or not getattr(tokenizer, "is_fast", False))]
    got = dict(zip(whole, many_ids(tokenizer, [texts[k] for k in whole])))
    return [got[k][:n] if k in got else first_ids(tokenizer, text, n) for k, (text, n) in enumerate(zip(texts, ns))]


def bound(tokenizer, n: int) -> int:
    """Characters beyond which first_ids and last_ids tokenize only part of a text for n tokens."""
    return n * longest_token(tokenizer) + 2 * MARGIN_TOKENS * longest_token(tokenizer)


@functools.lru_cache(maxsize=8)
def longest_token(tokenizer) -> int:
    """Characters in the longest token string of the tokenizer's vocabulary (added tokens too).
    A byte-level vocabulary spells each byte of the text as one character of its own, a
    SentencePiece one each character as at least one: no token covers more characters of a text."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def first_ids(tokenizer, text: str, n: int) -> list[int]:
    """`ids(tokenizer, text)[:n]`, without tokenizing more of a long text than can matter (a
    5 MB line tokenized whole took 1.8 GB). The first n tokens cover at most n x longest_token
    characters, so only that many, and a margin, are tokenized. The cut may change the tokens just
    before it (a word cut in two), so the n kept ones must end a margin before the cut, by the
    tokenizer's own offsets; if not (a normalizer that merges characters) or without offsets (a slow
    tokenizer), the whole text is tokenized after all."""
    if n <= 0:
        return []
    longest = longest_token(tokenizer)
    margin = MARGIN_TOKENS * longest
    limit = bound(tokenizer, n)
    if len(text) <= limit or not getattr(tokenizer, "is_fast", False):
        return ids(tokenizer, text)[:n]
    encoded = tokenizer(text[:limit], add_special_tokens=False, return_offsets_mapping=True)
    got, offsets = encoded["input_ids"], encoded["offset_mapping"]
    if len(got) >= n and offsets[n - 1][1] + longest <= limit - margin:
        return got[:n]
    return ids(tokenizer, text)[:n]


def last_ids(tokenizer, text: str, n: int) -> list[int]:
    """`ids(tokenizer, text)[-n:]` likewise (first_ids, from the other end): only the last n x
    longest_token characters and a margin are tokenized. The cut may change the tokens of the
    pre-token it falls in, which BPE merges from its start (a run of spaces is split according to
    where it begins), so the n kept tokens must begin after that pre-token and a margin after the
    cut; if not (a pre-token longer than that), with a normalizer (its offsets are not the text's) or
    without offsets, the whole text is tokenized."""
    if n <= 0:
        return []
    longest = longest_token(tokenizer)
    margin = MARGIN_TOKENS * longest
    limit = bound(tokenizer, n)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if len(text) <= limit or not getattr(tokenizer, "is_fast", False) or backend is None or backend.normalizer \
            or backend.pre_tokenizer is None:
        return ids(tokenizer, text)[-n:]
    tail = text[-limit:]
    split = backend.pre_tokenizer.pre_tokenize_str(tail)
    encoded = tokenizer(tail, add_special_tokens=False, return_offsets_mapping=True)
    got, offsets = encoded["input_ids"], encoded["offset_mapping"]
    if len(split) > 1 and len(got) >= n and offsets[-n][0] >= max(split[1][1][0], margin + longest):
        return got[-n:]
    return ids(tokenizer, text)[-n:]
