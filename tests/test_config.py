"""Config loading and validation: every shipped YAML loads; bad input fails before any process starts."""
from __future__ import annotations

import importlib.util
import re

import pytest

from conftest import ROOT, SHARED_DATA, ddptune, field, words
from ddptune import admission, batchplan, checks, config, configref, data
from ddptune.config import ConfigError

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"tiny.yaml", "demo.yaml", "samsum_qlora_llama31_8b.yaml"} <= names
    for n in (1, 2, 4, 8):
        text = (ROOT / "configs" / "accelerate" / f"{n}gpu.yaml").read_text()
        assert f"num_processes: {n}" in text and "mixed_precision: bf16" in text
        assert ("distributed_type: MULTI_GPU" in text) == (n > 1)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path, tmp_path):
    assert path.read_text().startswith("# ddptune "), "each config starts with the command that runs it"
    cfg = config.load(path, [f"output_dir={tmp_path / 'out'}"])
    if "shared/data" in (cfg.data.train or "") and not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not beside this checkout")
    if (cfg.data.train or "").startswith("hub:") and importlib.util.find_spec("datasets") is None:
        # hub data needs datasets and internet; validate everything else with local rows in its place
        cfg = config.load(path, [f"output_dir={tmp_path / 'out'}", "data.train=demo", "data.val=demo",
                                 "data.train_rows=null", "data.val_rows=null"])
    plan = admission.validate(cfg, world_size=1)
    assert plan.global_batch >= 1


def test_effective_batch_fixes_the_global_batch_across_process_counts():
    padded = config.from_dict({"train": {"micro_batch_size": 4, "effective_batch_size": 16, "packing": False}}).train
    plans = [batchplan.batch_plan(padded, n) for n in (1, 2, 4)]
    assert [p.grad_accum for p in plans] == [4, 2, 1] and {p.global_batch for p in plans} == {16}
    assert "4 per forward x 2 processes x 2 accumulation = 16 samples per optimizer step (padded)" in plans[1].describe()
    with pytest.raises(ConfigError) as e:
        batchplan.batch_plan(padded, 8)
    (line,) = e.value.problems  # 16 samples, micro-batch 4 x 8 processes = 32, the multiple to pick
    assert field(line) == "train.effective_batch_size" and re.findall(r"\b\d+\b", line) == ["16", "4", "8", "32", "32"], line
    # packed: samples per step and per process; micro-batches and accumulation do not exist
    packed = config.from_dict({"train": {"micro_batch_size": 4, "effective_batch_size": 16}}).train
    plan = batchplan.batch_plan(packed, 8)
    assert (plan.per_process, plan.global_batch, plan.grad_accum, plan.tokens_per_forward) == (2, 16, None, 8192)
    assert plan.describe().startswith("batch: 16 samples per optimizer step = 2 per process x 8 processes, packed")
    with pytest.raises(ConfigError) as e:
        batchplan.batch_plan(packed, 3)
    (line,) = e.value.problems  # 16 samples over 3 processes
    assert field(line) == "train.effective_batch_size" and re.findall(r"\b\d+\b", line) == ["16", "3", "3"], line
    grown = config.from_dict({"train": {"micro_batch_size": 4, "grad_accum": 4}}).train
    assert batchplan.batch_plan(grown, 2).global_batch == 32
    # an old padded-style key keeps working, with one line saying what it means with packing
    assert batchplan.batch_notes(grown) == ["train.grad_accum=4 with packing only sets the samples per process "
                                         "(micro_batch_size x grad_accum = 16); each process packs them into forwards "
                                         "of at most train.tokens_per_forward=8192 tokens"]
    assert batchplan.batch_notes(padded) == []


def test_the_readme_config_table_is_generated_from_the_docstrings():
    """CONFIG.md's config reference is `configref.reference_markdown()` verbatim (regenerate it with
    `python -m ddptune.configref > table` and paste it between the markers)."""
    readme = (ROOT / "CONFIG.md").read_text()
    start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
    assert readme[readme.index(start) + len(start):readme.index(end)] == configref.reference_markdown()
    rows = configref.reference()
    assert all(r["doc"] for r in rows), [r["key"] for r in rows if not r["doc"]]  # every field documented
    assert {r["key"] for r in rows} >= {"train.profile_steps", "model.attn_implementation", "data.summary_column"}


def test_attention_kernel_is_a_closed_choice():
    with pytest.raises(ConfigError) as e:
        config.from_dict({"model": {"attn_implementation": "flash"}})
    (line,) = e.value.problems
    assert field(line) == "model.attn_implementation" and "'flash'" in words(line), line


def test_all_problems_are_reported_together():
    with pytest.raises(ConfigError) as e:
        config.from_dict({"train": {"lr": "fast", "methd": "lora", "method": "qlora4"}, "modle": {}})
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("train.lr: expected a number", "train.methd: unknown key", "train.method: 'qlora4' is not allowed", "modle: unknown key"):
        assert part in msg


def test_packing_needs_an_attention_kernel_that_takes_sample_boundaries():
    cfg = config.from_dict({"train": {"packing": True}, "model": {"attn_implementation": "sdpa"}})
    assert any(p.startswith("train.packing: needs model.attn_implementation in") for p in checks.check_values(cfg))
    cfg = config.from_dict({"train": {"packing": True, "tokens_per_forward": 100}, "data": {"max_length": 512}})
    assert "train.tokens_per_forward: 100 is shorter than data.max_length 512 (raise it)" in checks.check_values(cfg)


def test_non_finite_numbers_are_refused():
    cfg = config.from_dict({"train": {"lr": float("inf"), "max_grad_norm": float("nan")}})
    problems = checks.check_values(cfg)
    assert any(p.startswith("train.lr:") for p in problems) and any(p.startswith("train.max_grad_norm:") for p in problems)


# One case through a real `python -m ddptune` process: its exit code and its stderr, with torchrun
# never started. The rest of the bad-input table, this case among them, runs in-process with
# tripwires where work would start, and checks that nothing was written or changed
# (tests/test_bad_input.py): a `python -m ddptune` process costs about 7 s of CPU here.
def test_bad_config_fails_with_one_line_before_any_process_starts(tmp_path):
    out = tmp_path / "out"
    proc = ddptune("train", str(ROOT / "configs" / "tiny.yaml"), f"output_dir={out}", "train.learning_rate=1e-4",
                   "--nproc", "2", timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddptune: invalid config: "), proc.stderr
    assert field(lines[0]) == "train.learning_rate"  # the unknown key is the field named
    assert not out.exists()  # nothing written
    assert "OMP_NUM_THREADS" not in proc.stderr and proc.stdout == ""  # torchrun never started


def test_keys_ddptune_decides_itself_are_refused_each_with_one_line():
    """An old config that still sets a speed switch ddptune now chooses gets a line per key saying so."""
    with pytest.raises(ConfigError) as e:
        config.from_dict({"train": {key.split(".")[1]: 1 for key in config.RETIRED}})
    assert sorted(p.split(":")[0] for p in e.value.problems) == sorted(config.RETIRED)
    assert all("decides this itself" in p for p in e.value.problems)
    assert config.from_dict({"train": {"cuda_graphs": "auto"}}).train.cuda_graphs == "auto"


def test_a_yaml_alias_bomb_is_refused_at_once_with_a_short_line(tmp_path):
    """A 'billion laughs': nine levels of nine aliases, a few hundred bytes that expand into 387
    million values; its problem line once quoted them all (72 MB at 640 MB of memory)."""
    import time
    import tracemalloc

    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [
        f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\nlora:\n  target_modules: *i\n")
    assert len(bomb.read_bytes()) < 500
    tracemalloc.start()
    started = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        config.load(bomb)
    seconds, peak = time.perf_counter() - started, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < 30 and peak < 10e6, (seconds, peak)  # expanded, the values take minutes and gigabytes
    assert len(e.value.problems) == 1 and len(str(e.value)) < 1000 and str(e.value.problems[0]).startswith(f"config: {bomb}: ")
    # a value that refers to itself is refused too; an alias of a plain value or list stays allowed
    (tmp_path / "loop.yaml").write_text("lora:\n  target_modules: &t [q_proj, *t]\n")
    with pytest.raises(ConfigError, match="^invalid config: config: "):
        config.load(tmp_path / "loop.yaml")
    (tmp_path / "ok.yaml").write_text("lora:\n  r: &r 8\n  alpha: *r\n  target_modules: &t [q_proj]\nx: [*t, *t]\n")
    assert config.read_yaml(tmp_path / "ok.yaml")["lora"] == {"r": 8, "alpha": 8, "target_modules": ["q_proj"]}


@pytest.mark.parametrize("text, field", [
    ("train:\n  lr: " + "9" * 1_000_000 + "x\n", "train.lr: "),  # one value of a megabyte
    ("lora:\n  target_modules: [" + ", ".join(["1"] * 100_000) + "]\n", "lora.target_modules[0]: "),  # 100,000 bad items
    ("train:\n  ? " + "k" * 1_000_000 + "\n  : 1\n", "train.kkk"),  # a key of a megabyte
    ("train: " + "[" * 5000 + "]" * 5000 + "\n", "config: "),  # nested past what the reader can follow
], ids=["long value", "many bad items", "long key", "deep"])
def test_a_problem_line_quotes_a_bounded_part_of_a_value(tmp_path, text, field):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        config.load(path)
    assert len(str(e.value)) < 1500 and len(e.value.problems) <= 4, str(e.value)[:2000]
    assert e.value.problems[0].startswith(field), e.value.problems[0][:300]


def test_a_row_slice_written_without_quotes_is_the_slice_written(tmp_path, capsys):
    """YAML 1.1 reads an unquoted 1:30 as the base-60 number 90 (1:30:00 as 5400): a slice written
    without quotes was refused as a number or taken as another slice's bound. A number written with
    colons is read as the text it is (as YAML 1.2 reads it): data.train_rows, data.val_rows and a
    source's rows take it as the slice written; one that is no START:STOP is refused naming it, and a
    key that wants a number refuses it instead of taking the base-60 value."""
    from ddptune import cli

    path = tmp_path / "cfg.yaml"
    path.write_text((ROOT / "configs" / "tiny.yaml").read_text().replace('train_rows: "0:400"', "train_rows: 1:30")
                    .replace('val_rows: "560:600"', "val_rows: 10:20"))
    cfg = config.load(path)
    assert (cfg.data.train_rows, cfg.data.val_rows) == ("1:30", "10:20") and checks.check_values(cfg) == []
    assert config.parse_rows(cfg.data.train_rows) == slice(1, 30)
    assert config.load(path, ["data.val_rows=5:59"]).data.val_rows == "5:59"
    listed = config.load(path, ["data.train=[{source: demo, rows: 1:30}, {source: demo, rows: 40:50, name: b}]",
                                "data.train_rows=null"])
    assert [s.rows for s in listed.data.train] == ["1:30", "40:50"] and data.source_problems(listed.data) == []
    with pytest.raises(ConfigError) as e:
        config.load(path, ["train.max_steps=1:30"])  # not 90
    assert e.value.problems[0].startswith("train.max_steps: '1:30' "), e.value.problems
    for override, field in (("data.train_rows=1:30:00", "data.train_rows"), ("data.val_rows=1:30:00", "data.val_rows"),
                            ("data.train=[{source: demo, rows: 1:30:00}]", "data.train[0].rows")):
        rows = ["data.train_rows=null"] if field.endswith(".rows") else []
        assert cli.main(["train", str(path), override, *rows, f"output_dir={tmp_path / 'out'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{field}: '1:30:00' " in err[0], err
        assert not (tmp_path / "out").exists()


def test_a_row_selection_follows_its_source_when_an_override_replaces_it():
    """configs/demo.yaml selects rows 0:500 of its demo for training and 560:600 for validation:
    replacing data.train on the command line drops the file's train_rows (all of your rows train),
    keeps it when the command line sets it too, and a replaced data.val drops the file's val_rows."""
    demo = config.load(ROOT / "configs" / "demo.yaml")
    assert (demo.data.train_rows, demo.data.val_rows) == ("0:500", "560:600")
    mine = config.load(ROOT / "configs" / "demo.yaml", ["data.train=mine.jsonl"])
    assert (mine.data.train, mine.data.train_rows, mine.data.val, mine.data.val_rows) == ("mine.jsonl", None, "demo", "560:600")
    kept = config.load(ROOT / "configs" / "demo.yaml", ["data.train=mine.jsonl", "data.train_rows=0:10"])
    assert kept.data.train_rows == "0:10"
    both = config.load(ROOT / "configs" / "demo.yaml", ["data.train=mine.jsonl", "data.val=val.jsonl"])
    assert (both.data.train_rows, both.data.val_rows) == (None, None)
    listed = config.load(ROOT / "configs" / "demo.yaml", ["data.train=[{source: a.jsonl}, {source: b.jsonl}]"])
    assert listed.data.train_rows is None and checks.check_values(listed) == []
    # validation left on the file's demo while training on your data is named; not otherwise
    assert config.kept_validation(mine, ["data.train=mine.jsonl"]) is not None
    assert config.kept_validation(both, ["data.train=mine.jsonl", "data.val=val.jsonl"]) is None
    assert config.kept_validation(demo, []) is None


def test_the_rows_a_run_trains_and_validates_on_are_counted_against_their_source():
    demo = config.load(ROOT / "configs" / "demo.yaml")
    import re

    assert [tuple(map(lambda x: int(x.replace(",", "")), m)) for m in re.findall(r"\(([\d,]+) of ([\d,]+)\)", data.selection(demo.data))] \
        == [(500, 600), (40, 600)]


def test_a_misspelt_key_is_told_the_key_it_is_closest_to():
    """difflib over the section's known keys, else the same name in another section."""
    for override, meant in (("train.micro_batch=4", "train.micro_batch_size"), ("trian.lr=0.1", "train"),
                            ("train.dialogue_column=text", "data.dialogue_column"), ("lora.alhpa=8", "lora.alpha")):
        with pytest.raises(ConfigError) as e:
            config.load(ROOT / "configs" / "tiny.yaml", [override])
        (line,) = e.value.problems
        assert f"{meant}?" in line.split(), line
