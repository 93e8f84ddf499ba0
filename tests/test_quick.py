"""Refusals are quick: `--version`, `--help` and every config error answer before torch or
transformers is imported (they cost seconds to import): counted in a fresh interpreter, which lists
what it imported, since a busy machine changes seconds but not that."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, field
from ddptune import evaluate, generation

TINY = str(ROOT / "configs" / "tiny.yaml")
HEAVY = ("torch", "transformers", "peft", "accelerate", "safetensors", "bitsandbytes")
PROBE = ("import json, sys\nfrom ddptune import cli\ntry:\n    code = cli.main(sys.argv[1:])\n"
         "except SystemExit as e:\n    code = e.code\n"
         f"print(json.dumps([code, [m for m in {HEAVY!r} if m in sys.modules]]), file=sys.stderr)\n")


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _probe(args: list[str], env: dict | None = None) -> tuple[int, list[str], list[str], subprocess.CompletedProcess]:
    """`ddptune ARGS` in a fresh interpreter: its exit code, the heavy modules it imported, the lines
    it wrote to stderr, and the process."""
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], env=env or _env(), capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    *lines, last = proc.stderr.strip().splitlines()
    code, heavy = json.loads(last)
    return code, heavy, lines, proc


def test_version_answers_without_importing_torch():
    code, heavy, _, proc = _probe(["--version"])
    assert code == 0 and proc.stdout.startswith("ddptune "), proc
    assert heavy == []


def test_a_config_error_answers_in_one_line_without_importing_torch(tmp_path):
    code, heavy, lines, proc = _probe(["train", TINY, "train.learning_rate=1e-4", f"output_dir={tmp_path / 'run'}"])
    assert code == 2 and len(lines) == 1 and field(lines[0]) == "train.learning_rate", proc  # the unknown key is the field named
    assert heavy == []
    assert not (tmp_path / "run").exists()


def _refusals(tmp_path) -> list[list[str]]:
    done = tmp_path / "done"  # a finished run's folder, as far as a refusal reads it
    (done / "adapter").mkdir(parents=True)
    (done / "config.yaml").write_text(f"output_dir: {done}\n")
    (done / ".ddptune-run").write_text("{}\n")
    (done / "summary.json").write_text("{}\n")
    (done / "adapter" / "adapter_model.safetensors").write_bytes(b"\0" * 40)  # torn
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine\n")
    out = f"output_dir={tmp_path / 'run'}"
    return [["--help"], ["train", "--help"], ["train", TINY, "train.lr=fast", out],
            ["train", TINY, f"data.train={tmp_path / 'none.jsonl'}", out],
            ["train", TINY, f"model.tokenizer={tmp_path / 'no-tokenizer'}", out],
            ["train", TINY, "model.source=nobody/no-such-model", out],  # offline (below): not in the cache
            ["train", TINY, f"output_dir={tmp_path / 'busy'}"], ["train", TINY, out, "--resume"],
            ["train", TINY, f"output_dir={done}", "--resume"], ["train", TINY, out, "--gpu-memory", "nan"],
            ["plan", TINY, "--gpu-memory", "inf"], ["eval", str(tmp_path / "nowhere")], ["eval", str(done)],
            ["predict", str(done), "-"], ["export", str(done), str(tmp_path / "out")], ["compare", str(tmp_path / "busy")],
            ["scale", TINY, "--nproc", "1,,2"], ["scale", TINY, "train.lr=fast", "--nproc", "1,2"],
            ["data", TINY, f"data.train={tmp_path / 'none.jsonl'}"], ["data", TINY, "--show", "-1"]]


def test_no_refusal_imports_torch_or_transformers(tmp_path):
    env = dict(_env(), HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub-cache"))
    for args in _refusals(tmp_path):
        code, heavy, _, proc = _probe(args, env)
        assert code == (0 if "--help" in args else 2), (args, proc.stderr[-2000:])
        assert heavy == [], (args, heavy)


def test_evaluate_names_the_rouge_scores_generation_writes():
    assert evaluate.ROUGE_KEYS == generation.ROUGE_KEYS


@pytest.mark.parametrize("content", [b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{}", b"\x02\x00\x00\x00\x00\x00\x00\x00[]",
                                     b"\x40\x00\x00\x00\x00\x00\x00\x00" + b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}   '])
def test_a_safetensors_header_that_does_not_hold_is_damage(tmp_path, content):
    """The header check without the library: a file too short for its header, a header that is not a
    JSON object, a tensor whose bytes lie past the end of the file (what a torn copy is)."""
    from ddptune import trained

    path = tmp_path / "w.safetensors"
    path.write_bytes(content)
    assert trained.safetensors_problem(path, "x").startswith(f"x: {path} is not a safetensors file")


def test_the_header_check_counts_what_safetensors_reads(tmp_path):
    import torch
    from safetensors.torch import save_file

    from ddptune import trained

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(3, 5), "b": torch.ones(2, dtype=torch.bfloat16), "c": torch.zeros(0)}, str(path),
              metadata={"format": "pt"})
    assert trained.safetensors_count(path) == 3 and trained.safetensors_problem(path, "x") is None
