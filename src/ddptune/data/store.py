"""Tokenized data kept once: token ids and loss masks in flat files that every process maps.

A store is a folder `$DDPTUNE_CACHE/tokens/KEY/`, KEY a hash of what made it (the data, its rows,
the format options, the tokenizer):
  ids.bin      the kept examples' token ids one after another (uint16 where the vocabulary fits, else int32)
  trained.bin  a byte a token: 1 where the token is a loss target (its label is its id), else 0
  index.npy    int64 rows of INDEX: where each example lies, its prompt and target counts, its row
  meta.json    the key's parts, the counts, the dropped rows and each file's size
About 3 bytes a token on disk (5 with int32 ids), a few dozen a row. `ensure` makes it in a temporary
folder, renamed into place, under a file lock: the first process to come makes it, any other (a
process of the same node, or of another node where the cache is shared) waits and opens it; a store
whose files do not have the sizes meta.json names is made again. `Examples` reads it as a sequence of
example dicts, each read from the page cache only when it is asked for: a process holds the index.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ddptune import checkpoint, sources
from ddptune.config import ConfigError
from ddptune.data.tokens import IGNORE

VERSION = 1  # of the layout and of what tokenizing gives: a change makes every key new
INDEX = ("offset", "length", "prompt_len", "targets", "row", "cut")
CUTS = {1: "the end of the dialogue or summary", 2: "inside their longest user turn", 3: "their earliest tokens"}


def root() -> Path:
    return sources.cache_root() / "tokens"


def key_of(parts: list) -> str:
    return hashlib.sha256(json.dumps([VERSION, *parts], sort_keys=True, default=str).encode()).hexdigest()[:24]


def id_dtype(vocab: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab <= 2**16 else np.int32)


class Writer:
    """Appends tokenized examples to a store's files in a temporary folder."""

    def __init__(self, folder: Path, vocab: int):
        self.folder = folder
        self.dtype = id_dtype(vocab)
        self.ids, self.trained = open(folder / "ids.bin", "wb"), open(folder / "trained.bin", "wb")
        self.index: list[np.ndarray] = []
        self.tokens = 0

    def add(self, ids: np.ndarray, trained: np.ndarray, index: np.ndarray) -> None:
        """A run of examples: their ids and masks one after another, and their index rows (offsets
        counted from the run's start)."""
        self.ids.write(ids.astype(self.dtype, copy=False).tobytes())
        self.trained.write(trained.astype(np.uint8, copy=False).tobytes())
        index = index.copy()
        index[:, 0] += self.tokens
        self.index.append(index)
        self.tokens += len(ids)

    def close(self, meta: dict) -> None:
        for f in (self.ids, self.trained):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        index = np.concatenate(self.index) if self.index else np.zeros((0, len(INDEX)), np.int64)
        np.save(self.folder / "index.npy", index.astype(np.int64))
        sizes = {name: (self.folder / name).stat().st_size for name in ("ids.bin", "trained.bin", "index.npy")}
        meta = {**meta, "version": VERSION, "dtype": self.dtype.name, "examples": len(index), "tokens": self.tokens,
                "bytes": sizes}
        (self.folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


class Store:
    """One store, opened: its files mapped read-only."""

    def __init__(self, folder: Path, meta: dict):
        self.folder, self.meta = folder, meta
        n = meta["tokens"]
        self.ids = np.memmap(folder / "ids.bin", dtype=meta["dtype"], mode="r", shape=(n,)) if n else np.zeros(0, np.int32)
        self.trained = np.memmap(folder / "trained.bin", dtype=np.uint8, mode="r", shape=(n,)) if n else np.zeros(0, np.uint8)
        self.index = np.load(folder / "index.npy", mmap_mode="r")  # no pickle: allow_pickle stays off

    def column(self, name: str) -> np.ndarray:
        return np.asarray(self.index[:, INDEX.index(name)])


def open_store(folder: Path) -> Store | None:
    """The store in `folder`, or None when there is none or it is damaged (a file of another size than
    meta.json says, or meta.json unreadable)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if meta.get("version") != VERSION or any((folder / name).stat().st_size != size
                                                 for name, size in meta["bytes"].items()):
            return None
        store = Store(folder, meta)
        return store if store.index.shape == (meta["examples"], len(INDEX)) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def ensure(parts: list, vocab: int, fill) -> Store:
    """The store of `parts`, made by `fill(writer) -> meta` where no whole one exists yet. `fill` may
    raise (a bad row): nothing is left behind then."""
    folder = root() / key_of(parts)
    if store := open_store(folder):
        return store
    with locked(folder):
        if store := open_store(folder):  # made meanwhile by the process we waited for
            return store
        if folder.exists():
            print(f"ddptune: the tokenized data in {folder} is damaged: making it again", file=sys.stderr)
            shutil.rmtree(folder)
        for left in folder.parent.glob(f".{folder.name}.tmp-*"):  # a maker killed midway (we hold the lock)
            shutil.rmtree(left, ignore_errors=True)
        tmp, writer = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.tmp-")), None
        try:
            writer = Writer(tmp, vocab)
            writer.close({"parts": parts, **fill(writer)})
            os.chmod(tmp, checkpoint.plain_mode())
            os.replace(tmp, folder)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            done = f"{sum(map(len, writer.index)):,} examples" if writer else "no example"
            raise ConfigError([f"DDPTUNE_CACHE: {folder.parent} ran out of space ({e.strerror}) after {done} of the tokenized "
                               f"data (a store takes about {id_dtype(vocab).itemsize + 1} bytes a token; free space there, "
                               "or set DDPTUNE_CACHE to a folder with more)"]) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    store = open_store(folder)
    if store is None:
        raise ConfigError([f"DDPTUNE_CACHE: the tokenized data written to {folder} cannot be read back (check the disk, "
                           "or set DDPTUNE_CACHE to another folder)"])
    return store


@contextlib.contextmanager
def locked(folder: Path):
    """An exclusive lock on `folder`'s lock file, held while the store is made."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        f = open(folder.with_name(folder.name + ".lock"), "a")
    except OSError as e:
        raise ConfigError([f"DDPTUNE_CACHE: {folder.parent} cannot be written ({e.strerror}; set DDPTUNE_CACHE to a "
                           "folder you can write to)"]) from None
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


class Examples(Sequence):
    """The examples of one or more stores as dicts {input_ids, labels, prompt_len[, cut][, source]},
    each read when asked for. `names`: the sources' names, given to their examples where there are
    several. `lengths`, `targets` and `rows` are every example's, as arrays."""

    def __init__(self, stores: list[Store], names: list[str] | None = None):
        self.stores, self.names = stores, names
        self.sizes = [s.meta["examples"] for s in stores]
        self.starts = np.cumsum([0] + self.sizes)
        col = lambda name: np.concatenate([s.column(name) for s in stores]) if stores else np.zeros(0, np.int64)  # noqa: E731
        self.lengths, self.targets, self.rows, self.cut = col("length"), col("targets"), col("row"), col("cut")

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        i = int(i)
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        store = self.stores[k]
        offset, length, prompt_len, _, _, cut = (int(v) for v in store.index[i - self.starts[k]])
        ids = np.asarray(store.ids[offset:offset + length], dtype=np.int64)
        labels = np.where(store.trained[offset:offset + length] != 0, ids, IGNORE)
        example = {"input_ids": ids.tolist(), "labels": labels.tolist(), "prompt_len": prompt_len}
        if cut:
            example["cut"] = True
        if self.names:
            example["source"] = self.names[k]
        return example
