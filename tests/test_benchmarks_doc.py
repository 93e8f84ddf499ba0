"""benchmarks/results holds only raw files that a document cites, and BENCHMARKS.md cites only raw files
that exist. Pure file reading: a file counts as cited where its name appears in BENCHMARKS.md, README.md,
a script under benchmarks/ (results/ aside), a test under tests/ or a module under src/; `{a,b}` in a
cited name stands for each of its choices.

BENCHMARKS.md is current: each `## ` question holds one table of today's figures, with its raw file,
commit and date; superseded figures are one line each under History."""
from __future__ import annotations

import itertools
import re

from conftest import ROOT

RESULTS = ROOT / "benchmarks" / "results"
REFERENCE = {"How to reproduce"}  # machines and scripts: reference tables, not results
HISTORY = "History"
# a raw file's name as the documents write it: the device kind first (h200..., h200x2..., h100...)
CITED = re.compile(r"\b(?:h200|h100|cpu_)[\w.{},+-]*?\.(?:jsonl|json|txt|png|log|csv)\b")


def expand(name: str) -> list[str]:
    """Every name that `name` stands for: `a_{1,2}.json` -> a_1.json, a_2.json."""
    parts = re.split(r"\{([^{}]*)\}", name)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def cited_names(text: str) -> set[str]:
    return {n for m in CITED.findall(text) for n in expand(m)}


def documents() -> dict[str, str]:
    paths = [ROOT / "BENCHMARKS.md", ROOT / "README.md"]
    paths += [p for p in (ROOT / "benchmarks").rglob("*")
              if p.is_file() and RESULTS not in p.parents and "__pycache__" not in p.parts]
    paths += [p for p in (ROOT / "tests").rglob("*.py") if p.name != "test_benchmarks_doc.py"]
    paths += list((ROOT / "src").rglob("*.py"))
    return {str(p.relative_to(ROOT)): p.read_text(errors="replace") for p in paths if p.is_file()}


def test_every_raw_file_is_cited_by_a_document():
    cited = set().union(*map(cited_names, documents().values()))
    uncited = sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.name not in cited)
    assert not uncited, f"benchmarks/results holds files no document cites: {uncited}"


def test_benchmarks_md_cites_only_files_that_exist():
    missing = sorted(n for n in cited_names((ROOT / "BENCHMARKS.md").read_text()) if not (RESULTS / n).is_file())
    assert not missing, f"BENCHMARKS.md cites raw files that benchmarks/results does not hold: {missing}"


def test_expand_reads_braces():
    assert expand("h200x2_recipe_n{1,2}_x.json") == ["h200x2_recipe_n1_x.json", "h200x2_recipe_n2_x.json"]
    assert cited_names("see `h200_a.json` and benchmarks/results/h200x2_b.jsonl.") == {"h200_a.json", "h200x2_b.jsonl"}


def sections(text: str) -> dict[str, str]:
    """Each `## ` section's text by its title."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def tables(text: str) -> int:
    """How many markdown tables `text` holds: each has one separator row (| --- | ---: |)."""
    return len(re.findall(r"^\|(?:\s*:?-{3,}:?\s*\|)+\s*$", text, re.M))


def anchor(title: str) -> str:
    """The link target a heading gets (GitHub's rule): lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def questions() -> dict[str, str]:
    return {t: body for t, body in sections((ROOT / "BENCHMARKS.md").read_text()).items()
            if t not in REFERENCE | {HISTORY}}


def test_each_question_has_one_current_table():
    found = {title: tables(body) for title, body in questions().items()}
    assert len(found) >= 5 and found == dict.fromkeys(found, 1), found


def test_each_current_table_names_its_raw_file_commit_and_date():
    bare = {title for title, body in questions().items()
            if not (cited_names(body) and re.search(r"\b[0-9a-f]{7}\b", body) and re.search(r"\b20\d\d-\d\d-\d\d\b", body))}
    assert not bare, f"sections without a raw file, a commit or a date: {sorted(bare)}"


def test_history_is_one_line_each_with_its_raw_file():
    body = sections((ROOT / "BENCHMARKS.md").read_text())[HISTORY]
    lines = [line for line in body.splitlines() if line.strip()]
    first = next(i for i, line in enumerate(lines) if line.startswith("- "))
    entries = lines[first:]
    assert tables(body) == 0 and all(line.startswith("- ") for line in entries)
    assert all(cited_names(line) for line in entries)


def test_links_into_benchmarks_land_on_a_heading():
    text = (ROOT / "BENCHMARKS.md").read_text()
    headings = {anchor(t) for t in re.findall(r"^#+ (.+)$", text, re.M)}
    links = set(re.findall(r"BENCHMARKS\.md#([\w-]+)", (ROOT / "README.md").read_text()))
    links |= set(re.findall(r"\]\(#([\w-]+)\)", text))
    assert links and links <= headings, sorted(links - headings)


def test_sections_tables_and_anchors_are_read_as_written():
    text = "# T\n## A (one)\n| a |\n| --- |\n| 1 |\n\n| b | c |\n| ---: | :--- |\n## History\n- x\n"
    assert list(sections(text)) == ["A (one)", "History"]
    assert tables(sections(text)["A (one)"]) == 2 and tables(sections(text)["History"]) == 0
    assert anchor("`plan` against measured peaks") == "plan-against-measured-peaks"
    assert anchor("Under FSDP: full fine-tunes and QLoRA") == "under-fsdp-full-fine-tunes-and-qlora"
