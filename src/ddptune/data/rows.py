"""Rows of a data source, streamed, whatever holds them: files, Arrow folders, the hub or the demo.

Sources: JSON lines, a JSON list, Parquet, CSV, a folder written by `datasets.save_to_disk`,
`hub:ID[:SPLIT]` and the built-in `demo`. `chunks(source, rows)` yields the selected rows in order, a
few hundred at a time, as (row number, item) pairs: an item is a JSON line's bytes (parsed where it is
tokenized, in a worker process: `parse`) or a row already read (a dict). Nothing holds a whole file: a
JSON-lines file is read line by line, Parquet by record batch, CSV by row (strictly), Arrow folders and hub data
through `datasets`' memory map, a JSON list a row at a time (decoded where it is read: its rows are not
lines a worker could find). Row numbers count rows, not lines (blank lines are skipped); a JSON line
that does not parse is named by its line in the file. A text file may begin with a UTF-8 byte-order mark,
and be gzipped (.jsonl.gz, .json.gz, .csv.gz: decompressed as it is read).
Rows read through Arrow leave out the keys a row lacks (Arrow gives them as null).
"""
from __future__ import annotations

import codecs
import contextlib
import csv
import gzip
import json
import os
import re
import zlib
from importlib import resources
from itertools import islice
from pathlib import Path

from ddptune.config import parse_rows

CHUNK = 256  # rows handed to a tokenizing worker at a time
KINDS = ("jsonl", "json", "parquet", "csv", "arrow", "hub")
SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
FORMS = "a .jsonl/.json/.parquet/.csv file (.jsonl.gz, .json.gz, .csv.gz: gzipped), a datasets.save_to_disk folder, `demo`, or hub:ID"
# A CSV cell is data whatever its length, a long document too: the csv module's default refuses one over 128 KiB
# (its limit is the process's; 2 GiB - 1, the largest every platform's C long holds)
csv.field_size_limit(2**31 - 1)


class Unreadable(ValueError):
    """A source of a kind this module reads whose content is wrong: the message names the file, where in it,
    and the fix (a refusal says it as it is, not followed by the forms a source may take)."""


class BadLine(ValueError):
    """A JSON line that does not parse: `line` is its number in the file (1-based)."""

    def __init__(self, line: int, why: str):
        super().__init__(why)
        self.line = line


def path_of(source: str) -> str:
    """The file behind `source` (`demo`: the package's own demo dialogues)."""
    return str(resources.files("ddptune").joinpath("demo_data/demo.jsonl")) if source == "demo" else source


def kind(source: str) -> str | None:
    """How `source` is read, or None when it is nothing this module reads."""
    if source.startswith("hub:"):
        return "hub"
    path = Path(path_of(source))
    if path.is_dir():
        return "arrow" if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file() else None
    name = path.name.lower().removesuffix(".gz")
    return SUFFIXES.get(os.path.splitext(name)[1], "json")


@contextlib.contextmanager
def _gzip_errors(path: str):
    """gzip's own errors for a file cut short or corrupted, which are no OSError, as a ValueError (a read problem)."""
    try:
        yield
    except (EOFError, zlib.error) as e:
        raise ValueError(f"{path} is a damaged gzip file ({e})") from None


def _open(path: str, text: bool):
    """The file, decompressed as it is read where its name ends in .gz; text: UTF-8 (a byte-order mark
    skipped), lines as they are (CSV reads its own)."""
    if path.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="") if text else gzip.open(path, "rb")
    return open(path, "r", encoding="utf-8-sig", newline="") if text else open(path, "rb")


def identity(source: str) -> list:
    """What names the source's content for a cache key: a file's real path, size and modification
    time; an Arrow folder's files likewise; hub data by its id and datasets' own fingerprint."""
    k = kind(source)
    if k == "hub":
        return [source, _dataset(source)._fingerprint]
    path = Path(path_of(source))
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [os.path.realpath(path)] + [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def count(source: str) -> int:
    """The source's rows, counted without parsing them (a JSON list's are decoded one by one); once per process for
    a file as it is (validation counts it, then preparing it selects its rows)."""
    k, path = kind(source), path_of(source)
    key = repr(identity(source))  # its content as a cache key names it: path, sizes, modification times
    if key not in _COUNTS:
        with _gzip_errors(path):
            _COUNTS[key] = _count(source, k, path)
    return _COUNTS[key]


_COUNTS: dict = {}


def _count(source: str, k: str | None, path: str) -> int:
    if k == "jsonl":
        with _open(path, text=False) as f:
            return sum(1 for line in f if line.strip())
    if k == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if k == "csv":
        return sum(1 for _ in _csv(path))
    if k in ("arrow", "hub"):
        return len(_dataset(source))
    return sum(1 for _ in _json_items(path))


def selection(source: str, rows: str | None) -> range:
    """The row numbers `rows` ("START:STOP", None: all) selects from the source's rows."""
    return range(count(source))[parse_rows(rows)]


def head(source: str, n: int) -> list:
    """The first `n` rows, parsed (a format is named from these)."""
    out = []
    for chunk in chunks(source, range(n)):
        out += [parse(item, number) for number, item in chunk]
    return out


def chunks(source: str, picked: range, size: int = CHUNK):
    """The rows numbered in `picked` (a range of step 1), in order, as lists of (row number, item)."""
    if not picked:
        return
    rows = _rows(source, picked.start)
    batch = []
    for number, item in islice(rows, len(picked)):
        batch.append((number, item))
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def parse(item, number: int):
    """A row from what `chunks` gave: a JSON line's bytes parsed (UnicodeDecodeError when they are not
    UTF-8, BadLine when they are not JSON), else the row itself."""
    if not isinstance(item, tuple):
        return item
    line, raw = item
    text = raw.decode("utf-8")
    try:
        return json.loads(text)
    except ValueError as e:
        raise BadLine(line, f"{getattr(e, 'msg', e)} at column {getattr(e, 'colno', '?')}") from None


def _rows(source: str, start: int):
    """(row number, item) from row `start` on."""
    k, path = kind(source), path_of(source)
    with _gzip_errors(path):
        if k == "jsonl":
            yield from _jsonl(path, start)
        elif k == "parquet":
            yield from enumerate(_parquet(path, start), start)
        elif k == "csv":
            yield from _csv(path, start)
        elif k in ("arrow", "hub"):
            yield from enumerate(_arrow(_dataset(source), start), start)
        else:
            yield from _json_items(path, start)


def _jsonl(path: str, start: int):
    """(row number, (line number, the line's bytes)) of every non-blank line from row `start` on."""
    number = 0
    with _open(path, text=False) as f:
        for line_number, line in enumerate(f, 1):
            if line_number == 1 and line.startswith(codecs.BOM_UTF8):  # a byte-order mark, as spreadsheets write
                line = line[len(codecs.BOM_UTF8):]
            if not line.strip():
                continue
            if number >= start:
                yield number, (line_number, line)
            number += 1


def _csv(path: str, start: int = 0):
    """(row number, row) of a CSV file from row `start` on, each row a dict of the header's columns (a
    column its row lacks: None). Read strictly, each problem an Unreadable naming the line its row begins on:
    a quote that never closes or text after a closing quote (a lenient reader merges the rows after it
    into one field), and a row with more fields than the header."""
    with _open(path, text=True) as f:
        reader, header, number = csv.reader(f, strict=True), None, 0
        while True:
            line = reader.line_num + 1  # where the next row begins
            try:
                fields = next(reader, None)
            except csv.Error as e:
                raise Unreadable(f"{path}: the row that begins on line {line} is not valid CSV ({e}: a quote that never "
                                 'closes, or text after a closing one; quote whole fields, a quote inside one doubled: "")') from None
            if fields is None:
                return
            if not fields:  # a blank line
                continue
            if header is None:
                header = fields
                continue
            if len(fields) > len(header):
                raise Unreadable(f"{path}: line {line} holds {len(fields)} fields, its header {len(header)} (quote a field "
                                 "that holds a comma)")
            if number >= start:
                yield number, dict(zip(header, fields + [None] * (len(header) - len(fields))))
            number += 1


def _parquet(path: str, start: int):
    import pyarrow.parquet as pq

    seen = 0  # rows before this batch
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        if seen + batch.num_rows > start:
            yield from (_present(r) for r in batch.slice(max(start - seen, 0)).to_pylist())
        seen += batch.num_rows


def _arrow(ds, start: int):
    for a in range(start, len(ds), 1024):
        yield from (_present(r) for r in ds.select(range(a, min(a + 1024, len(ds)))).to_list())


def _present(value):
    """A row read through Arrow, the keys it did not have (null in Arrow's table) left out, in nested objects too."""
    if isinstance(value, dict):
        return {k: _present(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_present(v) for v in value]
    return value


_DATASETS: dict = {}


def _dataset(source: str):
    """A folder of datasets.save_to_disk (its one split, or `train`), or hub data, memory-mapped by `datasets`.
    Unreadable for a folder of several splits, none `train`, naming them and each one's own folder (a
    split of a saved DatasetDict is a folder that datasets.save_to_disk wrote too)."""
    if source not in _DATASETS:
        import datasets

        if source.startswith("hub:"):
            ident, _, split = source[4:].partition(":")
            ds = datasets.load_dataset(ident, split=split or "train")
        else:
            ds = datasets.load_from_disk(source)
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds and len(ds) != 1:
                    names = list(ds)
                    raise Unreadable(f"{source} holds the splits {', '.join(names) or 'none'} and no 'train' split"
                                     + (f" (give one split's folder: {', '.join(os.path.join(source, n) for n in names)})"
                                        if names else ""))
                ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        _DATASETS.clear()  # one at a time: a source is read through, then the next
        _DATASETS[source] = ds
    return _DATASETS[source]


_SPACE = re.compile(r"[ \t\r\n]*")
_JSON_KINDS = {"{": "a JSON object", '"': "a JSON string", "t": "a JSON true", "f": "a JSON false", "n": "a JSON null",
               **{c: "a JSON number" for c in "-0123456789"}}


def _json_items(path: str, start: int = 0, size: int = 1 << 20):
    """(row number, row) of a JSON list file from row `start` on, decoded one row at a time from
    `size`-character reads (the file is never held whole; a row costs its own characters, never a
    copy of the read it sits in). ValueError where it is not one JSON list: anything but white space
    after its closing ] (a second list: `cat a.json b.json`) is named by its line, as json.load names it."""
    decoder = json.JSONDecoder()
    with _open(path, text=True) as f:
        buf, pos, lines = "", 0, 0  # lines: the line breaks in the text read before buf

        def next_char() -> str:  # the next character that is not white space ("" at the end), reading on as needed
            nonlocal buf, pos, lines
            while True:
                pos = _SPACE.match(buf, pos).end()
                if pos < len(buf):
                    return buf[pos]
                lines += buf.count("\n")
                buf, pos = f.read(size), 0
                if not buf:
                    return ""

        first = next_char()
        if first != "[":
            what = _JSON_KINDS.get(first, f"no JSON (it begins with {first!r})") if first else "nothing"
            raise ValueError(f"{path} holds {what}, not a list of rows")
        pos += 1
        number, c = 0, next_char()
        while c != "]":
            while True:
                try:
                    row, end = decoder.raw_decode(buf, pos)
                    if end < len(buf):  # a value that ends at the read's end may go on in the next
                        break
                except ValueError:
                    pass
                chunk = f.read(max(size, len(buf) - pos))  # a row longer than a read: reads that double
                if not chunk:
                    try:
                        row, end = decoder.raw_decode(buf, pos)  # the whole rest: valid, or the decoder's own error
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}: row {number} is not valid JSON ({e.msg})") from None
                    break
                lines += buf.count("\n", 0, pos)
                buf, pos = buf[pos:] + chunk, 0
            if number >= start:
                yield number, row
            pos, number = end, number + 1
            c = next_char()
            if c == ",":
                pos += 1
                if next_char() in ("]", ""):
                    raise ValueError(f"{path}: a comma after row {number - 1} is followed by no row")
            elif c != "]":
                raise ValueError(f"{path}: row {number - 1} is followed by {c!r}, not a comma or the closing ]"
                                 if c else f"{path} ends before the list's closing ]")
        pos += 1
        if c := next_char():
            line = lines + buf.count("\n", 0, pos) + 1
            raise Unreadable(f"{path}: line {line} holds {c!r} after the list's closing ] (a file holds one JSON list: "
                             "join the lists into one, or write the rows as JSON lines)")
