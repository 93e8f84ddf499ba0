"""Training data: its sources, their rows checked and normalised, and their prompts and examples tokenized.

This folder is the whole data path, from input files to the tokenized store a run reads: rows.py
streams a source's rows, formats.py names and checks their format, chat.py masks conversations
through the chat template, tokens.py tokenizes pieces of text, tokenized.py turns whole sources into
examples on every core, and store.py keeps them once in files that every process maps. Nothing in it
knows about processes (tests/test_layout.py holds it to that); batches.py cuts the examples into steps.

data.train and data.val are each one source or a list of them (`sources`); a source's rows are read
in chunks (rows.py), its format named from its first rows and every row checked (formats.py). A
dialogue row's prompt goes through the tokenizer's chat template when it has one (else a plain
template); its loss covers the summary tokens only (labels -100 elsewhere), and an over-long example
is cut inside the dialogue, so the summary always survives. Every other format is a conversation,
masked and cut by chat.py. Before a run, `check` and `data_file_problems` read the sources' paths
and first rows, and `template_problems` asks whether the tokenizer's chat template can mask the data's
conversations. `tokenize` makes the examples of a list of rows in batched calls of the tokenizer.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ddptune.data import chat, formats, rows as rows_lib, tokens as tokens_lib
from ddptune.config import ConfigError, DataConfig, SourceConfig, is_template_path, not_a_file, parse_rows
from ddptune.data.formats import KINDS
from ddptune.data.tokens import IGNORE, first_ids, ids as _ids

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


def mixture(d: DataConfig, sizes: list[int]) -> tuple[tuple[int, int], ...]:
    """For several training sources: (rows, draws per epoch) of each, in order (batches.Stream's
    `mix`), from each source's example count; () for one. An epoch draws as many samples as there are
    rows in all, each source's share of them its weight's (largest remainders), so the stated proportions hold exactly."""
    found = sources(d, "train")
    return draws(found, sizes) if len(found) > 1 else ()


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


def selection(d: DataConfig) -> str:
    """Which rows of which source train and validate, e.g. "train: rows 0:500 of demo (500 of 1,500)"."""
    parts = []
    for split in ("train", "val"):
        for s in sources(d, split):
            if s.rows:  # counted once per process (validation counted it already); all rows: nothing to count
                total = rows_lib.count(s.source)
                what = f"rows {s.rows} of {s.source} ({len(range(total)[parse_rows(s.rows)]):,} of {total:,})"
            parts.append(f"{'validate' if split == 'val' else split}: " + (what if s.rows else f"every row of {s.source}"))
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# Rows


def first_rows(source: str) -> list:
    """The first rows of a source, parsed: what its format is named from."""
    return rows_lib.head(source, formats.AUTO_ROWS)


def format_of(source: str, d: DataConfig) -> str:
    return formats.detect(first_rows(source), d)


def read_problem(field: str, source: str, e: Exception) -> str:
    """The line for a source that cannot be read: a JSON line that does not parse (by its line in the
    file), text that is not UTF-8, content rows.py names with its fix (rows_lib.Unreadable), or a file
    that is no list of rows."""
    if isinstance(e, rows_lib.BadLine):
        return f"{field}: line {e.line} of {source} is not JSON ({e}) (fix or remove that line)"
    if isinstance(e, rows_lib.Unreadable):  # it names the file, the place and the fix itself
        return f"{field}: {str(e).splitlines()[0]}"
    if isinstance(e, UnicodeDecodeError):
        return f"{field}: cannot read {source} (UnicodeDecodeError: {e}) (give a UTF-8 file)"
    return f"{field}: cannot read {source} ({str(e).splitlines()[0]}; expected {rows_lib.FORMS})"


def row_problem(row, fmt: str, d: DataConfig) -> str | None:
    """What keeps one row from being used as `fmt`, said after "row N of SOURCE", or None."""
    wrong = dialogue_problem(row, d) if fmt == "dialogue" else formats.problem(row, fmt, d)
    if wrong is None:
        return None
    if other := formats.other_format(row, fmt, d):
        return f" {other}"
    if lacks := formats.lacking(row, fmt, d):
        return lacks
    return wrong if fmt == "dialogue" else f" ({fmt}): {wrong}"


def dialogue_problem(row, d: DataConfig) -> str | None:
    """A dialogue row that is not an object, lacks a column, or whose column holds something else
    than text (a number, a list, a lone surrogate), each said as it is."""
    if not isinstance(row, dict):
        return (f" is {KINDS.get(type(row), type(row).__name__)}, not an object of columns (give every row its "
                "dialogue and summary as text columns)")
    for col, key in ((d.dialogue_column, "dialogue_column"), (d.summary_column, "summary_column")):
        if col not in row:
            return f" has no text column {col!r} (set data.{key} to one of: {', '.join(sorted(map(str, row))) or 'none'})"
        if not isinstance(row[col], str):
            return (f": column {col!r} holds {formats.kind(row[col])}, not text (write it as a string, or set data.{key} "
                    "to a column of text)")
        if wrong := formats.text_problem(row[col]):
            return f": column {col!r} {wrong}"
    return None


def normalise(row: dict, number: int, fmt: str, d: DataConfig) -> dict:
    """A checked row as {"id", "dialogue", "summary"} or {"id", "messages"}."""
    if fmt == "dialogue":
        return {"id": str(row.get("id", number)), "dialogue": row[d.dialogue_column], "summary": row[d.summary_column]}
    return formats.normalise(row, number, fmt, d)


def load_split(source: str, rows: str | None, d: DataConfig, field: str = "data.train") -> list[dict]:
    """The selected rows, checked and normalised: what evaluation and `ddptune data --show` read (a run
    reads its examples from tokenized.py's stores). ConfigError for the first row that cannot be used."""
    fmt, out = format_of(source, d), []
    try:
        for chunk in rows_lib.chunks(source, rows_lib.selection(source, rows)):
            for number, item in chunk:
                row = rows_lib.parse(item, number)
                if wrong := row_problem(row, fmt, d):
                    raise ConfigError([f"{field}: row {number} of {source}{wrong}"])
                out.append(normalise(row, number, fmt, d))
    except (ValueError, OSError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError([read_problem(field, source, e)]) from None
    return out


def read_rows(source: str) -> list:
    """Every row of a small source, parsed (tools and tests; a run streams its rows instead)."""
    return [rows_lib.parse(item, n) for chunk in rows_lib.chunks(source, rows_lib.selection(source, None)) for n, item in chunk]


def data_file_problems(d: DataConfig) -> list[str]:
    """A data path that is there but is neither a regular file nor a datasets.save_to_disk folder: a
    FIFO (reading it would wait for a writer), another folder, a symlink loop or one to nothing (a
    path that is not there at all: data.check says so)."""
    problems = []
    for field, source in ((s.field, s.source) for split in ("train", "val") for s in sources(d, split)):
        path = Path(source)
        if source and source != "demo" and not source.startswith("hub:") and os.path.lexists(source) \
                and not path.is_file() and not (path.is_dir() and rows_lib.kind(source) == "arrow"):
            problems.append(f"{field}: {source} {not_a_file(path)} (give {rows_lib.FORMS})")
    if (t := d.chat_template) is not None and is_template_path(t) and not Path(t).is_file():
        problems.append(f"data.chat_template: {t} {not_a_file(Path(t))} (give the path of a .jinja file, or the template)")
    return problems


def check(d: DataConfig) -> tuple[list[str], int | None]:
    """(problems with the sources, their files, their first rows and their row slices; the number of
    training rows selected, None when unknown before loading: hub data). Reads a file's first rows
    and counts its rows; tokenized.prepare checks every row as it tokenizes it."""
    problems, n_train = source_problems(d), 0
    if problems:
        return problems, None
    for split in ("train", "val"):
        for s in sources(d, split):
            field, source = s.field, s.source
            if source.startswith("hub:"):
                n_train = None if split == "train" else n_train
                if importlib.util.find_spec("datasets") is None:
                    problems.append(f"{field}: {source} needs the datasets package (pip install datasets, and internet), "
                                    "or give a local file")
                continue
            if rows_lib.kind(source) is None or not Path(rows_lib.path_of(source)).exists():
                what = "is a folder that datasets.save_to_disk did not write" if Path(source).is_dir() else "not found"
                problems.append(f"{field}: file {source!r} {what} (give {rows_lib.FORMS})")
                continue
            try:
                first, total = first_rows(source), rows_lib.count(source)
            except (ValueError, OSError) as e:
                problems.append(read_problem(field, source, e))
                continue
            problems += source_row_problems(s, first, total, d)
            if split == "train" and n_train is not None:
                n_train += len(range(total)[parse_rows(s.rows)])
    return problems, n_train


def source_row_problems(s: Source, first: list, total: int, d: DataConfig) -> list[str]:
    """A source that holds no rows, whose first rows are of two formats or cannot be used, or whose row slice selects none."""
    if not total:
        return [f"{s.field}: {s.source} holds no rows (give a JSON list or JSON lines of rows with {d.dialogue_column!r} "
                f"and {d.summary_column!r} text, or of another data.format)"]
    if wrong := formats.mixed(first, d):
        return [f"{s.field}: {s.source}: {wrong}"]
    fmt = formats.detect(first, d)
    bad = next(((i, w) for i, r in enumerate(first) if (w := row_problem(r, fmt, d))), None)
    if bad:
        return [f"{s.field}: row {bad[0]} of {s.source}{bad[1]}"]
    if not len(range(total)[parse_rows(s.rows)]):
        return [f"{s.field}: rows {s.rows!r} select nothing from {total} rows of {s.source}"]
    return []


def local_formats(d: DataConfig) -> list[tuple[Source, str]]:
    """The local sources (of train and val), each with the format of its rows."""
    return [(s, format_of(s.source, d)) for split in ("train", "val") for s in sources(d, split) if not s.source.startswith("hub:")]


def trains_conversations(d: DataConfig) -> bool:
    """Whether the training data is in a chat format (data.format, or the first readable source's rows)."""
    if d.format != "auto":
        return d.format != "dialogue"
    try:
        return format_of(sources(d)[0].source, d) != "dialogue"
    except (OSError, ValueError, ImportError, IndexError):  # gone since, or hub data out of reach
        return False


def record(d: DataConfig) -> dict:
    """What a run's rows are, as data.format `auto` resolved them: each source's format (None where its rows
    cannot be read now) and the keys that shape their prompts. Saved with the run (rundir.DATA_RECORD), so
    that predict and eval take rows of the formats it trained on."""
    def resolved(source: str) -> str | None:
        try:
            return format_of(source, d)
        except (OSError, ValueError, ImportError):  # hub data out of reach: unknown, not a guess
            return None

    return {"formats": {split: [{"name": s.name, "source": s.source, "format": resolved(s.source)} for s in sources(d, split)]
                        for split in ("train", "val")},
            **{k: getattr(d, k) for k in ("template", "chat_template", "system_prompt", "instruction", "dialogue_column",
                                          "summary_column", "prompt_column", "completion_column", "loss_on", "max_length")}}


def recorded_formats(saved: dict) -> tuple[str, ...] | None:
    """The formats a `record` names (training's first, then validation's), once each; None where it names none."""
    try:
        found = [s["format"] for split in ("train", "val") for s in saved["formats"][split]]
    except (KeyError, TypeError):
        return None
    taken = tuple(dict.fromkeys(f for f in found if f in formats.FORMATS))
    return taken or None


def untaken(d: DataConfig, taken: tuple[str, ...]) -> list[str]:
    """data.val's local sources whose rows are of none of `taken`, the formats a run trained on (eval scores
    a run on rows shaped as it trained on); call once data.check found their rows readable."""
    return [f"{s.field}: {s.source} holds {fmt} rows, but the run trained on {' and '.join(taken)} rows (give data.val "
            f"rows of that shape, e.g. {formats.sample(taken[0], d, answer=True)})"
            for s in sources(d, "val") if not s.source.startswith("hub:") and (fmt := format_of(s.source, d)) not in taken]


def asked_sample(d: DataConfig) -> str:
    """A row predict takes from a run trained on `d`'s data (its first source's format), as a JSON line."""
    try:
        fmt = format_of(sources(d)[0].source, d) if d.format == "auto" else d.format
    except (OSError, ValueError, ImportError, IndexError):  # gone since, or hub data out of reach
        fmt = "dialogue"
    return formats.sample(fmt, d)


def template_problems(d: DataConfig, tokenizer) -> list[str]:
    """Chat data: the tokenizer's chat template can give conversations a loss mask (chat.template_problem's
    probe; every conversation's own mask is checked as it is tokenized); data.template=none takes
    prompt_completion sources only; data.chat_template renders."""
    found = local_formats(d)
    if d.template == "none" and (other := next(((s, f) for s, f in found if f != "prompt_completion"), None)):
        return [f"{other[0].field}: {other[0].source} holds {other[1]} rows, and data.template=none takes prompt_completion "
                "rows only (a prompt and a completion: use data.template=chat for the others)"]
    try:
        if d.chat_template is not None:
            chat.render(tokenizer, chat.PROBE[:1], True)
        if any(f == "dialogue" for _, f in found):
            prompt_pieces(tokenizer, d.instruction, d.system_prompt)  # every dialogue row's prompt, but for its text
        problem = chat.template_problem(tokenizer, d.loss_on, plain=d.template == "none") \
            if any(f != "dialogue" for _, f in found) else None
    except chat.TemplateProblem as e:
        problem = str(e)
    return [f"{template_field(d)}: {problem}"] if problem else []


def template_field(d: DataConfig) -> str:
    """The field that names the template a refusal is about."""
    return "data.template" if d.template == "none" else "data.chat_template" if d.chat_template is not None else "model.tokenizer"


# ---------------------------------------------------------------------------------------------
# Prompts and tokens


def prompt_pieces(tokenizer, instruction: str, system: str | None = None) -> tuple[str, str, str]:
    """(text before the dialogue, text after it up to the summary, text after the summary); `system`
    (data.system_prompt): the system turn before the user's."""
    if getattr(tokenizer, "chat_template", None):
        user = [{"role": "system", "content": system}] * (system is not None) + [
            {"role": "user", "content": f"{instruction}\n\n{_MARK}"}]
        prompt = chat.render(tokenizer, user, True)  # TemplateProblem where the template fails
        full = chat.render(tokenizer, user + [{"role": "assistant", "content": "S"}], False)
        end = full[len(prompt) + 1:] if full.startswith(prompt + "S") else (tokenizer.eos_token or "")
    else:
        head = "" if system is None else f"### System:\n{system}\n\n"  # as chat.PLAIN_CHAT writes a system turn
        prompt = (tokenizer.bos_token or "") + head + PLAIN_TEMPLATE.format(instruction=instruction, dialogue=_MARK)
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


def tokenize_dialogues(tokenizer, pieces: tuple[str, str, str], rows: list[dict], max_length: int) -> list[dict]:
    """`tokenize_example` of every row, in two batched calls of the tokenizer (the summaries, then the
    dialogues with the room each leaves): the same ids. An example that lost tokens to max_length
    (its dialogue's end, or its summary's beyond half of max_length) says `"cut": "dialogue"`."""
    before, after, end = pieces
    pre, post, tail = _ids(tokenizer, before), _ids(tokenizer, after), _ids(tokenizer, end)
    half = max_length // 2
    summaries = tokens_lib.firsts(tokenizer, [r["summary"] for r in rows], [half + 1] * len(rows))
    targets = [(s[:half] + tail)[:half] for s in summaries]
    rooms = [max_length - len(pre) - len(post) - len(t) for t in targets]
    dialogues = tokens_lib.firsts(tokenizer, [r["dialogue"] for r in rows], [room + 1 for room in rooms])
    out = []
    for s, target, room, dia in zip(summaries, targets, rooms, dialogues):
        prompt = pre + dia[:max(room, 0)] + post
        example = {"input_ids": prompt + target, "labels": [IGNORE] * len(prompt) + target, "prompt_len": len(prompt)}
        if len(s[:half]) + len(tail) > half or len(dia) > max(room, 0):
            example["cut"] = "dialogue"
        out.append(example)
    return out


def tokenize(rows: list[dict], tokenizer, d: DataConfig, where: list[str] | None = None) -> list:
    """Every row tokenized, None for a conversation dropped as too long (chat.tokenize), in batched
    calls. ConfigError when a conversation's template gives no loss mask, naming the row by `where`
    (default: its id)."""
    if not rows:
        return []
    if "messages" not in rows[0]:  # dialogues (a source's rows share one format)
        try:
            pieces = prompt_pieces(tokenizer, d.instruction, d.system_prompt)
        except chat.TemplateProblem as e:
            raise ConfigError([f"{template_field(d)}: {e}"]) from None
        return tokenize_dialogues(tokenizer, pieces, rows, d.max_length)
    if problem := chat.template_problem(tokenizer, d.loss_on, plain=d.template == "none"):
        raise ConfigError([f"model.tokenizer: {problem}"])
    parts = []
    for k, r in enumerate(rows):
        try:
            parts.append(chat.pieces(tokenizer, r["messages"], d.loss_on))
        except chat.TemplateProblem as e:
            raise ConfigError([f"{where[k] if where else 'data.train: row ' + r['id']}: {e}"]) from None
    return chat.tokenize_many(tokenizer, parts, d.max_length, [r["messages"] for r in rows])


def fingerprint(tokenizer) -> str:
    """A short hash of what tokenizing depends on in the tokenizer: its whole definition where it has
    one (vocabulary, merges, normalizer, pre-tokenizer), its chat template and special tokens."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(sorted(tokenizer.get_vocab().items())).encode())
    for part in (getattr(tokenizer, "chat_template", None), tokenizer.bos_token, tokenizer.eos_token):
        h.update(str(part).encode() + b"\x00")
    return h.hexdigest()[:16]
