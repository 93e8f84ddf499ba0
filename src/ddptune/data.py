"""Training data: its sources, their rows read once, prompts and masks, tokens made once and cached.

data.train and data.val are each one source or a list of them (`sources`); each source's rows are
read once per process and its format named (formats.py). A dialogue row's prompt goes through the
tokenizer's chat template when it has one (else a plain template); its loss covers the summary
tokens only (labels -100 elsewhere), and an over-long example is cut inside the dialogue, so the
summary always survives. Every other format is a conversation, masked and cut by chat.py. Nothing
here knows about processes; batches.py cuts the tokenized examples into steps and forwards.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ddptune import chat, formats
from ddptune.config import ConfigError, DataConfig, SourceConfig, parse_rows
from ddptune.tokens import IGNORE, MARGIN_TOKENS, first_ids, ids as _ids, longest_token  # noqa: F401 - data's names too

PLAIN_TEMPLATE = "{instruction}\n\n### Dialogue:\n{dialogue}\n\n### Summary:\n"
_MARK = "\x00DIALOGUE\x00"


# ---------------------------------------------------------------------------------------------
# Sources


@dataclass(frozen=True)
class Source:
    """One source of data.train or data.val: `field` names it in refusals, `name` in the logs."""
    field: str
    source: str
    rows: str | None
    weight: float
    name: str


def sources(d: DataConfig, split: str = "train") -> list[Source]:
    """data.train's (or data.val's) sources; names default to the file's stem, made unique."""
    value, rows = (d.train, d.train_rows) if split == "train" else (d.val, d.val_rows)
    if value is None:
        return []
    items = value if isinstance(value, list) else [SourceConfig(value, rows)]
    out, seen = [], set()
    for n, item in enumerate(items):
        name = item.name or (item.source[4:].replace("/", "_") if item.source.startswith("hub:") else Path(item.source).stem)
        while name in seen:
            name += f"-{n}"
        seen.add(name)
        field = f"data.{split}[{n}]" if isinstance(value, list) else f"data.{split}"
        out.append(Source(field, item.source, item.rows, item.weight, name))
    return out


def source_problems(d: DataConfig) -> list[str]:
    """data.train and data.val given as lists: what the config's value checks leave to these."""
    problems = []
    for split, value, rows in (("train", d.train, d.train_rows), ("val", d.val, d.val_rows)):
        if not isinstance(value, list):
            continue
        if not value:
            problems.append(f"data.{split}: an empty list (give a source, or a list of {{source, rows, weight}})")
        if rows is not None:
            problems.append(f"data.{split}_rows: a list of sources gives each its own rows (set data.{split}_rows=null)")
        names = [s.name for s in value if s.name]
        if len(set(names)) < len(names):
            problems.append(f"data.{split}: two sources share a name ({', '.join(names)}; give each its own)")
        for n, s in enumerate(value):
            where = f"data.{split}[{n}]"
            if not s.source:
                problems.append(f"{where}.source: missing (give a .json/.jsonl path, `demo`, or hub:ID)")
            try:
                parse_rows(s.rows)
            except ValueError:
                problems.append(f"{where}.rows: {s.rows!r} is not a row slice (write START:STOP, e.g. \"0:700\")")
            if split == "train" and not (s.weight > 0 and s.weight != float("inf")):
                problems.append(f"{where}.weight: must be a positive number (the source's share of the samples)")
            if split == "val" and s.weight != 1.0:
                problems.append(f"{where}.weight: validation sources are scored whole, not mixed (remove the weight)")
    return problems


def mixture(d: DataConfig, train: list[dict]) -> tuple[tuple[int, int], ...]:
    """For several training sources: (rows, draws per epoch) of each, in order (batches.Stream's
    `mix`); () for one. An epoch draws as many samples as there are rows in all, each source's
    share of them its weight's (largest remainders), so the stated proportions hold exactly."""
    found = sources(d, "train")
    return draws(found, [sum(1 for e in train if e.get("source") == s.name) for s in found]) if len(found) > 1 else ()


def draws(found: list[Source], sizes: list[int]) -> tuple[tuple[int, int], ...]:
    """mixture's (rows, draws) from the sources' example counts; ConfigError for a source that gives none."""
    total, weights = sum(sizes), [s.weight / sum(s.weight for s in found) for s in found]
    n = [int(total * w) for w in weights]
    for j in sorted(range(len(found)), key=lambda j: (-(total * weights[j] - n[j]), j))[:total - sum(n)]:
        n[j] += 1
    for s, rows, k in zip(found, sizes, n):
        if not rows or not k:
            raise ConfigError([f"{s.field}: " + (f"{s.source} gives no example (every row was dropped)" if not rows else
                               f"weight {s.weight:g} draws no sample in an epoch of {total} (raise it)")])
    return tuple(zip(sizes, n))


# ---------------------------------------------------------------------------------------------
# Rows


def read_rows(source: str) -> list[dict]:
    """All rows of `demo`, a .json list file, a .jsonl file, or `hub:ID[:SPLIT]`. A file is read
    once per process (train and val are often slices of one file): later calls get the same rows."""
    key = (source, Path(source).stat().st_mtime_ns if Path(source).is_file() else None)
    if key not in _ROWS:
        if len(_ROWS) >= 4:  # keep a few files' rows at most (the sources of a mixture, its validation)
            _ROWS.pop(next(iter(_ROWS)))
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


def load_split(source: str, rows: str | None, d: DataConfig, field: str = "data.train") -> list[dict]:
    """The selected rows, normalised (formats.normalise): {"id", "dialogue", "summary"} dicts, or
    {"id", "messages"} for a chat format. ConfigError for the first row that cannot be used."""
    data = read_rows(source)
    fmt = formats.detect(data, d)
    if problem := first_row_problem(field, source, data, fmt, d):
        raise ConfigError([problem])
    picked = range(len(data))[parse_rows(rows)]
    if fmt == "dialogue":  # as it always was
        return [{"id": str(data[i].get("id", i)), "dialogue": data[i][d.dialogue_column],
                 "summary": data[i][d.summary_column]} for i in picked]
    return [formats.normalise(data[i], i, fmt, d) for i in picked]


def first_row_problem(field: str, source: str, data: list, fmt: str, d: DataConfig) -> str | None:
    """The first row of `data` that `fmt` cannot use, said as it is."""
    if fmt == "dialogue":
        columns = [column_problem(field, source, data, col, key)
                   for col, key in ((d.dialogue_column, "dialogue_column"), (d.summary_column, "summary_column"))]
        return next((p for p in columns if p), None)  # a row that is not an object: said once
    for i, row in enumerate(data):
        if problem := formats.problem(row, fmt):
            return f"{field}: row {i} of {source} ({fmt}): {problem}"
    return None


def check(d: DataConfig) -> tuple[list[str], int | None]:
    """(problems with the sources, their files and rows, the number of training rows selected or None
    when unknown before loading: hub data). Reads each file once; tokenizes nothing."""
    problems, n_train = source_problems(d), 0
    if problems:
        return problems, None
    for split in ("train", "val"):
        for s in sources(d, split):
            field, source = s.field, s.source
            if source.startswith("hub:"):
                n_train = None if split == "train" else n_train
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
                                f"{d.dialogue_column!r} and {d.summary_column!r} text, or of another data.format)")
                continue
            if problem := first_row_problem(field, source, data, formats.detect(data, d), d):
                problems.append(problem)
            selected = len(data[parse_rows(s.rows)])
            if not selected:
                problems.append(f"{field}: rows {s.rows!r} select nothing from {len(data)} rows of {source}")
            if split == "train" and n_train is not None:
                n_train += selected
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


def tokenize(rows: list[dict], tokenizer, d: DataConfig, progress: bool = False, field: str = "data.train") -> list:
    """Every row tokenized, None for a conversation dropped as too long (chat.tokenize); `progress`:
    a bar on stderr (tens of thousands of rows take a while). ConfigError when a conversation's
    template gives no loss mask (checks.validate has looked at every row of local data already)."""
    from tqdm.auto import tqdm

    bar = tqdm(rows, desc="tokenize", disable=not progress, leave=False, dynamic_ncols=True)
    if not rows or "messages" not in rows[0]:  # dialogues (a source's rows share one format)
        pieces = prompt_pieces(tokenizer, d.instruction) if rows else None
        return [tokenize_example(tokenizer, pieces, r["dialogue"], r["summary"], d.max_length) for r in bar]
    if problem := chat.template_problem(tokenizer, d.loss_on):
        raise ConfigError([f"model.tokenizer: {problem}"])
    out = []
    for start in range(0, len(rows), CHUNK):
        parts = []
        for r in rows[start:start + CHUNK]:
            try:
                parts.append(chat.pieces(tokenizer, r["messages"], d.loss_on))
            except chat.TemplateProblem as e:
                raise ConfigError([f"{field}: row {r['id']}: {e}"]) from None
        out += chat.tokenize_many(tokenizer, parts, d.max_length)
        bar.update(len(parts))
    bar.close()
    return out


CHUNK = 256  # conversations tokenized in one call


def chat_sources(d: DataConfig) -> list[tuple[Source, str]]:
    """The local sources (of train and val) whose rows are conversations, with their format."""
    found = [(s, formats.detect(read_rows(s.source), d)) for split in ("train", "val") for s in sources(d, split)
             if not s.source.startswith("hub:")]
    return [(s, fmt) for s, fmt in found if fmt != "dialogue"]


def trains_conversations(d: DataConfig) -> bool:
    """Whether the training data is in a chat format (data.format, or the first readable source's rows)."""
    if d.format != "auto":
        return d.format != "dialogue"
    try:
        return formats.detect(read_rows(sources(d)[0].source), d) != "dialogue"
    except (OSError, ValueError, ImportError, IndexError):  # gone since, or hub data out of reach
        return False


def template_problems(d: DataConfig, tokenizer) -> list[str]:
    """Every conversation of the local sources rendered through the template and its mask checked
    (chat.pieces), before anything is tokenized or started: the first problem of each source."""
    found = chat_sources(d)
    if found and (problem := chat.template_problem(tokenizer, d.loss_on)):
        return [f"model.tokenizer: {problem}"]
    problems = []
    for s, fmt in found:
        data = read_rows(s.source)
        for i in range(len(data))[parse_rows(s.rows)]:
            try:
                chat.pieces(tokenizer, formats.normalise(data[i], i, fmt, d)["messages"], d.loss_on)
            except chat.TemplateProblem as e:
                problems.append(f"{s.field}: row {i} of {s.source}: {e}")
                break
    return problems


def tokenize_cached(rows: list[dict], tokenizer, d: DataConfig, cache_dir: str | os.PathLike, tok_id: str,
                    progress: bool = False, field: str = "data.train") -> list:
    """Tokenize once and keep the result in `cache_dir` as JSON (data only: nothing is unpickled);
    later callers (other processes) read it. The caller makes one process go first; the file is
    written atomically, and one that cannot be read is made again."""
    chat_key = [d.loss_on] if any("messages" in r for r in rows) else []  # dialogue rows: the key they always had
    key = hashlib.sha256(
        json.dumps([rows, d.instruction, d.max_length, tok_id, *chat_key], sort_keys=True).encode()
    ).hexdigest()[:20]
    path = Path(cache_dir) / f"tokenized-{key}.json"
    stamp = (path.stat().st_mtime_ns, path.stat().st_size) if path.exists() else None
    if stamp and _TOKENIZED.get(path, (None,))[0] == stamp:  # this process made or read it just now
        return _TOKENIZED[path][1]
    if path.exists():
        try:
            cached = json.loads(path.read_text())
            if isinstance(cached, list) and all(e is None or isinstance(e, dict) and set(e) - {"cut"} == EXAMPLE_KEYS
                                                for e in cached):
                remember(path, stamp, cached)
                return cached
        except (ValueError, UnicodeDecodeError):
            pass
    out = tokenize(rows, tokenizer, d, progress, field)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(out, f)
    os.replace(tmp, path)
    remember(path, (path.stat().st_mtime_ns, path.stat().st_size), out)
    return out


def remember(path: Path, stamp: tuple, examples: list) -> None:
    """Keep a few cache files' examples (a run's sources) for this process's next call."""
    _TOKENIZED.pop(path, None)
    if len(_TOKENIZED) >= 8:
        _TOKENIZED.pop(next(iter(_TOKENIZED)))
    _TOKENIZED[path] = (stamp, examples)


EXAMPLE_KEYS = {"input_ids", "labels", "prompt_len"}
_TOKENIZED: dict = {}  # the last cache file made or read: {path: ((mtime, size), examples)}


def _tokenized(d: DataConfig, tokenizer, cache_dir: Path, progress: bool = False):
    """(split, source, its examples with None for the dropped rows), for every source in turn."""
    tok_id = fingerprint(tokenizer)
    for split in ("train", "val"):
        for s in sources(d, split):
            rows = load_split(s.source, s.rows, d, s.field)
            yield split, s, tokenize_cached(rows, tokenizer, d, cache_dir, tok_id, progress, s.field)


def load(d: DataConfig, tokenizer, cache_dir: Path, progress: bool = False) -> tuple[list[dict], list[dict]]:
    """The tokenized training and validation examples (tokenize_cached: tokenized once, then read).
    With several sources in a split, each example names its own (`"source"`)."""
    out = {"train": [], "val": []}
    for split, s, examples in _tokenized(d, tokenizer, cache_dir, progress):
        kept = [e for e in examples if e is not None]
        out[split] += [dict(e, source=s.name) for e in kept] if len(sources(d, split)) > 1 else kept
    return out["train"], out["val"]


def prepare(d: DataConfig, tokenizer, cache_dir: Path, progress: bool = False) -> list[str]:
    """Tokenize and cache every source (what `load` then reads), checking each row; one line for each
    source whose rows were cut or dropped to fit data.max_length."""
    lines, kept = [], []
    for split, s, examples in _tokenized(d, tokenizer, cache_dir, progress):
        cut, dropped = sum(1 for e in examples if e and e.get("cut")), examples.count(None)
        kept += [len(examples) - dropped] if split == "train" else []
        if cut or dropped:
            lines.append(f"{s.field} ({s.name}): {cut} of {len(examples)} rows cut to data.max_length={d.max_length} "
                         f"(their earliest tokens), {dropped} dropped (their final assistant turn alone is too long)")
    if len(kept) > 1:
        draws(sources(d, "train"), kept)
    return lines


def fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary and template, for caching tokenized data."""
    h = hashlib.sha256()
    h.update(repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()[:16]
