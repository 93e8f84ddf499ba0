"""Dialogue-summarization data: load rows, build prompts, tokenize once.

A row has a dialogue and a summary. The prompt goes through the tokenizer's chat template when it
has one (else a plain template); the loss covers the summary tokens only (labels -100 elsewhere);
an over-long example is cut inside the dialogue, so the summary always survives. Nothing here
knows about processes; batches.py cuts the tokenized examples into steps and forwards.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import tempfile
from importlib import resources
from pathlib import Path

from ddptune.config import DataConfig, parse_rows

IGNORE = -100
PLAIN_TEMPLATE = "{instruction}\n\n### Dialogue:\n{dialogue}\n\n### Summary:\n"
_MARK = "\x00DIALOGUE\x00"


# ---------------------------------------------------------------------------------------------
# Rows


def read_rows(source: str) -> list[dict]:
    """All rows of `demo`, a .json list file, a .jsonl file, or `hub:ID[:SPLIT]`. A file is read
    once per process (train and val are often slices of one file): later calls get the same rows."""
    key = (source, Path(source).stat().st_mtime_ns if Path(source).is_file() else None)
    if key not in _ROWS:
        _ROWS.clear()  # keep one file's rows at most
        _ROWS[key] = _read_rows(source)
    return _ROWS[key]


_ROWS: dict = {}


def _read_rows(source: str) -> list[dict]:
    if source == "demo":
        text = resources.files("ddptune").joinpath("demo_data/demo.jsonl").read_text(encoding="utf-8")
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if source.startswith("hub:"):
        from datasets import load_dataset  # optional; only for hub datasets

        ident, _, split = source[4:].partition(":")
        return [dict(r) for r in load_dataset(ident, split=split or "train")]
    path = Path(source)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    rows = json.loads(text)
    if not isinstance(rows, list):
        raise ValueError(f"{source} holds a JSON {type(rows).__name__}, not a list of rows")
    return rows


def load_split(source: str, rows: str | None, d: DataConfig) -> list[dict]:
    """The selected rows as {"id", "dialogue", "summary"} dicts."""
    data = read_rows(source)
    out = []
    for i, r in enumerate(data):
        out.append({"id": str(r.get("id", i)), "dialogue": r[d.dialogue_column], "summary": r[d.summary_column]})
    return out[parse_rows(rows)]


def check(d: DataConfig) -> tuple[list[str], int | None]:
    """(problems with the data files and columns, the number of training rows selected or None
    when unknown before loading: hub data). Reads each file once; tokenizes nothing."""
    problems, n_train = [], None
    for field, source, rows in (("data.train", d.train, d.train_rows), ("data.val", d.val, d.val_rows)):
        if source is None:
            continue
        if source.startswith("hub:"):
            if importlib.util.find_spec("datasets") is None:
                problems.append(f"{field}: {source} needs the datasets package (pip install 'ddptune[hub]', and internet), "
                                "or give a local .json/.jsonl file")
            continue
        if source != "demo" and not Path(source).is_file():
            problems.append(f"{field}: file {source!r} not found (give a .json/.jsonl path, `demo`, or hub:ID)")
            continue
        try:
            data = read_rows(source)
        except (ValueError, json.JSONDecodeError) as e:
            problems.append(f"{field}: cannot read {source} ({str(e).splitlines()[0]}; expected a JSON list or JSON lines)")
            continue
        if not data:
            problems.append(f"{field}: {source} holds no rows (give a JSON list or JSON lines of rows with "
                            f"{d.dialogue_column!r} and {d.summary_column!r} text)")
            continue
        columns = [column_problem(field, source, data, col, key)
                   for col, key in ((d.dialogue_column, "dialogue_column"), (d.summary_column, "summary_column"))]
        problems += [p for p in dict.fromkeys(columns) if p]  # a row that is not an object: said once
        selected = len(data[parse_rows(rows)])
        if not selected:
            problems.append(f"{field}: rows {rows!r} select nothing from {len(data)} rows of {source}")
        if field == "data.train":
            n_train = selected
    return problems, n_train


KINDS = {bool: "true/false", int: "a number", float: "a number", list: "a list", dict: "an object", type(None): "null"}


def column_problem(field: str, source: str, data: list, col: str, key: str) -> str | None:
    """The first row of `data` whose `col` is not text: a row that is not an object, one without
    the column, or one whose column holds something else (a number, a list...), each said as it is."""
    i = next((i for i, r in enumerate(data) if not isinstance(r, dict) or not isinstance(r.get(col), str)), None)
    if i is None:
        return None
    row = data[i]
    if not isinstance(row, dict):
        return (f"{field}: row {i} of {source} is {KINDS.get(type(row), type(row).__name__)}, not an object of "
                "columns (give every row its dialogue and summary as text columns)")
    if col not in row:
        return (f"{field}: row {i} of {source} has no text column {col!r} "
                f"(set data.{key} to one of: {', '.join(sorted(map(str, row))) or 'none'})")
    value = repr(row[col])
    return (f"{field}: row {i} of {source}: column {col!r} holds {KINDS.get(type(row[col]), type(row[col]).__name__)} "
            f"({value if len(value) <= 40 else value[:37] + '...'}), not text (write it as a string, or set data.{key} "
            "to a column of text)")


# ---------------------------------------------------------------------------------------------
# Prompts and tokens


def prompt_pieces(tokenizer, instruction: str) -> tuple[str, str, str]:
    """(text before the dialogue, text after it up to the summary, text after the summary)."""
    if getattr(tokenizer, "chat_template", None):
        user = [{"role": "user", "content": f"{instruction}\n\n{_MARK}"}]
        prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(
            user + [{"role": "assistant", "content": "S"}], tokenize=False
        )
        end = full[len(prompt) + 1:] if full.startswith(prompt + "S") else (tokenizer.eos_token or "")
    else:
        prompt = (tokenizer.bos_token or "") + PLAIN_TEMPLATE.format(instruction=instruction, dialogue=_MARK)
        end = tokenizer.eos_token or ""
    before, after = prompt.split(_MARK)
    return before, after, end


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


MARGIN_TOKENS = 64  # first_ids tokenizes this many longest tokens' worth of characters past what it keeps, twice


@functools.lru_cache(maxsize=8)
def longest_token(tokenizer) -> int:
    """Characters in the longest token string of the tokenizer's vocabulary (added tokens too).
    A byte-level vocabulary spells each byte of the text as one character of its own, a
    SentencePiece one each character as at least one: no token covers more characters of a text."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def first_ids(tokenizer, text: str, n: int) -> list[int]:
    """`_ids(tokenizer, text)[:n]`, without tokenizing more of a long text than can matter (a
    5 MB line tokenized whole took 1.8 GB). The first n tokens cover at most n x longest_token
    characters, so only that many, and a margin, are tokenized. The cut may change the tokens just
    before it (a word cut in two), so the n kept ones must end a margin before the cut, by the
    tokenizer's own offsets; if not (a normalizer that merges characters) or without offsets (a slow
    tokenizer), the whole text is tokenized after all."""
    if n <= 0:
        return []
    longest = longest_token(tokenizer)
    margin = MARGIN_TOKENS * longest
    bound = n * longest + 2 * margin
    if len(text) <= bound or not getattr(tokenizer, "is_fast", False):
        return _ids(tokenizer, text)[:n]
    encoded = tokenizer(text[:bound], add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    if len(ids) >= n and offsets[n - 1][1] + longest <= bound - margin:
        return ids[:n]
    return _ids(tokenizer, text)[:n]


def tokenize_example(tokenizer, pieces: tuple[str, str, str], dialogue: str, summary: str, max_length: int) -> dict:
    """Prompt and summary ids; the dialogue is cut at its end if the example is too long (only as
    much of a long dialogue or summary is tokenized as can be kept: first_ids)."""
    before, after, end = pieces
    pre, post = _ids(tokenizer, before), _ids(tokenizer, after)
    half = max_length // 2
    target = (first_ids(tokenizer, summary, half) + _ids(tokenizer, end))[:half]
    room = max_length - len(pre) - len(post) - len(target)
    dia = first_ids(tokenizer, dialogue, room)
    prompt = pre + dia + post
    return {"input_ids": prompt + target, "labels": [IGNORE] * len(prompt) + target, "prompt_len": len(prompt)}


def tokenize(rows: list[dict], tokenizer, d: DataConfig, progress: bool = False) -> list[dict]:
    """Every row tokenized; `progress`: a bar on stderr (tens of thousands of rows take a while)."""
    from tqdm.auto import tqdm

    pieces = prompt_pieces(tokenizer, d.instruction)
    return [tokenize_example(tokenizer, pieces, r["dialogue"], r["summary"], d.max_length)
            for r in tqdm(rows, desc="tokenize", disable=not progress, leave=False, dynamic_ncols=True)]


def tokenize_cached(rows: list[dict], tokenizer, d: DataConfig, cache_dir: str | os.PathLike, tok_id: str,
                    progress: bool = False) -> list[dict]:
    """Tokenize once and keep the result in `cache_dir` as JSON (data only: nothing is unpickled);
    later callers (other processes) read it. The caller makes one process go first; the file is
    written atomically, and one that cannot be read is made again."""
    key = hashlib.sha256(
        json.dumps([rows, d.instruction, d.max_length, tok_id], sort_keys=True).encode()
    ).hexdigest()[:20]
    path = Path(cache_dir) / f"tokenized-{key}.json"
    if path.exists():
        try:
            cached = json.loads(path.read_text())
            if isinstance(cached, list) and all(isinstance(e, dict) and set(e) == {"input_ids", "labels", "prompt_len"}
                                                for e in cached):
                return cached
        except (ValueError, UnicodeDecodeError):
            pass
    out = tokenize(rows, tokenizer, d, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(out, f)
    os.replace(tmp, path)
    return out


def load(d: DataConfig, tokenizer, cache_dir: Path, progress: bool = False) -> tuple[list[dict], list[dict]]:
    """The tokenized training and validation examples (tokenize_cached: tokenized once, then read)."""
    tok_id = fingerprint(tokenizer)
    train = tokenize_cached(load_split(d.train, d.train_rows, d), tokenizer, d, cache_dir, tok_id, progress)
    val = tokenize_cached(load_split(d.val, d.val_rows, d), tokenizer, d, cache_dir, tok_id, progress) if d.val else []
    return train, val


def fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary and template, for caching tokenized data."""
    h = hashlib.sha256()
    h.update(repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()[:16]
