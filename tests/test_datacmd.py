"""`ddptune data`: the data checked and tokenized as a run would, its figures and its trained tokens shown, nothing written."""
from __future__ import annotations

import json

from conftest import ROOT
from ddptune import chat, cli, data, model as model_lib
from ddptune.config import DataConfig

TINY = ROOT / "configs" / "tiny.yaml"


def table(out: str) -> list[dict]:
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def test_figures_and_marked_examples(tmp_path, capsys):
    turns = lambda user, reply: {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}  # noqa: E731
    rows = [turns(f"Question {i}?", f"Answer {i}.") for i in range(8)]
    rows[3] = turns("x" * 1000, "Answer 3.")  # cut: its earliest tokens go
    rows[5] = turns("Question 5?", "y" * 1000)  # dropped: the reply alone is longer than max_length
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = sorted(p.name for p in tmp_path.iterdir())
    args = ["data", str(TINY), f"data.train=[{{source: {path}, weight: 3}}, {{source: demo, rows: '0:4', name: sum}}]",
            "data.train_rows=null", "data.val=null", "data.max_length=384", "--show", "1", f"output_dir={tmp_path / 'run'}"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    chat_row, demo_row = table(out)
    tok = model_lib.byte_tokenizer()  # the tiny preset's: one token a byte
    examples = data.tokenize(data.load_split(str(path), None, DataConfig(max_length=384)), tok, DataConfig(max_length=384))
    kept = [e for e in examples if e]
    trained = sum(sum(1 for t in e["labels"] if t != data.IGNORE) for e in kept)
    assert chat_row | {"longest (row)": ""} == {
        "split": "train", "source": "chat", "format": "messages", "rows": "8", "kept": "7", "cut": "1", "dropped": "1",
        "tokens before targets": str(sum(len(e["input_ids"]) for e in kept) - trained), "trained tokens": str(trained),
        "mean tokens": f"{sum(len(e['input_ids']) for e in kept) / 7:.4g}", "longest (row)": ""}
    assert chat_row["longest (row)"] == "384 (3)" and examples[3]["cut"] and examples[5] is None
    assert demo_row["format"] == "dialogue" and demo_row["rows"] == "4"
    # weights 3 : 1 over 7 + 4 rows: 8.25 and 2.75 of 11, rounded by the largest remainders
    assert "mixture: each epoch of 11 samples draws 8 from chat (72.7%, weight 3, 1.14 passes over its 7 rows), " \
           "3 from sum (27.3%, weight 1, 0.75 passes over its 4 rows)" in out
    first = chat.render(tok, rows[0]["messages"][:1], True)
    assert f"{first}[[Answer 0.<|eos|>]]\n" in out  # the first example: its reply and end-of-sequence token trained
    assert "[[Nia and Marco are planning a surprise party" in out  # the demo's first summary
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no output_dir made
