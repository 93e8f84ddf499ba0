"""Markdown tables, atomic CSV/JSON/text writers and the scaling plot."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from ddptune import report

ROWS = [
    {"nproc": 1, "speedup": 1.0, "compute_s": 0.50, "imbalance_s": 0.0, "exposed_comm_s": 0.0, "rest_s": 0.01,
     "predicted_speedup": 1.0},
    {"nproc": 2, "speedup": 1.9, "compute_s": 0.50, "imbalance_s": 0.02, "exposed_comm_s": 0.03, "rest_s": 0.01,
     "predicted_speedup": 1.95},
    {"nproc": 4, "speedup": None, "compute_s": 0.50, "imbalance_s": None, "exposed_comm_s": 0.07, "rest_s": 0.01,
     "predicted_speedup": 3.7},
]


def test_markdown_table() -> None:
    rows = [{"name": "a|b", "x": 1.23456, "n": 3}, {"name": "c", "x": None, "n": 10}]
    text = report.markdown_table(rows, [("name", "Name"), ("x", "X value"), ("n", "N")])
    assert text == (
        "| Name | X value | N |\n"
        "| --- | ---: | ---: |\n"
        "| a\\|b | 1.235 | 3 |\n"
        "| c |  | 10 |\n"
    )
    default = report.markdown_table(rows, floatfmt=".2f")
    assert default.splitlines()[0] == "| name | x | n |"
    assert "1.23" in default


def test_csv_round_trip(tmp_path: Path) -> None:
    path = report.write_csv(tmp_path / "sub" / "rows.csv", ROWS, [("nproc", "N"), ("speedup", "S")])
    with open(path, newline="") as f:
        back = list(csv.DictReader(f))
    assert back == [{"nproc": str(r["nproc"]), "speedup": "" if r["speedup"] is None else str(r["speedup"])} for r in ROWS]
    assert [p.name for p in path.parent.iterdir()] == ["rows.csv"]  # no temp file left behind


def test_json_and_text(tmp_path: Path) -> None:
    report.write_json(tmp_path / "a.json", {"rows": ROWS})
    assert json.loads((tmp_path / "a.json").read_text()) == {"rows": ROWS}
    report.write_text(tmp_path / "a.md", "hello\n")
    report.write_text(tmp_path / "a.md", "again\n")  # replaces
    assert (tmp_path / "a.md").read_text() == "again\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "a.md"]


def test_plot_scaling_png(tmp_path: Path) -> None:
    path = report.plot_scaling(tmp_path / "scaling.png", {"same-per-device": ROWS, "same-global": ROWS[:2]})
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1024
    # without predictions or timings it still draws
    bare = report.plot_scaling(tmp_path / "bare.png", {"m": [{"nproc": 2, "speedup": 1.5}, {"nproc": 1, "speedup": 1.0}]})
    assert Path(bare).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_step_plot_legend_covers_no_bar() -> None:
    """Bars of equal height fill their axes to the top: a legend inside would cover some of them."""
    fig = report.scaling_figure({"same-per-device": ROWS, "same-global": ROWS[:2]})
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    for ax in fig.axes[1::2]:  # (b), the stacked step times, of each mode
        legend = ax.get_legend().get_window_extent(renderer)
        bars = [patch.get_window_extent(renderer) for patch in ax.patches if patch.get_height() > 0]
        assert bars and not [bar for bar in bars if bar.overlaps(legend)]
        assert legend.x0 >= ax.get_window_extent(renderer).x1  # beside the axes
    assert fig.axes[0].get_xlabel() == "processes (GPUs)"
    assert report.scaling_figure({"m": ROWS}, gpus=False).axes[0].get_xlabel() == "processes"


def test_seconds_read_in_their_unit() -> None:
    cases = [(6.871e-05, "68.7 µs"), (1.82e-07, "182 ns"), (0.2456, "246 ms"), (0.9999, "1 s"), (12.34, "12.3 s"),
             (1234.5, "1,234 s"), (-0.0031, "-3.1 ms"), (0.0, "0 s")]
    assert [report.seconds_text(seconds) for seconds, _ in cases] == [text for _, text in cases]
    table = report.markdown_table([{"t_s": 6.871e-05, "x": 6.871e-05}, {"t_s": None, "x": None}],
                                  formats={"t_s": report.seconds_text})
    assert table.splitlines()[2:] == ["| 68.7 µs | 6.871e-05 |", "|  |  |"]
