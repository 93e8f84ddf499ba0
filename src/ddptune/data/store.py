"""Tokenized data kept once: token ids and loss masks in flat files that every process maps.

A store is a folder `$DDPTUNE_CACHE/tokens/KEY/`, KEY a hash of what made it (the data, its rows,
the format options, the tokenizer):
  ids.bin      the kept examples' token ids one after another (uint16 where the vocabulary fits, else int32)
  trained.bin  a byte a token: 1 where the token is a loss target (its label is its id), else 0
  index.npy    int64 rows of INDEX: where each example lies, its prompt and target counts, its row
  meta.json    the key's parts, the counts, the dropped rows, the vocabulary size, each file's size and crc32
About 3 bytes a token on disk (5 with int32 ids), a few dozen a row. `ensure` makes it in a temporary
folder, renamed into place, under a file lock: the first process to come makes it, any other (a
process of the same node, or of another node where the cache is shared) waits and opens it. Before a
run uses a store it is read whole once (`inspect`): a file of another size or checksum than meta.json
names, an id outside the vocabulary, a mask byte other than 0 or 1, or examples that do not lie in order
inside ids.bin make it again, as a store cut short does. `Examples` reads it as a sequence of example
dicts, each read from the page cache only when it is asked for: a process holds the index.
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
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ddptune import checkpoint
from ddptune.cache import cache_root
from ddptune.config import ConfigError
from ddptune.data.tokens import IGNORE

VERSION = 2  # of the layout and of what tokenizing gives: a change makes every key new (2: checksums in meta.json)
FILES = ("ids.bin", "trained.bin", "index.npy")
INDEX = ("offset", "length", "prompt_len", "targets", "row", "cut")
CUTS = {1: "the end of the dialogue or summary", 2: "inside their longest user turn", 3: "their earliest tokens"}


def root() -> Path:
    return cache_root() / "tokens"


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
        self.vocab = vocab
        self.index: list[np.ndarray] = []
        self.tokens = 0
        self.crc = {"ids.bin": 0, "trained.bin": 0}  # of the bytes written, as they are written

    def add(self, ids: np.ndarray, trained: np.ndarray, index: np.ndarray) -> None:
        """A run of examples: their ids and masks one after another, and their index rows (offsets
        counted from the run's start)."""
        for f, name, data in ((self.ids, "ids.bin", ids.astype(self.dtype, copy=False).tobytes()),
                              (self.trained, "trained.bin", trained.astype(np.uint8, copy=False).tobytes())):
            f.write(data)
            self.crc[name] = zlib.crc32(data, self.crc[name])
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
        sizes = {name: (self.folder / name).stat().st_size for name in FILES}
        meta = {**meta, "version": VERSION, "dtype": self.dtype.name, "vocab": self.vocab, "examples": len(index),
                "tokens": self.tokens, "bytes": sizes, "crc32": {**self.crc, "index.npy": checksum(self.folder / "index.npy")}}
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


def checksum(path: Path, piece: int = 1 << 23) -> int:
    """The file's zlib.crc32, read in 8 MiB pieces. crc32, not a cryptographic hash: what it guards
    against is a disk's or a killed writer's damage (pages zero-filled or overwritten, bytes shifted),
    which it misses once in 4 billion, and it is the fastest of the standard library's: on one AMD EPYC
    core, 2.1 GB/s against sha256's 1.4 (with SHA extensions) and blake2b's 0.5."""
    crc, buf = 0, bytearray(piece)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc


def damage(store: Store) -> str | None:
    """What shows an opened store's values are none that tokenizing writes, or None: an id outside the
    vocabulary, a mask byte other than 0 or 1, an example that does not lie inside ids.bin after the one
    before it, or one that claims more prompt or target tokens than it has. (A checksum that holds
    where these do not: meta.json rewritten to match, or a writer's bug.)"""
    meta, ids, trained = store.meta, store.ids, store.trained
    if len(ids) and (int(ids.max()) >= meta["vocab"] or (ids.dtype.kind == "i" and int(ids.min()) < 0)):
        return f"ids.bin holds ids outside the vocabulary of {meta['vocab']}"
    if len(trained) and int(trained.max()) > 1:
        return "trained.bin holds mask bytes other than 0 and 1"
    offset, length = store.column("offset"), store.column("length")
    if len(offset) and (offset[0] < 0 or (length < 1).any() or (offset[1:] < offset[:-1] + length[:-1]).any()
                        or offset[-1] + length[-1] > meta["tokens"]):
        return "index.npy holds examples that do not lie in order inside ids.bin"
    for name in ("prompt_len", "targets"):
        if ((col := store.column(name)) < 0).any() or (col > length).any():
            return f"index.npy holds {name} outside its examples"
    return None


def inspect(folder: Path, whole: bool = True) -> Store | str | None:
    """The store in `folder`; None where there is none; else what is wrong with it. `whole`: every
    byte read too, each file's crc32 and `damage` (what `ensure` does, once a node before a run uses
    it); else the files' sizes and the index's shape only (the run's processes, each opening it after)."""
    if not os.path.lexists(folder):
        return None
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if meta.get("version") != VERSION:
            return f"its layout is version {meta.get('version')}, not {VERSION}"
        if wrong := [name for name in FILES if (folder / name).stat().st_size != meta["bytes"][name]]:
            return f"{wrong[0]} does not have the size meta.json names"
        if whole and (wrong := next((name for name in FILES if checksum(folder / name) != meta["crc32"][name]), None)):
            return f"{wrong} does not have the checksum meta.json names"
        store = Store(folder, meta)
        if store.index.shape != (meta["examples"], len(INDEX)):
            return "index.npy does not have the shape meta.json names"
        return (damage(store) if whole else None) or store
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{type(e).__name__}: {e}"


def open_store(folder: Path, whole: bool = True) -> Store | None:
    """The store in `folder`, or None when there is none or it is damaged (`inspect`)."""
    found = inspect(folder, whole)
    return found if isinstance(found, Store) else None


def ensure(parts: list, vocab: int, fill) -> Store:
    """The store of `parts`, made by `fill(writer) -> meta` where no whole one exists yet (a damaged one
    is removed first, with a line that says why). `fill` may raise (a bad row): nothing is left behind
    then. ConfigError where the cache cannot be written or runs out of space."""
    folder = root() / key_of(parts)
    if isinstance(found := inspect(folder), Store):
        return found
    with locked(folder):
        found = inspect(folder)  # made meanwhile by the process we waited for, or still damaged
        if isinstance(found, Store):
            return found
        if found is not None:
            try:
                shutil.rmtree(folder)
            except OSError as e:
                raise unwritable(folder.parent, e, f"; the damaged {folder.name} in it cannot be removed") from None
            print(f"ddptune: the tokenized data in {folder} is damaged ({found}): making it again", file=sys.stderr)
        for left in folder.parent.glob(f".{folder.name}.tmp-*"):  # a maker killed midway (we hold the lock)
            shutil.rmtree(left, ignore_errors=True)
        tmp, writer = None, None
        try:
            tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.tmp-"))
            writer = Writer(tmp, vocab)
            writer.close({"parts": parts, **fill(writer)})
            os.chmod(tmp, checkpoint.plain_mode())
            os.replace(tmp, folder)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise unwritable(folder.parent, e) from None
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            done = f"{sum(map(len, writer.index)):,} examples" if writer else "no example"
            raise ConfigError([f"DDPTUNE_CACHE: {folder.parent} ran out of space ({e.strerror}) after {done} of the tokenized "
                               f"data (a store takes about {id_dtype(vocab).itemsize + 1} bytes a token; free space there, "
                               "or set DDPTUNE_CACHE to a folder with more)"]) from None
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    store = open_store(folder)
    if store is None:
        raise ConfigError([f"DDPTUNE_CACHE: the tokenized data written to {folder} cannot be read back (check the disk, "
                           "or set DDPTUNE_CACHE to another folder)"])
    return store


def unwritable(where: Path, e: OSError, detail: str = "") -> ConfigError:
    """The one line for a cache folder that cannot be written (or a damaged store in it removed)."""
    return ConfigError([f"DDPTUNE_CACHE: {where} cannot be written ({e.strerror}{detail}; set DDPTUNE_CACHE to a "
                        "folder you can write to)"])


@contextlib.contextmanager
def locked(folder: Path):
    """An exclusive lock on `folder`'s lock file, held while the store is made."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        f = open(folder.with_name(folder.name + ".lock"), "a")
    except OSError as e:
        raise unwritable(folder.parent, e) from None
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
