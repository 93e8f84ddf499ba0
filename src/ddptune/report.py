"""Turn plain data (lists of dicts) into tables, files and plots; no torch here.

Every writer is atomic: it writes a temporary file in the destination folder and then
`os.replace`s it over the target, so a reader never sees half a file.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Column = tuple[str, str]  # (row key, header)


def _atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `path` via a temporary file in the same folder + os.replace. The temporary
    file is created as `open` creates one, 0666 less the umask (mkstemp's would stay private, 0600)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
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
                   floatfmt: str = ".4g", formats: dict[str, Callable[[Any], str]] | None = None) -> str:
    """Render rows as a GitHub-flavoured markdown table.

    `columns` is a list of (key, header) pairs (a bare key is its own header); missing values and
    None print as empty cells, floats with `floatfmt` or their column's function in `formats` (e.g.
    seconds_text). Numeric columns are right-aligned.
    """
    formats = formats or {}
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
        cells = [(formats[key](row[key]) if key in formats and row.get(key) is not None else _cell(row.get(key), floatfmt))
                 .replace("|", "\\|").replace("\n", " ") for key, _ in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def seconds_text(seconds: float) -> str:
    """A time in the unit that reads at a glance: 182 ns, 68.7 µs, 1.23 ms, 246 ms, 12.3 s, 1,234 s."""
    size = abs(seconds)
    if size == 0 or not math.isfinite(seconds):
        return f"{seconds:g} s"
    for unit, scale in (("ns", 1e-9), ("µs", 1e-6), ("ms", 1e-3)):
        if float(f"{size / scale:.3g}") < 1000:  # as rounded: 0.9999 s is 1 s, not 1e+03 ms
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds:.3g} s" if size < 100 else f"{seconds:,.0f} s"


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


PARTS = [("compute_s", "compute (mean process)"), ("imbalance_s", "imbalance (slowest - mean)"),
         ("exposed_comm_s", "exposed communication"), ("rest_s", "rest (optimizer, data, gaps)")]


def plot_losses(path: str | os.PathLike[str], curves: dict[str, Sequence[tuple[int, float]]]) -> Path:
    """Write a PNG of training loss against optimizer step, one line per run (label: points)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for label, points in curves.items():
        if points:
            ax.plot(*zip(*points), label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return _atomic_write_bytes(path, buf.getvalue())


def plot_scaling(path: str | os.PathLike[str], groups: dict[str, Sequence[dict[str, Any]]],
                 title: str = "Data-parallel scaling", gpus: bool = True) -> Path:
    """Write scaling_figure's PNG."""
    buf = io.BytesIO()
    scaling_figure(groups, title, gpus).savefig(buf, format="png", dpi=110)
    return _atomic_write_bytes(path, buf.getvalue())


def scaling_figure(groups: dict[str, Sequence[dict[str, Any]]], title: str = "Data-parallel scaling", gpus: bool = True):
    """A figure with, for each group (a scaling mode) of rows, (a) speedup against processes
    (ideal y = x; dashed "predicted_speedup" where present) and (b) each count's step time
    stacked from its parts (`PARTS`; a part that is None, e.g. lost in noise, draws as 0), its
    legend beside the bars (inside, it hid the tops of bars that fill the axes).

    Row keys: "nproc", "speedup" (None: not published), and the PARTS keys; "predicted_speedup" and
    "per_process" (a marker at each count's ideal step) optional. `gpus`: one process per GPU (else CPU processes).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg: no display needed
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2 * len(groups)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(groups), 2, squeeze=False)
    for (label, rows), (ax1, ax2) in zip(groups.items(), axes):
        data = sorted(rows, key=lambda row: row["nproc"])
        ns = [int(r["nproc"]) for r in data]
        top = max(ns + [1])
        ax1.plot([1, top], [1, top], color="grey", linestyle=":", label="ideal (y = x)")
        for key, style, name in (("speedup", dict(marker="o"), "measured"),
                                 ("predicted_speedup", dict(linestyle="--", marker="x"), "predicted")):
            points = [(n, r[key]) for n, r in zip(ns, data) if r.get(key) is not None]
            if points:
                ax1.plot(*zip(*points), label=name, **style)
        ax1.set_xlabel("processes (GPUs)" if gpus else "processes")
        ax1.set_ylabel("speedup vs 1 process")
        ax1.set_title(f"(a) speedup, {label}")
        ax1.set_xticks(sorted(set(ns + [1])))
        ax1.grid(alpha=0.3)
        ax1.legend()

        pos = list(range(len(data)))
        bottom = [0.0] * len(data)
        for key, name in PARTS:
            heights = [max(0.0, float(r.get(key) or 0.0)) for r in data]
            ax2.bar(pos, heights, bottom=bottom, label=name)
            bottom = [b + h for b, h in zip(bottom, heights)]
        one = data[0] if data and data[0]["nproc"] == 1 else None
        ideal = [(x, r["per_process"] / one["per_process"] * one["step_s"]) for x, r in zip(pos, data)
                 if one and r is not one and r.get("per_process") and one.get("per_process")]
        if ideal:  # n = 1's step for the count's samples per process: the bar above it is what was lost
            xs, ys = zip(*ideal)
            ax2.hlines(ys, [x - 0.4 for x in xs], [x + 0.4 for x in xs], colors="black", linestyles="--", linewidth=1.5,
                       zorder=3, label="ideal step: n = 1's for as many samples per process")
        ax2.set_xticks(pos, [str(n) for n in ns])
        ax2.set_xlabel("processes (GPUs)" if gpus else "processes")
        ax2.set_ylabel("step time (s)")
        ax2.set_title(f"(b) where a step's time goes, {label}")
        ax2.grid(axis="y", alpha=0.3)
        ax2.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.suptitle(title)
    return fig
