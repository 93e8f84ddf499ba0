"""--overwrite deletes only a ddptune run's own files: a checkout, a folder of a user's files, or a
run with a user's file beside it survive it untouched, and a refusal never offers --overwrite for
a folder that is not a run."""
from __future__ import annotations

import json
from pathlib import Path

from conftest import ROOT
from ddptune import cli, lock, rundir

TINY = str(ROOT / "configs" / "tiny.yaml")
ARGS = ["train", TINY, "train.max_steps=2", "data.val=null"]


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` with its bytes (None for a folder)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


def checkout(folder: Path) -> Path:
    for name, text in {"src/ddptune/train.py": "x = 1\n", "configs/tiny.yaml": "train:\n  lr: 0.5\n",
                       ".git/HEAD": "ref: refs/heads/main\n", "README.md": "# a project\n",
                       "config.yaml": "train:\n  lr: 0.5\n"}.items():  # a config.yaml alone does not make a run
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def test_a_checkout_survives_overwrite(tmp_path, capsys):
    repo = checkout(tmp_path / "repo")
    before = snapshot(repo)
    assert cli.main([*ARGS, f"output_dir={repo}", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert snapshot(repo) == before and not (repo / lock.NAME).exists()
    assert err.count("\n") == 1 and "--overwrite" not in err  # one line, and it does not offer the flag
    assert cli.main([*ARGS, f"output_dir={repo}"]) == 2  # without it, the way out offered is not --overwrite
    assert "--overwrite" not in capsys.readouterr().err and snapshot(repo) == before


def test_a_folder_of_user_files_survives_overwrite(tmp_path, capsys):
    home = tmp_path / "thesis"
    (home / "photos").mkdir(parents=True)
    (home / "thesis.tex").write_text("\\documentclass{article}\n")
    (home / "photos" / "a.jpg").write_bytes(b"\xff\xd8\xff")
    (home / "metrics.jsonl").write_text("{}\n")  # a name a run writes, but no run: still the user's
    before = snapshot(home)
    assert cli.main([*ARGS, f"output_dir={home}", "--overwrite"]) == 2
    assert "--overwrite" not in capsys.readouterr().err
    assert snapshot(home) == before


def test_a_run_with_a_user_file_beside_it_is_not_cleared(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main([*ARGS, f"output_dir={out}"]) == 0
    (out / "notes.txt").write_text("mine\n")
    before = snapshot(out)
    assert cli.main([*ARGS, f"output_dir={out}", "--overwrite"]) == 2
    capsys.readouterr()
    assert snapshot(out) == before


def test_overwrite_clears_a_finished_run_and_trains_again(tmp_path):
    out = tmp_path / "run"
    assert cli.main([*ARGS, f"output_dir={out}"]) == 0
    assert rundir.is_run(out) and rundir.foreign(out) == []
    (out / "checkpoints" / "stale").mkdir(parents=True)
    assert cli.main([*ARGS[:2], "train.max_steps=3", "data.val=null", f"output_dir={out}", "--overwrite"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    assert not (out / "checkpoints" / "stale").exists() and not (out / lock.NAME).exists()


def test_only_the_names_a_run_writes_are_its_own(tmp_path):
    assert [p.name for p in map(Path, ["adapter", "trace-rank3.json", ".adapter.tmp-x1", "eval-base"])
            if rundir.is_own(tmp_path / p)] == ["adapter", "trace-rank3.json", ".adapter.tmp-x1", "eval-base"]
    assert [n for n in ("src", ".git", "thesis.tex", "adapter.bak", "trace.json.old") if rundir.is_own(tmp_path / n)] == []


def test_every_way_out_a_refusal_offers_for_a_finished_run_is_taken(tmp_path):
    """A new run into the folder of a finished one is refused; each flag the refusal offers is one the
    run is then admitted with (a finished run has nothing to resume: --resume is not offered)."""
    from conftest import words
    from ddptune import config

    out = tmp_path / "run"
    rundir.mark(out)
    cfg = config.load(TINY, [f"output_dir={out}"])
    (out / "config.yaml").write_text(config.dump(cfg))
    (out / "summary.json").write_text("{}\n")
    (out / "adapter").mkdir()
    (line,) = rundir.output_problems(cfg, False)
    offered = {w for w in words(line) if w.startswith("--")}
    assert offered, line
    for flag in offered:
        resume, overwrite = rundir.resume_mode(cfg, "yes" if flag == "--resume" else None, flag == "--overwrite")
        assert rundir.output_problems(cfg, resume, overwrite=overwrite) == [], (flag, line)
