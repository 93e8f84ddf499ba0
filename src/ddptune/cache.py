"""Where ddptune keeps what it makes once and reuses: `$DDPTUNE_CACHE`, else ~/.cache/ddptune.

Under it: presets/ (model.py's random-weight models), gguf/ (sources.py's converted GGUF files) and
tokens/ (data/store.py's tokenized data).
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir or os.environ.get("DDPTUNE_CACHE", Path.home() / ".cache" / "ddptune"))
