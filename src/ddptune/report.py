"""Turn plain data (lists of dicts) into tables, files and plots; no torch here.

Every writer is atomic: it writes a temporary file in the destination folder and then
`os.replace`s it over the target, so a reader never sees half a file.
"""
from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Column = tuple[str, str]  # (row key, header)


def _atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `path` via a temporary file in the same folder + os.replace."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Atomically write `text` (UTF-8) to `path`; return the path."""
    return _atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Atomically write `obj` as indented JSON; return the path."""
    return write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def _columns(rows: Sequence[dict[str, Any]], columns: Sequence[Column | str] | None) -> list[Column]:
    """Normalise `columns`; default: every key in order of first appearance."""
    if columns is None:
        keys: dict[str, None] = {}
        for row in rows:
            keys.update(dict.fromkeys(row))
        return [(k, k) for k in keys]
    return [(c, c) if isinstance(c, str) else (c[0], c[1]) for c in columns]


def _cell(value: Any, floatfmt: str) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if abs(value) >= 1e4 and value == value and abs(value) != float("inf"):
            return f"{value:,.0f}"  # 20,740 rather than 2.074e+04
        return format(value, floatfmt)
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column | str] | None = None,
                   floatfmt: str = ".4g") -> str:
    """Render rows as a GitHub-flavoured markdown table.

    `columns` is a list of (key, header) pairs (a bare key is its own header); missing values and
    None print as empty cells, floats with `floatfmt`. Numeric columns are right-aligned.
    """
    cols = _columns(rows, columns)
    if not cols:
        return ""
    lines = ["| " + " | ".join(h.replace("|", "\\|") for _, h in cols) + " |"]
    aligns = []
    for key, _ in cols:
        values = [r.get(key) for r in rows if r.get(key) is not None]
        numeric = bool(values) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                       for v in values)
        aligns.append("---:" if numeric else "---")
    lines.append("| " + " | ".join(aligns) + " |")
    for row in rows:
        cells = [_cell(row.get(key), floatfmt).replace("|", "\\|").replace("\n", " ")
                 for key, _ in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_csv(path: str | os.PathLike[str], rows: Sequence[dict[str, Any]],
              columns: Sequence[Column | str] | None = None) -> Path:
    """Atomically write rows as CSV. The header holds the row keys (not display headers), so
    `csv.DictReader` reads the same keys back; None and missing values are empty fields."""
    keys = [k for k, _ in _columns(rows, columns)]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row.get(k) for k in keys})
    return write_text(path, buf.getvalue())


def plot_scaling(path: str | os.PathLike[str], rows: Sequence[dict[str, Any]],
                 title: str = "Data-parallel scaling") -> Path:
    """Write a PNG with (a) speedup vs processes (ideal y=x; dashed "predicted_speedup" if
    present) and (b) stacked bars of step time split into compute and communication.

    Row keys: "nproc", "speedup", "compute_s", "comm_s" (optional: "predicted_speedup").
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg: no display needed
    from matplotlib.figure import Figure

    data = sorted(rows, key=lambda r: r["nproc"])
    ns = [int(r["nproc"]) for r in data]
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)

    top = max(ns + [1])
    ax1.plot([1, top], [1, top], color="grey", linestyle=":", label="ideal (y = x)")
    measured = [(n, r["speedup"]) for n, r in zip(ns, data) if r.get("speedup") is not None]
    if measured:
        ax1.plot(*zip(*measured), marker="o", label="measured")
    predicted = [(n, r["predicted_speedup"]) for n, r in zip(ns, data)
                 if r.get("predicted_speedup") is not None]
    if predicted:
        ax1.plot(*zip(*predicted), linestyle="--", marker="x", label="predicted")
    ax1.set_xlabel("processes (GPUs)")
    ax1.set_ylabel("speedup vs 1 process")
    ax1.set_title("(a) speedup")
    ax1.set_xticks(sorted(set(ns + [1])))
    ax1.grid(alpha=0.3)
    ax1.legend()

    pos = list(range(len(data)))
    compute = [float(r.get("compute_s") or 0.0) for r in data]
    comm = [float(r.get("comm_s") or 0.0) for r in data]
    ax2.bar(pos, compute, label="compute")
    ax2.bar(pos, comm, bottom=compute, label="communication")
    ax2.set_xticks(pos, [str(n) for n in ns])
    ax2.set_xlabel("processes (GPUs)")
    ax2.set_ylabel("step time (s)")
    ax2.set_title("(b) step time split")
    ax2.grid(axis="y", alpha=0.3)
    ax2.legend()
    fig.suptitle(title)

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    return _atomic_write_bytes(path, buf.getvalue())
