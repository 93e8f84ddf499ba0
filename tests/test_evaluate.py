"""Evaluation: ROUGE against hand-computed cases; the same predictions from 1 and 2 processes."""
from __future__ import annotations

import json

import pytest

import multiproc
from conftest import ROOT, check, ddptune
from ddptune import config, generation, model as model_lib
from test_train import train_tiny

TINY = str(ROOT / "configs" / "tiny.yaml")


def test_rouge_matches_hand_computed_scores():
    # pred unigrams 3, ref 6, overlap 3: P=1, R=1/2, F=2/3. Bigrams: 2 vs 5, overlap 2: F=2*1*0.4/1.4.
    s = generation.rouge(["the cat sat"], ["the cat sat on the mat"])
    assert s["rouge1"] == pytest.approx(100 * 2 / 3)
    assert s["rouge2"] == pytest.approx(100 * 0.8 / 1.4)
    assert s["rougeL"] == pytest.approx(100 * 2 / 3)
    # stemming: "cats"/"cat" and "sitting"/"sit" match; nothing in common scores 0; mean over pairs
    s = generation.rouge(["cats sitting", "dog"], ["cat sit", "bird"])
    assert s["rouge1"] == pytest.approx(50.0) and s["rouge2"] == pytest.approx(50.0)


def test_rouge_lsum_uses_sentences():
    assert generation.sentences("Anna is late. Tom waits! OK?") == "Anna is late.\nTom waits!\nOK?"
    # two sentences in swapped order: ROUGE-L (one sequence) punishes the swap, ROUGE-Lsum does not
    s = generation.rouge(["tom waits. anna is late."], ["anna is late. tom waits."])
    assert s["rougeLsum"] == pytest.approx(100.0)
    assert s["rougeL"] < 100.0


def test_batches_are_the_same_for_any_process_count():
    prompts = [[1] * n for n in (5, 3, 9, 3, 1)]
    assert generation.fixed_batches(prompts, 2) == [[4, 1], [3, 0], [2]]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "run"
    multiproc.run(train_tiny, 1, [f"output_dir={out}", "train.max_steps=4"])
    return out


def test_one_and_two_processes_give_the_same_predictions(trained_run, tmp_path):
    from ddptune import cli

    # 5 rows in batches of 2: 3 batches over 2 processes (uneven); every process makes 2 generate calls
    args = ["eval", str(trained_run), "data.val_rows=560:565", "eval.batch_size=2", "eval.max_new_tokens=12"]
    assert cli.main([*args, "--out", str(tmp_path / "one")]) == 0  # one process, in this one
    proc = check(ddptune(*args, "--out", str(tmp_path / "two"), "--nproc", "2"))
    assert proc.stdout.count("ROUGE-1") == 1  # rank 0 reports once
    one = [json.loads(l) for l in (tmp_path / "one" / "predictions.jsonl").read_text().splitlines()]
    two = [json.loads(l) for l in (tmp_path / "two" / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in one] == [f"demo-{i:05d}" for i in range(561, 566)]  # all rows, in order, no repeats
    assert one == two
    m1 = json.loads((tmp_path / "one" / "metrics.json").read_text())
    m2 = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert (m1["world_size"], m2["world_size"]) == (1, 2) and m1["n"] == m2["n"] == 5
    for k in generation.ROUGE_KEYS:
        assert m1[k] == m2[k]


def test_zero_shot_base_and_compare_table(trained_run, tmp_path, capsys):
    from ddptune import cli  # in-process: the CLI's own launch paths are tested elsewhere

    assert cli.main(["eval", str(trained_run), "--base", "data.val_rows=560:563", "eval.max_new_tokens=8"]) == 0
    assert cli.main(["eval", str(trained_run), "data.val_rows=560:563", "eval.max_new_tokens=8"]) == 0
    assert json.loads((trained_run / "eval-base" / "metrics.json").read_text())["label"] == "zero-shot"
    out = tmp_path / "cmp.json"
    capsys.readouterr()
    assert cli.main(["compare", str(trained_run), "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| ROUGE-1 |" in table and "zero-shot" in table and "fine-tuned" in table
    rows = json.loads(out.read_text())
    assert {r["model"] for r in rows} == {"zero-shot (base)", "fine-tuned"}
    (tuned,) = [r for r in rows if r["model"] == "fine-tuned"]
    (base,) = [r for r in rows if r["model"] != "fine-tuned"]
    assert tuned["processes"] == 1 and tuned["steps"] == 4
    assert base["processes"] is None and base["steps"] is None  # the base was not trained: no training columns


def test_an_evaluation_of_other_settings_keeps_the_first_and_compare_marks_their_samples(trained_run, tmp_path, capsys):
    """`eval RUN key=value` with settings other than those of the run's eval/ writes eval-2/ beside it (the same
    settings again replace their own folder); compare marks rows scored on different samples."""
    import shutil

    from ddptune import cli, rundir

    run = tmp_path / "run"
    shutil.copytree(trained_run, run, ignore=shutil.ignore_patterns("eval*"))  # without what other tests scored there
    first = ["eval", str(run), "data.val_rows=560:564", "eval.max_new_tokens=4"]
    assert cli.main(first) == 0
    kept = (run / "eval" / "metrics.json").read_text()
    assert cli.main([*first, "eval.max_samples=2"]) == 0
    assert (run / "eval" / "metrics.json").read_text() == kept
    assert [json.loads((run / name / "metrics.json").read_text())["n"] for name in ("eval", "eval-2")] == [4, 2]
    assert cli.main(first) == 0 and cli.main([*first, "eval.max_samples=2"]) == 0
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("eval")) == ["eval", "eval-2"]
    assert rundir.is_own(run / "eval-2")  # --overwrite deletes it with the run
    out = tmp_path / "cmp.json"
    assert cli.main(["compare", str(run), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert sorted(r["eval"] for r in rows) == ["eval", "eval-2"] and len({r["scored_on"] for r in rows}) == 2
    assert [r["same_samples"] for r in rows] == [False, False]
    assert cli.main(["compare", str(run / "eval"), str(run / "eval"), "--json", str(out)]) == 0
    assert [r["same_samples"] for r in json.loads(out.read_text())] == [True, True]


def test_compare_shows_the_config_keys_that_differ_and_plots_the_losses(tmp_path, capsys):
    from ddptune import cli

    runs = []
    for name, lr in (("a", 0.01), ("b", 0.02)):
        run = tmp_path / name
        (run / "eval").mkdir(parents=True)
        cfg = config.load(ROOT / "configs" / "tiny.yaml", [f"output_dir={run}", f"train.lr={lr}"])
        (run / "config.yaml").write_text(config.dump(cfg))
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s * lr}) + "\n" for s in (1, 2, 3)))
        (run / "summary.json").write_text(json.dumps({"world_size": 2, "global_batch": 8, "steps": 3}))
        (run / "eval" / "metrics.json").write_text(json.dumps(
            {"label": "fine-tuned", "n": 4, "generation_time_s": 1.0, **{k: 0.5 for k in generation.ROUGE_KEYS}}))
        runs.append(str(run))
    png = tmp_path / "losses.png"
    assert cli.main(["compare", *runs, "--plot", str(png)]) == 0
    printed = capsys.readouterr()
    header = printed.out.splitlines()[0]
    assert "| train.lr |" in header and "output_dir" not in header and "train.max_steps" not in header
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(png) in printed.err.split()  # it says where it wrote


def test_compare_runs_without_evaluation_plots_their_losses(tmp_path, capsys):
    """configs/tiny.yaml leaves evaluation off: two such runs compare by their losses and times, the
    ROUGE columns left out; a run evaluated only zero-shot keeps a row for its trained model."""
    from ddptune import cli

    runs = [tmp_path / "a", tmp_path / "b"]
    summaries = [multiproc.run(train_tiny, 1, [f"output_dir={run}", "train.max_steps=3", f"train.lr={lr}"])[0]
                 for run, lr in zip(runs, (0.01, 0.02))]
    png, table = tmp_path / "losses.png", tmp_path / "cmp.json"
    assert cli.main(["compare", *map(str, runs), "--plot", str(png), "--json", str(table)]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads(table.read_text())
    assert [r["run"] for r in rows] == [str(run) for run in runs]
    for row, summary in zip(rows, summaries):
        assert (row["final_loss"], row["val_loss"], row["steps"]) == (summary["final_loss"], summary["val_loss"], 3)
        assert row["wall_time_s"] == summary["wall_time_s"] and row["rouge1"] is None and row["n"] is None
    assert "| final loss |" in header and "| val loss |" in header and "ROUGE-1" not in header

    (runs[1] / "eval-base").mkdir()
    (runs[1] / "eval-base" / "metrics.json").write_text(json.dumps(
        {"label": "zero-shot", "n": 4, "generation_time_s": 1.0, **{k: 0.5 for k in generation.ROUGE_KEYS}}))
    assert cli.main(["compare", *map(str, runs), "--json", str(table)]) == 0
    rows = json.loads(table.read_text())
    assert [(r["model"], r["rouge1"], r["steps"]) for r in rows] == [
        ("fine-tuned", None, 3), ("fine-tuned", None, 3), ("zero-shot (base)", 0.5, None)]
    assert "| ROUGE-1 |" in capsys.readouterr().out.splitlines()[0]


def test_train_runs_evaluation_before_and_after(tmp_path):
    out = tmp_path / "run"
    (summary, _) = multiproc.run(train_tiny, 2, [f"output_dir={out}", "train.max_steps=3", "eval.enabled=true",
                                                 "eval.max_samples=4", "eval.max_new_tokens=8"])
    for sub in ("eval", "eval-base"):
        assert len((out / sub / "predictions.jsonl").read_text().splitlines()) == 4
    assert set(summary["rouge"]) == set(generation.ROUGE_KEYS)
    assert json.loads((out / "eval" / "metrics.json").read_text())["world_size"] == 2


def test_a_full_fine_tune_is_evaluated_as_one(tmp_path):
    """`eval` loads a finished run through model.load_trained, with the run's own settings: a full
    fine-tune's saved weights, not the base with an adapter."""
    out = tmp_path / "run"
    multiproc.run(train_tiny, 1, [f"output_dir={out}", "train.method=full", "train.max_steps=2", "train.lr=1e-3",
                                  "data.val=null"])
    cfg = config.load(out / "config.yaml")
    net = model_lib.load_trained(out, cfg.model, "full", __import__("torch").device("cpu"), "auto", 0)
    from safetensors.torch import load_file

    saved = load_file(out / "model" / "model.safetensors")
    params = dict(net.named_parameters())
    assert params.keys() == saved.keys()  # every weight compared below, none skipped by a name that differs
    assert all(__import__("torch").equal(p.detach(), saved[n]) for n, p in params.items())
    assert not hasattr(net, "peft_config")
    from ddptune import cli

    assert cli.main(["eval", str(out), "data.val=demo", "data.val_rows=560:562", "eval.max_new_tokens=4"]) == 0
    assert json.loads((out / "eval" / "metrics.json").read_text())["label"].startswith("fine-tuned")
    assert cli.main(["eval", str(out), "data.val=demo", "--nproc", "0"]) == 2  # (its message: test_bad_input)


def test_several_validation_sources_are_scored_each_and_named_in_every_prediction(trained_run, tmp_path):
    """Two data.val sources: ROUGE for each besides the pooled one (their sample-weighted mean), and
    each prediction line names its source, so that rows of two files with the same ids stay apart."""
    from ddptune import cli

    val = "data.val=[{source: demo, rows: '560:563', name: a}, {source: demo, rows: '563:565', name: b}]"
    assert cli.main(["eval", str(trained_run), val, "data.val_rows=null", "eval.max_new_tokens=8",
                     "--out", str(tmp_path / "e")]) == 0
    lines = [json.loads(l) for l in (tmp_path / "e" / "predictions.jsonl").read_text().splitlines()]
    assert [r["source"] for r in lines] == ["a", "a", "a", "b", "b"]
    m = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert (m["n"], m["sources"]["a"]["n"], m["sources"]["b"]["n"]) == (5, 3, 2)
    for k in generation.ROUGE_KEYS:
        assert m[k] == pytest.approx((3 * m["sources"]["a"][k] + 2 * m["sources"]["b"][k]) / 5)


def test_a_run_is_told_to_ask_with_a_row_of_the_format_it_trained_on():
    """The closing line's suggested predict input is a row of the format the run trained on (data.asked_sample):
    its JSON parses as a row of that format, and of no format before it (a dialogue row would prompt a
    conversation run differently from training)."""
    import re
    from pathlib import Path

    from ddptune import data, runlog
    from ddptune.data import formats

    summary = {"wall_time_s": 10.0, "train_time_s": 5.0, "final_loss": 1.0, "val_loss": 1.0, "tokens_per_s_per_gpu": 1.0,
               "wall_split": {"startup_s": 2.0, "load_s": 1.0, "train_s": 5.0, "eval_s": 0.0, "other_s": 2.0}}
    for fmt in formats.FORMATS:
        d = config.DataConfig(format=fmt, dialogue_column="text")
        lines = runlog.closing_lines(Path("/tmp/run"), summary, Path("/tmp/run/adapter"), "lora", True, True, data.asked_sample(d))
        row = json.loads(re.search(r"echo '(.*)' \| ddptune predict", lines[-1]).group(1))
        assert formats.asked_format(row, d) == fmt and formats.problem(row, fmt, d, answer=False) is None if fmt != "dialogue" \
            else list(row) == ["text"]