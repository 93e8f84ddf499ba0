"""The project speaks of the software, its results and how to reproduce them: no tracked file
mentions how it was developed (work sessions, issue numbers, device calls, leases, what was lent).
torchrun's and POSIX's own terms ("a session of its own", start_new_session) and pytest's
scope="session" are the software's words, and allowed."""
from __future__ import annotations

import re
import subprocess

from conftest import ROOT

WORDS = re.compile(r"\bsessions?\b|\bissue ?#?\d+|\bcalls? \d+|\bleases?\b|\blent\b|device time", re.I)
ALLOWED = re.compile(r"start_new_session|scope=[\"']session[\"']|a session of its own|new_session", re.I)


def tracked() -> list:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    names = listed.stdout.split() if listed.returncode == 0 else [
        str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts and ".venv" not in p.parts]
    return [ROOT / n for n in names if (ROOT / n).is_file()]


def test_no_tracked_file_speaks_of_how_the_software_was_developed():
    found = []
    for path in tracked():
        if path.name == "test_docs.py":  # this file names the words it forbids
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a picture, a binary
        for number, line in enumerate(text.splitlines(), 1):
            if WORDS.search(ALLOWED.sub("", line)):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert found == []


def test_the_check_sees_the_words_it_forbids():
    for line in ("the fifth session measured it", "see issue 16", "in call 3", "the lease ran out", "not lent"):
        assert WORDS.search(ALLOWED.sub("", line)), line
    for line in ("subprocess.Popen(cmd, start_new_session=True)", '@pytest.fixture(scope="session")',
                 "torchrun runs in a session of its own"):
        assert not WORDS.search(ALLOWED.sub("", line)), line


def test_the_readme_is_read_in_ten_minutes():
    """At most 250 lines; what comes before the quick start is a few lines with at most 5 figures; the
    sections come in the order a newcomer needs them."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    intro = text[:text.index("\n## Quick start\n")]
    assert len(intro.splitlines()) <= 7 and len(re.findall(r"\d+(?:[.,]\d+)*\s*(?:%|×|x\b|GiB|s\b)", intro)) <= 5
    titles = re.findall(r"^## (.+)$", text, re.M)
    assert titles[:3] == ["Quick start", "Results at a glance", "Using it"] and titles[-3:] == [
        "Config reference", "How it is built", "Licence"]
    table = text[text.index("## Results at a glance"):text.index("## Using it")]
    rows = [line for line in table.splitlines() if line.startswith("| [")]
    assert 0 < len(rows) <= 6 and all("BENCHMARKS.md#" in line for line in rows)


def test_config_docstrings_say_what_a_knob_does_in_a_few_lines():
    from ddptune import configref

    long = {r["key"]: len(r["doc"]) for r in configref.reference() if len(r["doc"]) > 300}
    assert long == {}
