"""Checks for the shipped demo dataset and its generator (tools/make_demo_data.py)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "src" / "ddptune" / "demo_data" / "demo.jsonl"
SCRIPT = ROOT / "tools" / "make_demo_data.py"
LINE_RE = re.compile(r"^[^:\n]+: .+")


@pytest.fixture(scope="module")
def rows():
    with open(DATA, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_shape(rows):
    assert len(rows) == 600
    assert len({r["id"] for r in rows}) == 600
    for r in rows:
        assert set(r) == {"id", "dialogue", "summary"}
        assert isinstance(r["dialogue"], str) and r["dialogue"].strip()
        assert isinstance(r["summary"], str) and r["summary"].strip()


def test_dialogue_lines(rows):
    for r in rows:
        lines = r["dialogue"].split("\n")
        assert 3 <= len(lines) <= 12, r["id"]
        for line in lines:
            assert LINE_RE.match(line), (r["id"], line)
        speakers = {line.split(": ", 1)[0] for line in lines}
        assert 2 <= len(speakers) <= 4, r["id"]
        # the summary is about the conversation: it names at least one speaker
        assert any(s in r["summary"] for s in speakers), r["id"]


def test_variety(rows):
    assert len({r["dialogue"] for r in rows}) == 600
    assert len({r["summary"] for r in rows}) > 500


def test_file_size():
    assert DATA.stat().st_size < 400 * 1024


def test_generator_reproduces_shipped_file(tmp_path):
    out = tmp_path / "demo.jsonl"
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--rows", "600", "--seed", "0"],
                   check=True, capture_output=True)
    assert out.read_bytes() == DATA.read_bytes()


def test_generator_options(tmp_path):
    a, b, c = (tmp_path / n for n in ("a.jsonl", "b.jsonl", "c.jsonl"))
    for path, seed in ((a, 1), (b, 1), (c, 2)):
        subprocess.run([sys.executable, str(SCRIPT), "--out", str(path), "--rows", "20", "--seed", str(seed)],
                       check=True, capture_output=True)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert len(a.read_text(encoding="utf-8").splitlines()) == 20
