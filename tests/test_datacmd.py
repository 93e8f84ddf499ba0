"""`ddptune data`: the data checked and tokenized as a run would, its figures and its trained tokens shown, nothing written."""
from __future__ import annotations

import json
import re

from conftest import ROOT, field
from ddptune import batches, cli, data, model as model_lib
from ddptune.data import chat
from ddptune.data.tokens import IGNORE
from ddptune.config import DataConfig

TINY = ROOT / "configs" / "tiny.yaml"


def table(out: str) -> list[dict]:
    """The rows of the first markdown table in `out`."""
    rest = out.splitlines()
    rest = rest[next(i for i, line in enumerate(rest) if line.startswith("| ")):]
    lines = rest[:next((i for i, line in enumerate(rest) if not line.startswith("| ")), len(rest))]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def test_figures_and_marked_examples(tmp_path, capsys, monkeypatch):
    turns = lambda user, reply: {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}  # noqa: E731
    rows = [turns(f"Question {i}?", f"Answer {i}.") for i in range(8)]
    rows[3] = turns("x" * 1000, "Answer 3.")  # cut: its earliest tokens go
    rows[5] = turns("Question 5?", "y" * 1000)  # dropped: the reply alone is longer than max_length
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.setenv("DDPTUNE_CACHE", str(tmp_path.parent / f"{tmp_path.name}-cache"))  # this command's stores alone
    args = ["data", str(TINY), f"data.train=[{{source: {path}, weight: 3}}, {{source: demo, rows: '0:4', name: sum}}]",
            "data.train_rows=null", "data.val=null", "data.max_length=384", "--show", "1", f"output_dir={tmp_path / 'run'}"]
    assert cli.main(args) == 0
    out, err = capsys.readouterr()
    chat_row, demo_row = table(out)
    # last, the store's size: the files of its two folders (the chat file's, the demo rows'), each token's bytes
    from ddptune.data import store

    folders = sorted(p.parent for p in store.root().glob("*/meta.json"))
    size = sum(f.stat().st_size for d in folders for f in d.iterdir() if f.name != "meta.json")
    tokens = sum(json.loads((d / "meta.json").read_text())["tokens"] for d in folders)
    assert len(folders) == 2 and re.search(r"stored in (.+): ([\d.]+) kB, ([\d.]+) bytes a token$", err.strip()).groups() == (
        str(store.root()), f"{size / 1e3:.1f}", f"{size / tokens:.2f}")
    assert 1e3 < size < 1e6  # a few kB: written in kB, to the tenth
    tok = model_lib.byte_tokenizer()  # the tiny preset's: one token a byte
    examples = data.tokenize(data.load_split(str(path), None, DataConfig(max_length=384)), tok, DataConfig(max_length=384))
    kept = [e for e in examples if e]
    trained = sum(sum(1 for t in e["labels"] if t != IGNORE) for e in kept)
    assert chat_row | {"longest (row)": ""} == {
        "split": "train", "source": "chat", "format": "messages", "rows": "8", "kept": "7", "cut": "1", "dropped": "1",
        "tokens before targets": str(sum(len(e["input_ids"]) for e in kept) - trained), "trained tokens": str(trained),
        "mean tokens": f"{sum(len(e['input_ids']) for e in kept) / 7:.4g}", "longest (row)": ""}
    assert chat_row["longest (row)"] == "384 (3)" and examples[3]["cut"] and examples[5] is None
    assert demo_row["format"] == "dialogue" and demo_row["rows"] == "4"
    # weights 3 : 1 over 7 + 4 examples: 8.25 and 2.75 of 11 an epoch, rounded by the largest remainders; the run's
    # 30 steps of 4 draw 120 samples: 10 whole epochs (80 and 30) and 10 of the 11th, as batches.Stream draws them
    draws = table(out[out.index("samples drawn (train.max_steps=30, 4 a step over 1 process(es)"):])
    stream = batches.Stream(examples=list(range(11)), costs=[1.0] * 11, targets=[1] * 11, global_batch=4, parts=1, seed=0,
                            packing=True, micro_batch_size=4, tokens_per_forward=8192, max_length=384, mix=((7, 8), (4, 3)))
    from_chat = sum(i < 7 for step in range(30) for i in stream.samples(step))
    assert 80 <= from_chat <= 88 and draws == [
        {"source": "chat", "examples": "7", "weight": "3", "share": "72.7%", "samples an epoch": "8",
         "passes an epoch": "1.14", "samples in the run": str(from_chat), "passes in the run": f"{from_chat / 7:.4g}"},
        {"source": "sum", "examples": "4", "weight": "1", "share": "27.3%", "samples an epoch": "3",
         "passes an epoch": "0.75", "samples in the run": str(120 - from_chat), "passes in the run": f"{(120 - from_chat) / 4:.4g}"}]
    first = chat.render(tok, rows[0]["messages"][:1], True)
    assert f"{first}[[Answer 0.<|eos|>]]\n" in out  # the first example: its reply and end-of-sequence token trained
    assert "[[Nia and Marco are planning a surprise party" in out  # the demo's first summary
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no output_dir made


def test_one_source_draws_its_examples_each_epoch_and_the_run_its_steps_of_the_global_batch(capsys):
    """Without max_steps: train.epochs passes over the examples, in whole global batches of --nproc processes."""
    args = ["data", str(TINY), "train.max_steps=null", "train.epochs=1.5", "data.val=null", "--show", "0", "--nproc", "2"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "samples drawn (train.epochs=1.5, 8 a step over 2 process(es)" in out  # 4 a process x 2
    assert table(out[out.index("samples drawn"):]) == [  # floor(1.5 x 400 / 8) = 75 steps of 8
        {"source": "demo", "examples": "400", "weight": "1", "share": "100.0%", "samples an epoch": "400",
         "passes an epoch": "1", "samples in the run": "600", "passes in the run": "1.5"}]
    assert cli.main([*args, "train.grad_accum=null", "train.effective_batch_size=6", "--nproc", "4"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()  # 6 samples a step over 4 processes
    assert field(line) == "train.effective_batch_size" and re.findall(r"\b\d+\b", line) == ["6", "4", "4"], line
