"""One run per output_dir: a live lock refuses a second run or --resume with one line; a stale one
(its process ended) is taken over with a warning, by exactly one of several racing runs."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import multiproc
from conftest import ROOT, field, words
from ddptune import cli, config, dist, launch, lock

TINY = str(ROOT / "configs" / "tiny.yaml")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def plant(folder, pids: list[int], host: str | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / lock.NAME).write_text(json.dumps({"pids": pids, "host": host or socket.gethostname(),
                                                "started": time.time() - 60, "token": "someone-else"}))


@pytest.fixture
def no_work(monkeypatch):
    import ddptune.train

    def tripped(*args, **kwargs):
        raise AssertionError("a refused run started work")

    for owner, name in ((launch, "torchrun"), (dist, "setup"), (ddptune.train, "run")):
        monkeypatch.setattr(owner, name, tripped)


def test_a_second_run_into_a_locked_folder_is_refused_with_one_line(tmp_path, capsys, no_work):
    out = tmp_path / "run"
    with lock.acquire(out):  # the first run, in this process, has just started: its folder holds only the lock
        code = cli.main(["train", TINY, f"output_dir={out}"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert field(err[0]) == "output_dir" and {str(out), str(os.getpid()), socket.gethostname()} <= words(err[0]), err
        assert [p.name for p in out.iterdir()] == [lock.NAME]
    assert not out.exists()  # the first run made the folder and left nothing in it: released, removed


def test_resume_beside_a_live_run_is_refused(tmp_path, capsys, no_work):
    part = tmp_path / "part"
    part.mkdir()
    (part / "config.yaml").write_text(config.dump(config.load(TINY, [f"output_dir={part}", "train.save_every=2"])))
    (part / "checkpoints" / "step-000002").mkdir(parents=True)
    (part / "checkpoints" / "step-000002" / "state.json").write_text(json.dumps({"step": 2, "world_size": 1}))
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # an orphaned worker, still writing
    try:
        plant(part, [dead_pid(), worker.pid])  # its launcher was killed; the worker added itself to the lock
        before = (part / lock.NAME).read_text()
        code = cli.main(["train", TINY, f"output_dir={part}", "train.save_every=2", "--resume"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and field(err[0]) == "output_dir" and str(worker.pid) in words(err[0]), err
        assert (part / lock.NAME).read_text() == before  # not taken over
    finally:
        worker.kill()
        worker.wait()


def proc_state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rfind(")") + 2]


def test_a_holder_killed_but_not_yet_reaped_has_ended(tmp_path, capsys):
    """kill -9 of the run holding the lock, before its parent has waited for it: the process is a
    zombie, which still answers a signal check but writes nothing more. Its lock is taken over at
    once, not only once the parent reaps it."""
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        plant(out, [holder.pid])
        assert lock.held(out)
        os.kill(holder.pid, signal.SIGKILL)  # and no wait(): this test, its parent, leaves it unreaped
        deadline = time.time() + 10
        while proc_state(holder.pid) != "Z" and time.time() < deadline:
            time.sleep(0.01)
        assert proc_state(holder.pid) == "Z"
        os.kill(holder.pid, 0)  # the pid still answers
        assert not lock.held(out)
        with lock.acquire(out):
            assert json.loads((out / lock.NAME).read_text())["pids"] == [os.getpid()]
        took = capsys.readouterr().err.splitlines()
        assert len(took) == 1 and took[0].startswith("ddptune: warning: output_dir: ") and str(holder.pid) in words(took[0])
        assert proc_state(holder.pid) == "Z"  # taken over while still unreaped
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_from_another_host_is_never_taken_over(tmp_path):
    out = tmp_path / "run"
    plant(out, [1], host="elsewhere.example")
    with pytest.raises(config.ConfigError) as e:
        lock.acquire(out)
    (line,) = e.value.problems  # names the pid, its host and the lock file to remove
    assert field(line) == "output_dir" and {"1", "elsewhere.example", str(out / lock.NAME)} <= words(line), line
    assert "elsewhere.example" in (out / lock.NAME).read_text()


def test_a_stale_lock_is_taken_over_with_a_warning_and_the_run_completes(tmp_path, capsys):
    out = tmp_path / "run"
    plant(out, [pid := dead_pid()])  # a run killed before it wrote anything
    code = cli.main(["train", TINY, f"output_dir={out}", "train.max_steps=2", "data.val=null"])
    err = capsys.readouterr().err
    assert code == 0, err
    took = [l for l in err.splitlines() if l.startswith("ddptune: warning: output_dir: ")]
    assert len(took) == 1 and str(pid) in words(took[0]), err
    assert (out / "summary.json").is_file() and (out / "adapter").is_dir()
    assert not (out / lock.NAME).exists()  # released at the end


def _race(folder: str, ready, results) -> None:
    ready.wait(timeout=120)  # every process started: they race for the lock together
    try:
        held = lock.acquire(folder)
    except config.ConfigError as e:
        results.put(("refused", str(e)))
        return
    results.put(("got", os.getpid()))
    time.sleep(2.0)  # hold it while the others look
    held.release()


def test_racing_runs_take_a_stale_lock_over_once(tmp_path):
    out = tmp_path / "run"
    plant(out, [dead_pid()])
    ctx = multiproc.context()
    results = ctx.Queue()
    ready = ctx.Barrier(4)
    procs = [ctx.Process(target=_race, args=(str(out), ready, results)) for _ in range(4)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    got = [o for o in outcomes if o[0] == "got"]
    assert len(got) == 1, outcomes
    assert all("output_dir: " in o[1] for o in outcomes if o[0] == "refused"), outcomes
    assert not (out / lock.NAME).exists()


def test_overwrite_restarts_a_failed_run_and_is_never_implied(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("train:\n  lr: 0.5\n")  # what a run that failed after validation leaves
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    args = ["train", TINY, f"output_dir={out}", "train.max_steps=2", "data.val=null"]
    assert cli.main(args) == 2  # refused, untouched, and the way out is named
    (line,) = capsys.readouterr().err.splitlines()
    assert field(line) == "output_dir" and "--overwrite" in words(line), line
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 9.0}\n'
    assert cli.main([*args, "--overwrite", "--resume"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert field(line) == "--overwrite" and "--resume" in words(line), line
    assert cli.main([*args, "--overwrite"]) == 0
    assert [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2 and not (out / lock.NAME).exists()


@pytest.mark.parametrize("make", [
    lambda p: p.mkdir(),
    os.mkfifo,  # reading it would block for ever
    lambda p: os.symlink(p, p),  # a symlink loop
    lambda p: os.symlink(p.parent / "elsewhere.json", p),  # a symlink to nothing
], ids=["folder", "FIFO", "symlink loop", "dangling symlink"])
def test_a_lock_path_that_is_not_a_regular_file_is_refused_with_one_line(tmp_path, capsys, no_work, make):
    out = tmp_path / "run"
    out.mkdir()
    make(out / lock.NAME)
    with pytest.raises(config.ConfigError) as e:
        lock.acquire(out)
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(f"output_dir: {out / lock.NAME} ")
    assert f"remove {out / lock.NAME}" in e.value.problems[0]
    before = sorted(p.name for p in out.iterdir())
    assert cli.main(["train", TINY, f"output_dir={out}", "train.max_steps=2", "data.val=null"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddptune: invalid config: output_dir: "), err
    assert sorted(p.name for p in out.iterdir()) == before and os.path.lexists(out / lock.NAME)


def test_a_run_inside_a_locked_folder_is_refused(tmp_path, capsys, no_work):
    outer = tmp_path / "run"
    with lock.acquire(outer):  # a run that has just started there, before it wrote anything
        assert cli.main(["train", TINY, f"output_dir={outer / 'inner'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"ddptune: invalid config: output_dir: {outer / 'inner'} lies inside {outer}"), err
        assert [p.name for p in outer.iterdir()] == [lock.NAME]


def test_a_lock_left_by_an_earlier_start_of_the_same_slurm_job_is_taken_over_on_any_host(tmp_path, capsys, monkeypatch):
    """A job SLURM requeued after a kill may start on another node: the lock its earlier start left
    there (its job id, a lower restart count) is stale; another job's, or this start's own, is not."""
    out = tmp_path / "run"
    out.mkdir()
    (out / lock.NAME).write_text(json.dumps({"pids": [os.getpid()], "host": "node-17", "started": time.time() - 60,
                                             "token": "earlier", "slurm_job": "4242", "slurm_restart": 0}))
    monkeypatch.setenv("SLURM_JOB_ID", "4343")  # another job: refused, as any lock from another host
    with pytest.raises(config.ConfigError) as e:
        lock.acquire(out)
    assert field(e.value.problems[0]) == "output_dir" and {str(os.getpid()), "node-17"} <= words(e.value.problems[0])
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")  # the same start: not an earlier one
    with pytest.raises(config.ConfigError) as e:
        lock.acquire(out)
    assert field(e.value.problems[0]) == "output_dir" and "node-17" in words(e.value.problems[0])
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with lock.acquire(out):
        holder = json.loads((out / lock.NAME).read_text())
        assert holder["host"] == socket.gethostname() and (holder["slurm_job"], holder["slurm_restart"]) == ("4242", 1)
    took = capsys.readouterr().err.splitlines()
    assert len(took) == 1 and took[0].startswith("ddptune: warning: output_dir: ") and str(os.getpid()) in words(took[0])
    assert not (out / lock.NAME).exists()
