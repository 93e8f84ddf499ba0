"""Stops at the edges of a run, and what is left after them: a stop before the first step says
that nothing was saved and releases the lock, and a plain re-run (or --resume auto) starts the run;
a failure after validation leaves a folder a plain re-run accepts; a kill in the final save keeps
the run's figures; --resume auto starts, continues or starts again what it finds; a stop that
lands as the run ends keeps the run's exit code; a stop is answered at once, a second aborts, and
one from the last step on lets the run finish."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import multiproc
from conftest import ROOT, checkpoints_kept, field, metrics, words
from ddptune import cli, config, launch, lock, rundir, start, train

TINY = str(ROOT / "configs" / "tiny.yaml")
SHORT = ["train.max_steps=4", "data.val=null", "lora.dropout=0.0"]


def _train(out, *extra: str) -> list[str]:
    return ["train", TINY, f"output_dir={out}", *SHORT, *extra]


def _names(folder) -> set[str]:
    return {p.name for p in folder.iterdir()}


@pytest.fixture
def stopped_while_loading(monkeypatch):
    """SIGTERM reaches this process while the model loads, as a scheduler's would."""
    from ddptune import model as model_lib

    real = model_lib.load_model

    def load_model(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(model_lib, "load_model", load_model)
    return monkeypatch


@pytest.mark.parametrize("again", [[], ["--resume", "auto"]], ids=["plain re-run", "--resume auto"])
def test_a_stop_before_the_first_step_says_nothing_was_saved_and_the_run_starts_again(tmp_path, capsys,
                                                                                      stopped_while_loading, again):
    out = tmp_path / "run"
    assert cli.main(_train(out)) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("ddptune: stopped by SIGTERM; nothing was saved (run the same command again to start the run)"), err
    assert not os.path.lexists(out / lock.NAME) and _names(out) <= set(rundir.BEFORE_TRAINING)
    assert rundir.untrained(out)
    stopped_while_loading.undo()
    assert cli.main(_train(out, *again)) == 0
    assert [r["step"] for r in metrics(out) if "loss" in r] == [1, 2, 3, 4]
    assert json.loads((out / "summary.json").read_text())["steps"] == 4 and not os.path.lexists(out / lock.NAME)


def test_a_stop_of_the_launcher_while_its_processes_load_says_nothing_was_saved(tmp_path):
    """--nproc 2: SIGTERM to the launcher while the workers build a 135M-parameter model."""
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "ddptune", *_train(out, "model.source=preset:smollm2-135m"), "--nproc", "2"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (out / "config.yaml").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "nothing was saved (run the same command again to start the run)" in err, err[-3000:]
    assert "newest checkpoint" not in err and "Traceback" not in err, err[-3000:]
    assert not os.path.lexists(out / lock.NAME) and rundir.untrained(out)


def test_a_stop_as_the_run_ends_keeps_its_code_and_a_worker_whose_peer_left_on_a_stop_reports_the_stop(
        tmp_path, monkeypatch):
    """The signal lands in the handler's context manager as the block ends (after the run failed with 1);
    then, in a launched worker that got SIGTERM, a collective's error from the peer that left on it."""
    @contextlib.contextmanager
    def stop_on_exit():
        yield
        raise launch.Stopped(signal.SIGTERM)

    monkeypatch.setattr(launch, "stops_raise", stop_on_exit)
    monkeypatch.setattr(start, "_start", lambda *a: 1)
    assert cli.main(_train(tmp_path / "a")) == 1
    monkeypatch.undo()

    def peer_left(*a):
        launch.received = signal.SIGTERM
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(start, "_start", peer_left)
    monkeypatch.setattr(launch, "received", None)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert cli.main(_train(tmp_path / "b")) == 128 + signal.SIGTERM
    monkeypatch.delenv("LOCAL_RANK")  # outside a launched process the same error is the error it is
    monkeypatch.setattr(launch, "received", None)
    with pytest.raises(RuntimeError):
        cli.main(_train(tmp_path / "c"))


def test_a_run_that_fails_after_validation_leaves_a_folder_a_plain_rerun_accepts(tmp_path, capsys):
    """A model folder whose config passes the checks (they read no weights) but whose weights do not
    load: one line, exit 2, and the next run into that folder starts without --overwrite. (A
    tokenizer that does not load is refused by validation itself, which tokenizes the data.)"""
    from ddptune import model as model_lib

    broken = tmp_path / "model"
    model_lib.preset_config("tiny", "sdpa").save_pretrained(broken)
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    model_lib.byte_tokenizer().save_pretrained(tmp_path / "tokenizer")
    out = tmp_path / "run"
    assert cli.main(_train(out, f"model.source={broken}", f"model.tokenizer={tmp_path / 'tokenizer'}")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ddptune: invalid config: model.source: the model of {broken} "
                                               "cannot be loaded ("), err
    assert rundir.untrained(out) and not os.path.lexists(out / lock.NAME)
    assert cli.main(_train(out)) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


def _killed_in_the_final_save(overrides: list[str]) -> None:
    """Train to the end, and die by SIGKILL once the adapter's files are written, before they are renamed into place."""
    from ddptune import model as model_lib

    real = model_lib.save_trained

    def save_trained(model, folder, state_dict=None):
        real(model, folder, state_dict)
        os.kill(os.getpid(), signal.SIGKILL)

    model_lib.save_trained = save_trained
    train.run(config.load(TINY, overrides))


def test_a_kill_in_the_final_save_keeps_the_runs_figures_and_resume_finishes_it(tmp_path):
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", *SHORT, "train.save_every=2"]
    procs, _ = multiproc.start(_killed_in_the_final_save, 1, overrides)
    procs[0].join(timeout=300)
    assert procs[0].exitcode == -signal.SIGKILL
    assert not (out / "adapter").exists() and list(out.glob(".adapter.tmp-*"))  # the killed save's folder
    before = json.loads((out / "summary.json").read_text())  # written before the save
    rows = [r for r in metrics(out) if "loss" in r]
    assert before["final_loss"] == rows[-1]["loss"] and before["train_time_s"] == pytest.approx(sum(r["step_time_s"] for r in rows))
    assert cli.main(["train", TINY, *overrides, "--resume"]) == 0  # from step-000004: no step left to run
    after = json.loads((out / "summary.json").read_text())
    assert after["final_loss"] == before["final_loss"] and after["train_time_s"] == pytest.approx(before["train_time_s"])
    assert after["steps"] == 4 and after["tokens_per_s_per_gpu"] > 0
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and not list(out.glob(".adapter.tmp-*"))
    assert not (out / "checkpoints").exists()  # finished now: nothing resumes it


def test_resume_auto_starts_continues_and_refuses_what_it_should(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(_train(out, "train.save_every=2", "train.max_steps=2", "--resume", "auto")) == 0  # nothing there: starts
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    capsys.readouterr()
    assert cli.main(_train(out, "train.save_every=2", "train.max_steps=2", "--resume", "auto")) == 2  # complete
    (line,) = capsys.readouterr().err.splitlines()
    assert field(line) == "output_dir" and {str(out), "summary.json"} <= words(line), line
    part = tmp_path / "part"  # interrupted after its step-2 checkpoint: continued from there
    with checkpoints_kept():
        assert cli.main(_train(part, "train.save_every=2")) == 0
    a = load_file(part / "adapter" / "adapter_model.safetensors")
    for name in ("adapter", "summary.json", "ranks.jsonl"):
        path = part / name
        path.unlink() if path.is_file() else __import__("shutil").rmtree(path)
    (part / "checkpoints" / "step-000004").rename(part / "checkpoints" / ".step-000004.tmp-x")  # a save killed midway
    assert cli.main(_train(part, "train.save_every=2", "--resume", "auto")) == 0
    assert "resuming after step 2" in capsys.readouterr().out
    b = load_file(part / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    busy = tmp_path / "busy"  # a folder of someone else's files: refused, as without auto
    busy.mkdir()
    (busy / "notes.txt").write_text("mine\n")
    assert cli.main(_train(busy, "--resume", "auto")) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert field(line) == "output_dir" and {str(busy), "notes.txt"} <= words(line) and _names(busy) == {"notes.txt"}, line


def test_a_killed_workers_line_says_what_its_run_saved(tmp_path, monkeypatch):
    """The launcher's line for a worker a signal killed (the kernel's OOM killer), with and without a checkpoint."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=1, pid=1, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none.json"))
    monkeypatch.delenv(launch.RUN, raising=False)
    assert launch.killed(1, failure)[0].endswith("(the kernel's out-of-memory killer sends SIGKILL: see dmesg)")
    monkeypatch.setenv(launch.RUN, str(tmp_path))
    assert launch.killed(1, failure)[0].endswith("; no checkpoint was saved (start the run again with the same command "
                                                  "and --resume auto)")
    (tmp_path / "checkpoints" / "step-000006").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-000006" / "state.json").write_text('{"step": 6}')
    assert launch.killed(1, failure)[0].endswith(f"; newest checkpoint: {tmp_path / 'checkpoints' / 'step-000006'} "
                                                  "(continue with the same command and --resume)")
    assert launch.killed(1, ProcessFailure(local_rank=1, pid=1, exitcode=2, error_file=str(tmp_path / "none.json"))) == []


def test_a_lead_time_saves_the_first_step_at_once_and_warns_when_a_stop_would_outlast_it(tmp_path, capsys):
    out = tmp_path / "run"
    with checkpoints_kept():
        assert cli.main(_train(out, "train.max_steps=3", "train.save_lead_seconds=3600")) == 0
    said = capsys.readouterr()
    lines = [l for l in (said.out + said.err).replace("\r", "\n").splitlines() if l.startswith("ddptune: a checkpoint")]
    assert len(lines) == 1 and lines[0].startswith("ddptune: a checkpoint (step 1) took "), lines
    assert lines[0].endswith("; a stop (a save) needs about " + lines[0].split("needs about ")[1].split()[0]
                             + " s of the 3600 s train.save_lead_seconds gives")  # no step timed yet but the first
    assert "warning" not in said.out + said.err
    assert (out / "checkpoints" / "step-000001" / "state.json").is_file()  # saved after the first step, timed
    late = tmp_path / "late"
    assert cli.main(_train(late, "train.max_steps=3", "train.save_lead_seconds=1e-6", "train.save_every=1")) == 0
    said = capsys.readouterr()
    warned = [l for l in (said.out + said.err).replace("\r", "\n").splitlines() if l.startswith("ddptune: warning: saving")]
    assert len(warned) == 1 and warned[0].startswith("ddptune: warning: saving step 1 took "), warned  # once, not per save
    # the setting it outgrew, and the sbatch flag that would give the save its time
    assert "train.save_lead_seconds=1e-06" in words(warned[0]) and any(w.startswith("--signal=TERM@") for w in words(warned[0]))


def test_a_stop_is_timed_from_recent_steps_not_the_first():
    """The first step warms up (on a GPU it compiles the layers): a stop's two steps are the median of the later ones."""
    from ddptune import saving

    times = saving.SaveTimes(lead=10.0)
    assert times.note(1, 0.5, [90.0]) == ("ddptune: a checkpoint (step 1) took 0.50 s to save; a stop (a save) needs "
                                          "about 0.5 s of the 10 s train.save_lead_seconds gives")
    assert times.note(2, 0.5, [90.0, 1.0, 2.0, 3.0]) is None  # said once; within the lead
    late = times.note(3, 0.5, [90.0, 1.0, 5.0, 6.0])
    assert late.startswith("ddptune: warning: saving step 3 took 0.5 s: a stop (two more steps of 5.00 s, then a save) "
                           "needs about 10.5 s, more than train.save_lead_seconds=10")
    assert times.note(4, 9.0, [90.0, 1.0, 5.0, 6.0]) is None  # warned once
    assert saving.SaveTimes(lead=None).note(1, 0.25, []) == "ddptune: a checkpoint (step 1) took 0.25 s to save"


def _digest(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def left_runs(tmp_path_factory) -> dict:
    """A LoRA run in each state a resubmission can meet: finished with no checkpoint (save_every 0),
    interrupted after its step-2 checkpoint, and interrupted having saved none."""
    base = tmp_path_factory.mktemp("left")
    runs = {name: base / name for name in ("finished", "checkpointed", "unsaved")}
    for name, out in runs.items():
        with checkpoints_kept():
            assert cli.main(_train(out, *(["train.save_every=2"] if name == "checkpointed" else []))) == 0
    for out in (runs["checkpointed"], runs["unsaved"]):
        for path in (out / "adapter", out / "summary.json", out / "checkpoints" / "step-000004"):
            path.unlink() if path.is_file() else __import__("shutil").rmtree(path, ignore_errors=True)
    return runs


@pytest.mark.parametrize("mode", [["--resume", "auto"], ["--resume"]], ids=["auto", "resume"])
@pytest.mark.parametrize("change", [[], ["train.method=full"], ["train.lr=0.5"]], ids=["same", "method", "lr"])
@pytest.mark.parametrize("state", ["finished", "checkpointed", "unsaved"])
def test_a_resubmission_never_replaces_a_run_of_another_config(left_runs, tmp_path, capsys, state, change, mode):
    """{finished, interrupted with a checkpoint, interrupted without} x {same config, another method,
    another lr} x {--resume auto (what the SLURM script passes), --resume}: a finished run is never
    started again, a changed config is refused naming the key, and a refusal changes no file."""
    out = tmp_path / "run"
    __import__("shutil").copytree(left_runs[state], out)
    before = _digest(out)
    code = cli.main(_train(out, *(["train.save_every=2"] if state == "checkpointed" else []), *change, *mode))
    goes_on = not change and (state == "checkpointed" or (state == "unsaved" and mode == ["--resume", "auto"]))
    if goes_on:
        assert code == 0 and json.loads((out / "summary.json").read_text())["steps"] == 4
        assert (out / "adapter" / "adapter_model.safetensors").is_file()
    else:
        assert code == 2 and _digest(out) == before
        if change and not (mode == ["--resume"] and state == "unsaved"):  # (that one has nothing to resume from)
            assert change[0].split("=")[0] in capsys.readouterr().err  # the key that differs is named


def _sigint_at(monkeypatch, steps: list[int]) -> None:
    """SIGINT reaches this process as each of `steps` (0-based) begins, as Ctrl-C at the terminal would."""
    real = train.train_step

    def train_step(r, step):
        if step in steps:
            os.kill(os.getpid(), signal.SIGINT)
        return real(r, step)

    monkeypatch.setattr(train, "train_step", train_step)


def _bar_before(text: str, marker: str) -> int:
    """The highest step the progress bar had shown when `marker` was printed."""
    return max((int(n) for n in re.findall(r"(\d+)/\d+ \[", text[:text.index(marker)])), default=0)


def test_a_stop_is_heard_at_once_and_a_second_one_aborts_without_saving(tmp_path, monkeypatch, capfd):
    """The first Ctrl-C is answered as it comes, in step 3, before that step ends (the bar then shows
    step 2); the second, in step 4, ends the run before the stop's checkpoint of step 4 is saved."""
    out = tmp_path / "run"
    _sigint_at(monkeypatch, [2, 3])
    assert cli.main(_train(out, "train.max_steps=8")) == 128 + signal.SIGINT
    err = capfd.readouterr().err.replace("\r", "\n")
    heard = [l for l in err.splitlines() if field(l) == "SIGINT"]
    assert len(heard) == 1 and _bar_before(err, heard[0]) <= 1, err[-3000:]
    assert not (out / "checkpoints").exists() and not (out / "adapter").exists()  # aborted: nothing saved since
    assert [r["step"] for r in metrics(out) if "loss" in r] <= [1, 2, 3, 4] and not os.path.lexists(out / lock.NAME)


@pytest.mark.parametrize("when", ["last step", "final save"])
def test_a_stop_from_the_last_step_on_lets_the_run_finish(tmp_path, monkeypatch, when):
    """A stop heard in step 3 of 4 is acted on after step 4, the last: the run finishes instead; so does
    one that comes while the final weights are saved."""
    from ddptune import saving

    out = tmp_path / "run"
    if when == "last step":
        _sigint_at(monkeypatch, [2])
    else:
        real = saving.save_final

        def save_final(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)
            return real(*args, **kwargs)

        monkeypatch.setattr(saving, "save_final", save_final)
    assert cli.main(_train(out)) == 0
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((out / "summary.json").read_text())["steps"] == 4 and not (out / "checkpoints").exists()
