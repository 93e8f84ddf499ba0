"""`ddptune predict`: summaries of new dialogues (no references), from stdin or a file, in input
order, with the prompt the run trained on; the same from 1 and 2 processes; bad input refused."""
from __future__ import annotations

import io
import json
import shutil

import pytest

import multiproc
from conftest import field, words
from ddptune import cli, data
from test_export import DAMAGED, damaged_copy, train_run

# byte-level tiny model: a long data.max_length keeps every dialogue whole, as eval keeps them
GEN = ["eval.max_new_tokens=8", "eval.batch_size=2", "data.max_length=4096"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("predict") / "run")


def trained_on(tmp_path_factory, name: str, rows: list[dict]):
    """A finished run trained on `rows` (data.format auto: their keys name it)."""
    folder = tmp_path_factory.mktemp(name)
    (folder / "train.jsonl").write_text(jsonl(rows))
    return train_run(folder / "run", f"data.train={folder / 'train.jsonl'}")


@pytest.fixture(scope="module")
def pc_run(tmp_path_factory):
    """A run trained on prompt/completion rows."""
    return trained_on(tmp_path_factory, "pc", [{"prompt": r["dialogue"], "completion": r["summary"]} for r in demo_rows(0, 40)])


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A run trained on conversations (messages rows)."""
    return trained_on(tmp_path_factory, "chat", [{"messages": [{"role": "user", "content": r["dialogue"]},
                                                               {"role": "assistant", "content": r["summary"]}]}
                                                 for r in demo_rows(0, 40)])


def demo_rows(a: int, b: int) -> list[dict]:
    return data.read_rows("demo")[a:b]


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_stdin_gives_eval_predictions_in_input_order(run, tmp_path, monkeypatch, capsys):
    rows = [dict(r, extra=i) for i, r in enumerate(demo_rows(560, 563))][::-1]  # reversed: order is the input's
    monkeypatch.setattr("sys.stdin", io.StringIO(jsonl(rows)))
    assert cli.main(["predict", str(run), "-", *GEN]) == 0
    captured = capsys.readouterr()
    out = [json.loads(line) for line in captured.out.splitlines()]  # stdout holds only the JSON lines
    assert [{k: v for k, v in r.items() if k != "prediction"} for r in out] == rows  # fields pass through
    assert all(isinstance(r["prediction"], str) for r in out)
    assert "3 summaries" in captured.err
    # the same prompts and generation as `ddptune eval` on these rows, which scores them against references
    assert cli.main(["eval", str(run), "data.val=demo", "data.val_rows=560:563", *GEN, "--out", str(tmp_path / "eval")]) == 0
    ev = {r["id"]: r["prediction"] for r in map(json.loads, (tmp_path / "eval" / "predictions.jsonl").read_text().splitlines())}
    assert {r["id"]: r["prediction"] for r in out} == ev


def predict_to(run, source, out, nproc_overrides=()):
    """One process's part of `ddptune predict` (run by multiproc.run)."""
    return cli.main(["predict", str(run), "--input", str(source), "--out", str(out), *GEN, *nproc_overrides])


def test_two_processes_write_what_one_writes(run, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(jsonl(demo_rows(0, 5)))  # 3 batches of 2 over 2 processes: uneven
    assert predict_to(run, source, tmp_path / "one.jsonl") == 0
    assert multiproc.run(predict_to, 2, run, source, tmp_path / "two.jsonl") == [0, 0]
    one, two = ((tmp_path / n).read_text() for n in ("one.jsonl", "two.jsonl"))
    assert one == two and [json.loads(line)["id"] for line in one.splitlines()] == [r["id"] for r in demo_rows(0, 5)]


def test_bad_input_is_refused_with_one_line(run, tmp_path, monkeypatch, capsys):
    taken = tmp_path / "taken.jsonl"
    taken.write_text("mine\n")
    good = tmp_path / "good.jsonl"
    good.write_text(jsonl(demo_rows(0, 1)))
    cases = [  # the field each line names, and the values in it: the path, the line and field read, the number given
        (["--input", str(good), "--out", str(taken)], "--out", {str(taken)}),
        (["--input", str(tmp_path / "missing.jsonl")], "--input", {str(tmp_path / "missing.jsonl")}),
        (["-"], "--input", {"2", "stdin", "'dialogue'"}),
        ([str(good), "--nproc", "0"], "--nproc", {"0", "1"}),
        ([str(good), "--top-p", "0.9"], "--top-p", {"--temperature"}),
        ([str(good), "--temperature", "0.7", "--top-p", "1.5"], "--top-p", {"1.5", "0", "1]"}),
        ([str(good), "--temperature", "-1"], "--temperature", {"-1.0", "0"}),
        ([str(good), "--temperature", "0.7", "--top-k", "0"], "--top-k", {"0", "1"}),
        ([str(good), "--max-new-tokens", "0"], "--max-new-tokens", {"1"}),
    ]
    for args, name, values in cases:
        monkeypatch.setattr("sys.stdin", io.StringIO('{"dialogue": "A: hi"}\n{"text": "B: hi"}\n'))
        assert cli.main(["predict", str(run), *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and field(err) == name and values <= words(err), err
    assert taken.read_text() == "mine\n"
    assert cli.main(["predict", str(tmp_path), str(good)]) == 2
    err = capsys.readouterr().err.strip()  # the folder given, and the file it lacks
    assert field(err) == "predict" and {str(tmp_path), "config.yaml"} <= words(err), err


@pytest.mark.parametrize("bad", [{"dialogue": 5}, {"dialogue": None, "id": "x"}, {"dialogue": ["A: hi"]}, 7, ["A: hi"]],
                         ids=["number", "null", "list", "a number for a row", "a list for a row"])
def test_a_row_whose_dialogue_is_not_text_is_refused_naming_the_row_and_the_value(run, tmp_path, monkeypatch, capsys, bad):
    """A row that holds its dialogue field with a value that is not a string, or a line that is not an
    object: one line naming the line and the value found (not "no such field"), exit 2, nothing written."""
    out = tmp_path / "predictions.jsonl"
    monkeypatch.setattr("sys.stdin", io.StringIO(jsonl([demo_rows(0, 1)[0], bad])))
    assert cli.main(["predict", str(run), "-", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    value = bad["dialogue"] if isinstance(bad, dict) else bad
    assert len(err) == 1 and err[0].startswith("ddptune: invalid config: --input: line 2 of stdin"), err
    assert f"({value!r})" in err[0] and ("'dialogue'" in err[0]) == isinstance(bad, dict), err
    assert not out.exists()


@pytest.mark.parametrize("bad", [{"dialogue": "A: hi \ud800"}, {"messages": [{"role": "user", "content": "Hi \udfff"}]}],
                         ids=["dialogue", "messages"])
def test_a_lone_surrogate_is_refused_naming_the_line_and_the_character(run, chat_run, tmp_path, monkeypatch, capsys, bad):
    """Valid JSON that is not valid Unicode crashed the tokenizer; now one line, exit 2, nothing written."""
    out = tmp_path / "predictions.jsonl"
    first = demo_rows(0, 1)[0] if "dialogue" in bad else {"messages": [{"role": "user", "content": "Hello"}]}
    monkeypatch.setattr("sys.stdin", io.StringIO(jsonl([first, bad])))
    assert cli.main(["predict", str(run if "dialogue" in bad else chat_run), "-", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddptune: invalid config: --input: line 2 of stdin"), err
    assert f"a lone surrogate at character {6 if 'dialogue' in bad else 3}" in err[0] and not out.exists()


@pytest.mark.parametrize("name, content", [c[1:] for c in DAMAGED if c[0] in ("torn weights", "adapter_config.json not JSON")],
                         ids=["torn weights", "adapter_config.json not JSON"])
def test_a_damaged_adapter_is_refused_by_predict_and_eval(run, tmp_path, capsys, name, content):
    copy, damaged = damaged_copy(run, tmp_path, name, content)
    good = tmp_path / "in.jsonl"
    good.write_text(jsonl(demo_rows(0, 2)))
    out = tmp_path / "predictions.jsonl"
    assert cli.main(["predict", str(copy), str(good), "--out", str(out), *GEN]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ddptune: invalid config: predict: {damaged} "), err
    assert not out.exists()
    assert cli.main(["eval", str(copy), "data.val_rows=560:562", *GEN]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"eval: {damaged} " in err[0], err
    assert not (copy / "eval").exists()


def test_conversations_are_prompted_up_to_their_last_user_turn_and_eval_scores_their_last_reply(chat_run, tmp_path,
                                                                                                  monkeypatch, capsys):
    """Rows of messages, as the run trained on: predict answers the last
    user turn, dropping a reply that follows it; eval scores the generated last assistant turn of
    data.val's conversations against theirs, from the same prompts."""
    convs = []
    for r in demo_rows(560, 564):
        lines = r["dialogue"].splitlines()
        convs.append([{"role": "system", "content": "Summarize when asked."}, {"role": "user", "content": lines[0]},
                      {"role": "assistant", "content": lines[1]}, {"role": "user", "content": "Summarize the dialogue."},
                      {"role": "assistant", "content": r["summary"]}])
    asked = [{"id": str(i), "messages": c[:-1]} for i, c in enumerate(convs)]  # ending with the user's turn
    answered = [{"id": str(i), "messages": c} for i, c in enumerate(convs)]  # and with the reference reply after it
    outputs = []
    for rows in (asked, answered):
        monkeypatch.setattr("sys.stdin", io.StringIO(jsonl(rows)))
        assert cli.main(["predict", str(chat_run), "-", *GEN]) == 0
        outputs.append([json.loads(line) for line in capsys.readouterr().out.splitlines()])
    assert [r["prediction"] for r in outputs[0]] == [r["prediction"] for r in outputs[1]]
    assert [r["messages"] for r in outputs[1]] == [c for c in convs]  # the row's own fields pass through
    val = tmp_path / "val.jsonl"
    val.write_text(jsonl(answered))
    assert cli.main(["eval", str(chat_run), f"data.val={val}", "data.val_rows=null", *GEN, "--out", str(tmp_path / "eval")]) == 0
    scored = [json.loads(line) for line in (tmp_path / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert [r["reference"] for r in scored] == [c[-1]["content"] for c in convs]
    assert [r["messages"] for r in scored] == [c[:-1] for c in convs]
    assert [r["prediction"] for r in scored] == [r["prediction"] for r in outputs[0]]
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["n"] == 4 and 0 <= metrics["rouge1"] <= 100
    monkeypatch.setattr("sys.stdin", io.StringIO(jsonl([{"messages": [{"role": "assistant", "content": "hi"}]}])))
    assert cli.main(["predict", str(chat_run), "-"]) == 2
    err = capsys.readouterr().err
    line = err.splitlines()[-1]  # after the progress bar's carriage returns
    assert err.count("\n") == 1 and field(line) == "--input", err  # line 1 of stdin, read as messages, opens with the assistant
    assert {"1", "stdin", "messages", "assistant"} <= words(line), err


def test_greedy_is_what_generate_gave_and_sampling_repeats_with_its_seed_for_any_process_count(run, tmp_path):
    """The default, and --temperature 0, are greedy: the texts transformers' generate gives with the keyword
    arguments predict passed before it took a GenerationConfig. --temperature samples through transformers: the
    same seed gives the same texts, from one process or two, another seed others; --max-new-tokens bounds them."""
    import torch

    from ddptune import config, generation, model as model_lib

    source = tmp_path / "in.jsonl"
    source.write_text(jsonl(demo_rows(0, 5)))
    outputs = {}
    for name, flags in (("default", []), ("zero", ["--temperature", "0"]), ("seed 3", ["--temperature", "1.5", "--seed", "3"]),
                        ("seed 3 again", ["--temperature", "1.5", "--seed", "3"]), ("seed 4", ["--temperature", "1.5", "--seed", "4"]),
                        ("top", ["--temperature", "1.5", "--top-k", "1"]), ("short", ["--max-new-tokens", "3"])):
        assert predict_to(run, source, tmp_path / f"{name}.jsonl", flags) == 0
        outputs[name] = [json.loads(line)["prediction"] for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    cfg = config.load(run / "config.yaml", GEN)
    tok = model_lib.load_tokenizer(cfg.model, cfg.data)
    net = model_lib.load_trained(run, cfg.model, cfg.train.method, torch.device("cpu"), cfg.train.precision, cfg.train.seed)
    eos, before = generation.stop_ids(tok, cfg.data), []
    for row in data.load_split(str(source), None, cfg.data):
        ids = torch.tensor([generation.prompt_ids([row], tok, cfg.data)[0]])
        out = net.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, num_beams=1,
                           use_cache=True, eos_token_id=eos, pad_token_id=tok.pad_token_id)
        before.append(tok.decode(out[0][ids.shape[1]:], skip_special_tokens=True).strip())
    assert outputs["default"] == outputs["zero"] == before == outputs["top"]  # top-k 1 samples the greedy token
    assert outputs["seed 3"] == outputs["seed 3 again"] != outputs["seed 4"] and outputs["seed 3"] != before
    assert multiproc.run(predict_to, 2, run, source, tmp_path / "two.jsonl", ["--temperature", "1.5", "--seed", "3"]) == [0, 0]
    assert [json.loads(line)["prediction"] for line in (tmp_path / "two.jsonl").read_text().splitlines()] == outputs["seed 3"]
    assert all(len(tok(p, add_special_tokens=False)["input_ids"]) <= 3 for p in outputs["short"])
    assert [p[:1] for p in outputs["short"]] == [p[:1] for p in before]


def test_a_run_takes_the_rows_it_trained_on_and_refuses_other_shapes(run, pc_run, chat_run, tmp_path, monkeypatch, capsys):
    """The run keeps the format `auto` resolved to; predict and eval take rows of it, and a row of another
    shape is refused with one line (exit 2, nothing written). The closing line's suggested row is one the
    run takes. A run saved before it kept its format takes what it took before."""
    from ddptune import config, rundir

    assert [rundir.taken_formats(r) for r in (run, pc_run, chat_run)] == [("dialogue",), ("prompt_completion",), ("messages",)]
    dialogue = {"dialogue": demo_rows(0, 1)[0]["dialogue"]}
    messages = {"messages": [{"role": "user", "content": dialogue["dialogue"]}]}
    prompt = {"prompt": dialogue["dialogue"]}
    out = tmp_path / "predictions.jsonl"
    for folder, taken, other in ((pc_run, prompt, dialogue), (chat_run, messages, dialogue), (run, dialogue, messages)):
        suggested = json.loads(data.asked_sample(config.load(folder / "config.yaml").data))
        assert suggested.keys() == taken.keys()
        monkeypatch.setattr("sys.stdin", io.StringIO(jsonl([taken, suggested])))
        assert cli.main(["predict", str(folder), "-", *GEN]) == 0
        assert [json.loads(line).keys() - {"prediction"} for line in capsys.readouterr().out.splitlines()] == [taken.keys()] * 2
        monkeypatch.setattr("sys.stdin", io.StringIO(jsonl([taken, other])))
        assert cli.main(["predict", str(folder), "-", "--out", str(out), *GEN]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and field(err) == "--input" and "2" in words(err), err
        assert not out.exists()
    # eval likewise: validation rows of another shape than training's are refused before any model loads
    assert cli.main(["eval", str(pc_run), "data.val=demo", "data.val_rows=0:2", *GEN]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and field(err) == "data.val", err
    assert not (pc_run / "eval").exists()
    # a run saved before its format was kept: the rows' keys name their format, as before
    old = tmp_path / "old"
    shutil.copytree(pc_run, old)
    (old / rundir.DATA_RECORD).unlink()
    assert rundir.taken_formats(old) is None
    monkeypatch.setattr("sys.stdin", io.StringIO(jsonl([dialogue])))
    assert cli.main(["predict", str(old), "-", *GEN]) == 0
    assert json.loads(capsys.readouterr().out)["prediction"] is not None
