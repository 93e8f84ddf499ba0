"""benchmarks/results holds only raw files that a document cites, and BENCHMARKS.md cites only raw files
that exist. Pure file reading: a file counts as cited where its name appears in BENCHMARKS.md, README.md,
a script under benchmarks/ (results/ aside), a test under tests/ or a module under src/; `{a,b}` in a
cited name stands for each of its choices."""
from __future__ import annotations

import itertools
import re

from conftest import ROOT

RESULTS = ROOT / "benchmarks" / "results"
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
