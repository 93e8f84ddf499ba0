"""A run's data prepared once: every source's rows checked and tokenized on every core into a store.

`prepare(d, tokenizer)` finds or makes the store (store.py) of each source of data.train and
data.val. Making one reads the source's selected rows in chunks (rows.py); each chunk is parsed,
checked, normalised and tokenized in batched calls (data.py) by a worker process, one per core
(a source of a few thousand rows stays in this process), and the results are written in order,
with one progress bar. The first bad row stops it with one line naming the source, the row and the
fix, and nothing is kept. The store's key is the source's content, its rows, the format options
and the tokenizer, so another run on the same data reads what this one made. `load(prepared)` opens
the stores as the run's examples: a process holds their index, and reads a step's tokens when the
step is built. Nothing here knows about ranks: the caller chooses which process prepares.
"""
from __future__ import annotations

import multiprocessing
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path

import numpy as np

from ddptune import data
from ddptune.data import rows as rows_lib, store as store_lib
from ddptune.config import ConfigError, DataConfig
from ddptune.data.tokens import IGNORE

POOL_AFTER = 8  # chunks a source must have before worker processes take it (fewer: tokenized here)
CUT_CODES = {"dialogue": 1, "user": 2, "earliest": 3}
CUT_WHERE = {1: "lost the end of their dialogue or summary", 2: "were cut inside their user turns", 3: "lost their earliest tokens"}


@dataclass(frozen=True)
class Prepared:
    """Where each source's examples are: (name, store folder) for train and val, what was cut or
    dropped, and the stores made by this call (the others were found made)."""
    train: tuple[tuple[str, str], ...]
    val: tuple[tuple[str, str], ...]
    notes: tuple[str, ...]
    made: tuple[str, ...] = ()


@dataclass(frozen=True)
class Job:
    """What a worker needs to turn a chunk of one source's rows into examples."""
    field: str
    source: str
    fmt: str
    d: DataConfig


@dataclass
class Chunk:
    """A chunk's examples as arrays (store.Writer.add's), or the first problem among its rows."""
    rows: int
    ids: np.ndarray | None = None
    trained: np.ndarray | None = None
    index: np.ndarray | None = None
    dropped: tuple[int, ...] = ()
    problem: str | None = None


def prepare(d: DataConfig, tokenizer, progress: bool = False) -> Prepared:
    """Every source's store, found or made; ConfigError for the first row that cannot be used, or for
    a mixture source left without examples."""
    tok_id, made, notes, sizes, new = data.fingerprint(tokenizer), {"train": [], "val": []}, [], [], []
    for split in ("train", "val"):
        for s in data.sources(d, split):
            def filled(writer, s=s):
                new.append(s.name)
                return fill(writer, s, d, tokenizer, progress)

            store = store_lib.ensure(key_parts(s, d, tok_id), len(tokenizer), filled)
            made[split].append((s.name, str(store.folder)))
            sizes += [store.meta["examples"]] if split == "train" else []
            if line := note(s, store.meta, d):
                notes.append(line)
    if len(sizes) > 1:
        data.draws(data.sources(d, "train"), sizes)
    return Prepared(tuple(made["train"]), tuple(made["val"]), tuple(notes), tuple(new))


def load(p: Prepared) -> tuple[store_lib.Examples, store_lib.Examples]:
    """The training and validation examples of prepared stores; with several sources in a split each
    example names its own (`"source"`). Each process checks the stores' sizes and index only: prepare
    read every byte of them once, on this node, before (each process doing it again would cost N times that)."""
    out = []
    for found in (p.train, p.val):
        stores = [store_lib.open_store(Path(folder), whole=False) for _, folder in found]  # prepare read them whole
        if any(s is None for s in stores):
            raise ConfigError([f"DDPTUNE_CACHE: the tokenized data in {found[stores.index(None)][1]} is gone or damaged "
                               "since it was made (start the run again: it is made anew)"])
        out.append(store_lib.Examples(stores, [name for name, _ in found] if len(found) > 1 else None))
    return out[0], out[1]


def key_parts(s: data.Source, d: DataConfig, tok_id: str) -> list:
    """What a source's store depends on: its content, its rows, the options that shape its examples, the tokenizer
    (its chat template, data.chat_template's where set, among them)."""
    columns = (d.prompt_column, d.completion_column)  # named apart from the defaults only: stores made before stay found
    return ["examples", rows_lib.identity(s.source), s.rows, d.format, d.dialogue_column, d.summary_column,
            d.instruction, d.loss_on, d.max_length, d.system_prompt, d.template, tok_id] + \
        ([*columns] if columns != (DataConfig.prompt_column, DataConfig.completion_column) else [])


def note(s: data.Source, meta: dict, d: DataConfig) -> str | None:
    """One line for a source whose rows were cut or dropped to fit data.max_length."""
    cut, dropped = meta["cut"], meta["dropped"]
    if not cut and not dropped:
        return None
    where = ", ".join(f"{n} {CUT_WHERE[int(code)]}" for code, n in sorted(meta["cuts"].items()))
    return (f"{s.field} ({s.name}): {cut} of {meta['rows']} rows cut to data.max_length={d.max_length}"
            + (f" ({where})" if cut else "") + f", {dropped} dropped"
            + (f" (their final assistant turn alone is too long; the first: row {meta['dropped_rows'][0]})" if dropped else ""))


def fill(writer: store_lib.Writer, s: data.Source, d: DataConfig, tokenizer, progress: bool) -> dict:
    """Read, check and tokenize the source's selected rows into `writer`; the store's meta figures."""
    try:
        picked = rows_lib.selection(s.source, s.rows)
        fmt = data.format_of(s.source, d)
    except (ValueError, OSError) as e:
        raise ConfigError([data.read_problem(s.field, s.source, e)]) from None
    if not picked:
        raise ConfigError([f"{s.field}: rows {s.rows!r} select nothing from {rows_lib.count(s.source)} rows of {s.source}"])
    job, dropped, cuts = Job(s.field, s.source, fmt, d), [], {}
    for chunk in tokenized_chunks(job, tokenizer, rows_lib.chunks(s.source, picked), len(picked), progress, s.name):
        if chunk.problem:
            raise ConfigError([chunk.problem])
        writer.add(chunk.ids, chunk.trained, chunk.index)
        dropped += chunk.dropped
        codes = chunk.index[:, store_lib.INDEX.index("cut")]
        for code in codes[codes > 0].tolist():
            cuts[str(code)] = cuts.get(str(code), 0) + 1
    return {"source": s.source, "format": fmt, "rows": len(picked), "dropped": len(dropped), "dropped_rows": dropped[:20],
            "cut": sum(cuts.values()), "cuts": cuts}


def tokenized_chunks(job: Job, tokenizer, chunks, total: int, progress: bool, name: str):
    """Each chunk's Chunk, in order: in worker processes, one per core, when there are many."""
    from tqdm.auto import tqdm

    chunks = iter(chunks)
    first = list(islice(chunks, POOL_AFTER))
    workers = len(os.sched_getaffinity(0))
    with tqdm(total=total, desc=f"tokenize {name}", unit=" rows", disable=not progress, leave=False, dynamic_ncols=True) as bar:
        if len(first) < POOL_AFTER or workers < 2:
            results = (work(job, tokenizer, c) for c in chain(first, chunks))
        else:
            results = pooled(job, tokenizer, chain(first, chunks), workers)
        for chunk in results:
            bar.update(chunk.rows)
            yield chunk


def pooled(job: Job, tokenizer, chunks, workers: int):
    """work() of every chunk in `workers` forked processes, at most two chunks each in flight (a chunk
    is read only when there is room for it), results in order. Stopped early (a bad row), it waits
    for the chunks in flight and cancels none that are not: a pool torn down with tasks still queued to
    its workers can hang (multiprocessing.Pool.terminate did, here); a worker that dies raises."""
    context = multiprocessing.get_context("fork")
    with _forking(), ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=(job, tokenizer)) as pool:
        pending = deque()
        try:
            for chunk in chunks:
                pending.append(pool.submit(_work, chunk))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


@contextmanager
def _forking():
    """The workers tokenize one batch at a time each: the tokenizer's own threads stay off in them
    (set before they are forked, at the first chunk, so that the tokenizer library does not warn of
    the threads it used here)."""
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


_WORKER: tuple = ()


def _start_worker(job: Job, tokenizer) -> None:
    global _WORKER
    _WORKER = (job, tokenizer)


def _work(chunk: list) -> Chunk:
    return work(*_WORKER, chunk)


def work(job: Job, tokenizer, chunk: list) -> Chunk:
    """A chunk of (row number, item) pairs parsed, checked, normalised and tokenized."""
    normal, where = [], []
    for number, item in chunk:
        try:
            row = rows_lib.parse(item, number)
        except (ValueError, UnicodeDecodeError) as e:
            return Chunk(len(chunk), problem=data.read_problem(job.field, job.source, e))
        if wrong := data.row_problem(row, job.fmt, job.d):
            return Chunk(len(chunk), problem=f"{job.field}: row {number} of {job.source}{wrong}")
        normal.append(data.normalise(row, number, job.fmt, job.d))
        where.append(f"{job.field}: row {number} of {job.source}")
    try:
        examples = data.tokenize(normal, tokenizer, job.d, where)
    except ConfigError as e:
        return Chunk(len(chunk), problem=e.problems[0])
    return as_arrays(examples, [number for number, _ in chunk])


def as_arrays(examples: list, numbers: list[int]) -> Chunk:
    """The kept examples as one run of ids and masks with their index rows (store.INDEX)."""
    kept = [(e, n) for e, n in zip(examples, numbers) if e is not None]
    dropped = tuple(n for e, n in zip(examples, numbers) if e is None)
    if not kept:
        return Chunk(len(examples), np.zeros(0, np.int64), np.zeros(0, np.uint8), np.zeros((0, len(store_lib.INDEX)), np.int64), dropped)
    lengths = np.array([len(e["input_ids"]) for e, _ in kept], np.int64)
    ids = np.concatenate([np.asarray(e["input_ids"], np.int64) for e, _ in kept])
    trained = np.concatenate([np.asarray(e["labels"], np.int64) for e, _ in kept]) != IGNORE
    offsets = np.cumsum(lengths) - lengths
    targets = np.add.reduceat(trained, offsets) - trained[offsets]  # a sample's first label is no target
    index = np.stack([offsets, lengths, [e["prompt_len"] for e, _ in kept], targets, [n for _, n in kept],
                      [CUT_CODES.get(e.get("cut"), 0) for e, _ in kept]], axis=1).astype(np.int64)
    return Chunk(len(examples), ids, trained.astype(np.uint8), index, dropped)
