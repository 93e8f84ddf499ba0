"""What a user sees and keeps beside the files: a 2-process run's console holds progress and a
closing summary but no warnings, its rows reach TensorBoard, and the notices of the libraries
underneath are fixed where they come from."""
from __future__ import annotations

import json
import re
import warnings

import pytest

from conftest import ROOT, check, ddptune, metrics
from ddptune import admission, config, model as model_lib

TINY = str(ROOT / "configs" / "tiny.yaml")
WARNING = re.compile(r"warn|pip install", re.IGNORECASE)


def test_a_two_process_run_is_quiet_shows_its_phases_and_logs_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    proc = check(ddptune("train", TINY, "--nproc", "2", f"output_dir={out}", "train.max_steps=6", "train.val_every=3",
                         "eval.enabled=true", "eval.max_samples=8", "train.log_with=tensorboard"))
    noisy = [line for line in proc.stderr.replace("\r", "\n").splitlines() if WARNING.search(line)]
    assert noisy == [], noisy
    # progress of the long phases (rank 0 only: one bar each), and the closing lines
    for bar in ("generate (zero-shot)", "train", "validation", "generate (fine-tuned)"):
        assert f"{bar}:" in proc.stderr, bar
    assert "model loaded in" in proc.stdout and proc.stdout.count("ddptune: model loaded in") == 1
    done = next(l for l in proc.stdout.splitlines() if l.startswith("ddptune: done in"))
    assert re.search(r"load \d+\.\ds, train \d+\.\ds, eval \d+\.\ds", done)
    wrote = next(l for l in proc.stdout.splitlines() if l.startswith(f"ddptune: wrote {out}/"))
    for name in ("metrics.jsonl", "summary.json", "adapter/", "eval/", "eval-base/", "tensorboard/"):
        assert name in wrote
    assert f"ddptune predict {out} -" in proc.stdout.splitlines()[-1]

    # TensorBoard holds metrics.jsonl's rows: the loss of every step, and each validation loss
    rows = metrics(out)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    loss = {e.step: e.value for e in events.Scalars("loss")}
    assert loss == pytest.approx({r["step"]: r["loss"] for r in rows if "loss" in r}, rel=1e-6)
    assert sorted(loss) == list(range(1, 7))
    val = {e.step: e.value for e in events.Scalars("val_loss")}
    assert val == pytest.approx({r["step"]: r["val_loss"] for r in rows if "val_loss" in r}, rel=1e-6)
    assert sorted(val) == [3, 6]
    assert {"lr", "grad_norm", "tokens_per_s"} <= set(events.Tags()["scalars"])


def test_a_tracker_that_is_not_installed_is_refused_with_its_fix(tmp_path):
    pytest.importorskip("tensorboard")
    import importlib.util

    missing = next((t for t in ("wandb", "mlflow") if importlib.util.find_spec(t) is None), None)
    if missing is None:
        pytest.skip("wandb and mlflow are both installed")
    cfg = config.load(TINY, [f"output_dir={tmp_path / 'out'}", f"train.log_with={missing}"])
    with pytest.raises(config.ConfigError, match=f"train.log_with: {missing} is not installed \\(pip install {missing}\\)"):
        admission.validate(cfg, world_size=1)


def test_an_adapter_over_a_base_without_config_json_saves_without_warnings(tmp_path):
    """A GGUF base's folder holds no config.json; peft's embedding check would warn on every save."""
    import torch

    base = model_lib.build_preset("tiny", 0, torch.float32, torch.device("cpu"))
    net = model_lib.add_adapters(base, "lora", config.LoraConfig(r=4), gradient_checkpointing=False)
    gguf_folder = tmp_path / "gguf-package"
    gguf_folder.mkdir()
    net.peft_config["default"].base_model_name_or_path = str(gguf_folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model_lib.save_trained(net, tmp_path / "adapter")
        model_lib.add_adapters(model_lib.build_preset("tiny", 0, torch.float32, torch.device("cpu")), "lora",
                               config.LoraConfig(r=4), gradient_checkpointing=True)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_a_bpe_tokenizer_that_asks_for_space_cleanup_decodes_without_the_notice(tmp_path):
    import logging

    from transformers import AutoTokenizer

    model_lib.byte_tokenizer().save_pretrained(tmp_path / "tok")  # byte-level BPE, like Llama 3's
    config_file = tmp_path / "tok" / "tokenizer_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"clean_up_tokenization_spaces": True}))
    notices = []
    handler = logging.Handler()
    handler.emit = lambda record: notices.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    try:
        ours = model_lib.load_tokenizer(config.ModelConfig(source="preset:tiny", tokenizer=str(tmp_path / "tok")))
        ids = ours("Hi , there .")["input_ids"]
        assert ours.decode(ids) == "Hi , there ."  # what transformers does for BPE anyway: no cleanup
        assert not [n for n in notices if "clean_up_tokenization_spaces" in n]
        plain = AutoTokenizer.from_pretrained(tmp_path / "tok")
        assert plain.decode(ids) == "Hi , there ."
        assert [n for n in notices if "clean_up_tokenization_spaces" in n]  # the notice this avoids
    finally:
        logging.getLogger("transformers").removeHandler(handler)


def test_output_piped_into_a_reader_that_stops_early_ends_without_a_traceback():
    """`ddptune env | head -1`: the command's later lines meet a closed pipe (here closed before the
    first line: `true` reads nothing and exits while ddptune still imports torch)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(f"'{sys.executable}' -m ddptune env --no-bandwidth | true", shell=True,
                          capture_output=True, text=True, env=env, timeout=120)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_the_wall_time_counts_from_the_command_start_and_its_parts_add_up(tmp_path):
    """`ddptune train --nproc 2`: the reported wall time starts where the user's command did (before its
    imports, its checks and its workers' launch), not where the workers began to train."""
    import os
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    probe = "import time\nbefore = time.time()\nfrom ddptune import cli\nprint(repr(before))\nraise SystemExit(cli.main())\n"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TOKENIZERS_PARALLELISM="false")
    launched = time.time()
    proc = check(subprocess.run([sys.executable, "-c", probe, "train", TINY, "--nproc", "2", f"output_dir={out}",
                                 "train.max_steps=2", "data.train_rows=0:64", "data.val=null"],
                                env=env, capture_output=True, text=True, timeout=600))
    ended = time.time()
    before = float(proc.stdout.splitlines()[0])
    summary = json.loads((out / "summary.json").read_text())
    # the launching process's own start: after the test launched it (to a clock tick), before its imports
    assert launched - 0.05 <= summary["started_at"] <= before
    assert summary["started_at"] + summary["wall_time_s"] <= ended
    split = summary["wall_split"]
    assert set(split) == {"startup_s", "load_s", "train_s", "eval_s", "other_s"}
    assert sum(split.values()) == pytest.approx(summary["wall_time_s"], rel=1e-9)
    assert min(split.values()) >= 0 and split["train_s"] == pytest.approx(summary["train_time_s"])
    assert split["startup_s"] >= before - summary["started_at"]  # the imports before cli.main at least
    # and where the start-up went: the launcher, torch's launcher starting the workers, a worker's imports, its setup
    parts = summary["startup_split"]
    assert set(parts) == {"before_launch_s", "launch_s", "process_s", "setup_s"}
    assert sum(parts.values()) == pytest.approx(split["startup_s"], abs=1e-4)
    assert parts["before_launch_s"] >= before - summary["started_at"]  # the launcher's imports before cli.main at least
    assert min(parts.values()) > 0, parts  # torch's launcher imports torch before it starts a worker, which imports it too
    # what made the figures: this checkout's commit and the package's version, on this machine
    from ddptune import provenance

    assert summary["ddptune"] == {"version": provenance.version(), "commit": provenance.commit()}
    assert summary["ddptune"]["commit"] and summary["device"] == provenance.device()


def test_a_commit_is_named_for_a_source_checkout_only(tmp_path):
    """provenance.commit: a carried COMMIT file's; git's short hash for a checkout holding src/ddptune,
    marked -dirty once a tracked file changes; none for a folder that is not one (an installed package
    inside somebody else's repository)."""
    import subprocess

    from ddptune import provenance

    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True, text=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "README.md").write_text("x\n")
    git("add", "README.md")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    assert provenance.commit(tmp_path) is None
    (tmp_path / "src" / "ddptune").mkdir(parents=True)
    head = git("rev-parse", "--short=7", "HEAD").stdout.strip()
    assert provenance.commit(tmp_path) == head and len(head) == 7
    (tmp_path / "README.md").write_text("y\n")
    assert provenance.commit(tmp_path) == head + "-dirty"
    (tmp_path / "COMMIT").write_text("abc1234\n")
    assert provenance.commit(tmp_path) == "abc1234"


def test_a_process_knows_when_it_began(tmp_path):
    import os
    import subprocess
    import sys
    import time

    probe = "import time\nbefore = time.time()\nfrom ddptune import launch\nprint(repr(before), repr(launch.process_started()))\n"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    launched = time.time()
    before, began = map(float, subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                                              timeout=120, check=True).stdout.split())
    assert launched - 0.05 <= began <= before  # to a clock tick (10 ms), where psutil's create_time is off by up to 1 s


def test_the_program_exits_without_sweeping_its_objects_and_a_call_from_python_keeps_them_collectable():
    """`ddptune ...` (sys.argv) leaves its objects out of the collector's sweeps at exit; cli.main called
    with arguments, from a process that goes on, leaves the collector as it was."""
    import os
    import subprocess
    import sys

    probe = ("import atexit, gc, sys\nfrom ddptune import cli\natexit.register(lambda: print(gc.get_freeze_count()))\n"
             "cli.main(['--version'])\nprint(gc.get_freeze_count())\nraise SystemExit(cli.main())\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run([sys.executable, "-c", probe, "--version"], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    after_call, at_exit = [int(line) for line in out.splitlines() if line.isdigit()]  # between the version lines
    assert after_call == 0 and at_exit > 0
