"""Faults during training, in real gloo processes: a process that hangs ends the run with one clear
error within train.timeout_minutes instead of a silent stall; a signal stops every process after a
saved step, said at once; a killed launcher or worker ends the whole job, torch's and gloo's own
words kept off the console; `--resume` then finishes with exactly the unbroken run's adapter; a
straggler is named."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import multiproc
from conftest import ROOT, UNBROKEN_ARGS, WORKER_PATH, field, words
from ddptune import config, dist, launch, stops, train

TINY = str(ROOT / "configs" / "tiny.yaml")


def socketless_tmpdir(tmp_path: Path) -> Path:
    """A TMPDIR whose path is too long for multiprocessing's socket: no fork server can start under it."""
    long = tmp_path / ("t" * 120)
    long.mkdir()
    return long


def _stop_once_training(metrics_path: str) -> None:
    """Freeze this process (SIGSTOP: alive, silent) once rank 0 has logged two steps."""
    while not (os.path.exists(metrics_path) and len(open(metrics_path).read().splitlines()) >= 2):
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGSTOP)


def train_until_a_process_hangs(overrides: list[str], metrics_path: str) -> str:
    if os.environ["RANK"] == "1":
        threading.Thread(target=_stop_once_training, args=(metrics_path,), daemon=True).start()
    started = time.perf_counter()
    try:
        train.run(config.load(TINY, overrides))
    except dist.Stalled as e:
        return f"{time.perf_counter() - started:.1f} {e}"
    return "finished"


@pytest.mark.parametrize("text", [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 9000ms for recv operation to complete",
    "Application timeout caused pair closure",  # gloo, in the all-gather of a checkpoint's RNG states (CI, 2026-11-30)
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:5050",
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600000 milliseconds"])
def test_a_peer_that_hung_or_died_is_told_from_other_errors(text):
    """The ways a collective fails when a peer hangs or dies, whichever collective meets it first:
    each becomes dist.Stalled (one clear line, the newest checkpoint). Other errors stay as they are."""
    assert dist.collective_failed(RuntimeError(text))
    assert not dist.collective_failed(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))


def test_a_hung_process_ends_the_run_with_a_clear_error(tmp_path):
    out = tmp_path / "run"
    # far more steps than run before rank 1 freezes, but not 100000: setup plans the work of every
    # step of the run for the speed choices, which took 13 s of a 2-core CPU for 100000 steps
    overrides = [f"output_dir={out}", "train.max_steps=1000", "train.timeout_minutes=0.15", "data.val=null",
                 "train.save_every=1", "train.keep_checkpoints=1"]
    procs, results = multiproc.start(train_until_a_process_hangs, 2, overrides, str(out / "metrics.jsonl"))
    try:
        rank, error, value = results.get(timeout=300)  # rank 1 is frozen: only rank 0 can answer
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=30)
    assert (rank, error) == (0, None), error
    assert value != "finished"
    message = value.split(" ", 1)[1]
    assert "\n" not in message and message.startswith("step "), message
    # gloo's words depend on which collective meets the frozen peer first (a step's, or a checkpoint's gather)
    assert any(w in message for w in ("Timed out waiting 9000ms", "Application timeout caused pair closure")), message
    # the timeout it waited, the checkpoint to go on from, the flag that does
    assert {"train.timeout_minutes=0.15", "--resume"} <= words(message), message
    assert any(w.startswith(str(out / "checkpoints" / "step-")) for w in words(message)), message


def test_a_resume_may_set_a_new_timeout_but_not_a_new_learning_rate(tmp_path):
    from ddptune import rundir

    part = tmp_path / "part"
    (part / "checkpoints" / "step-000002").mkdir(parents=True)
    (part / "checkpoints" / "step-000002" / "state.json").write_text(json.dumps({"step": 2, "world_size": 1}))
    (part / "config.yaml").write_text(config.dump(config.load(TINY, [f"output_dir={part}"])))
    resumed = lambda *o: rundir.output_problems(config.load(TINY, [f"output_dir={part}", *o]), True, 1)  # noqa: E731
    assert resumed("train.timeout_minutes=60") == []
    (line,) = resumed("train.lr=0.5")  # the value given, and the run's
    assert field(line) == "train.lr" and [w for w in line.split() if w.replace(".", "").isdigit()] == ["0.5", "0.01"], line


def train_until_interrupted(overrides: list[str], resume: bool = False) -> str:
    try:
        train.run(config.load(TINY, overrides), resume=resume)
    except stops.Interrupted as e:
        return str(e)
    return "finished"


def test_a_signal_to_one_process_stops_all_after_a_saved_step_and_resume_finishes(tmp_path):
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", "train.max_steps=60", "data.val=null", "train.save_every=0"]
    procs, results = multiproc.start(train_until_interrupted, 2, overrides)
    try:
        metrics_path = out / "metrics.jsonl"
        deadline = time.time() + 240
        while not (metrics_path.exists() and len(metrics_path.read_text().splitlines()) >= 2) and time.time() < deadline:
            time.sleep(0.02)
        os.kill(procs[1].pid, signal.SIGINT)  # Ctrl-C reaching one worker only: both must stop at the same step
        answers = dict((rank, value or error) for rank, error, value in (results.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert answers[0] == answers[1], answers
    done, total = (int(w) for w in re.split(r"[\s,;()]+", answers[0]) if w.isdigit())  # the step saved, of the run's 60
    assert 2 <= done < 60 and total == 60 and "\n" not in answers[0], answers[0]
    assert {"SIGINT", str(out / "checkpoints" / f"step-{done:06d}"), "--resume"} <= words(answers[0]), answers[0]
    assert json.loads((out / "checkpoints" / f"step-{done:06d}" / "state.json").read_text())["step"] == done
    assert [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()] == list(range(1, done + 1))
    assert not (out / "summary.json").exists()

    multiproc.run(train_until_interrupted, 2, overrides, True)  # nothing lost: the run continues where it stopped
    assert [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()] == list(range(1, 61))
    assert json.loads((out / "summary.json").read_text())["steps"] == 60


# --- the whole CLI: signals and kills reaching `ddptune train --nproc 2` from outside ---------------

def _cli(out, *extra: str):
    import subprocess
    import sys

    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "ddptune", "train", TINY, "--nproc", "2", *UNBROKEN_ARGS,
                             f"output_dir={out}", *extra], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _resumed_equals(out, unbroken) -> None:
    """A resume finishes the interrupted run with exactly the unbroken run's adapter (in-process
    ranks: a second CLI run would cost some 25 s of CPU in its processes' imports alone)."""
    assert multiproc.run(train_until_interrupted, 2, [*UNBROKEN_ARGS, f"output_dir={out}"], True) == ["finished"] * 2
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert adapter.keys() == unbroken.keys()
    assert all(torch.allclose(adapter[k], unbroken[k], atol=1e-6, rtol=0) for k in adapter)


def _launch(out, *extra: str):
    """`ddptune train tiny --nproc 2` in the background; returns it once rank 0 has logged 3 steps."""
    proc = _cli(out, *extra)
    deadline = time.time() + 240
    path = out / "metrics.jsonl"
    while not (path.exists() and len(path.read_text().splitlines()) >= 3) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    return proc


def _workers(proc) -> list:
    return launch.workers(proc.pid)


@pytest.mark.parametrize("sig", [signal.SIGINT], ids=lambda s: s.name)  # SIGTERM takes the same path (test_slurm)
def test_a_signal_to_the_launcher_alone_stops_every_worker_after_a_checkpoint(tmp_path, sig, unbroken):
    out = tmp_path / "run"
    proc = _launch(out)
    workers = _workers(proc)
    logged = max(r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r)
    proc.send_signal(sig)  # to the launcher only, as Ctrl-C at its terminal, `kill` or a scheduler would
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err[-2000:]
    lines = [l for l in err.splitlines() if l.startswith("ddptune: stopped by")]  # a line of its own, not after the bar
    assert len(lines) == 1 and sig.name in words(lines[0]), err[-2000:]
    # the launcher answered at once, once, before the step under way ended (rank 0 shows a step once the next ran)
    text = err.replace("\r", "\n")
    heard = [l for l in text.splitlines() if field(l) == sig.name]
    assert len(heard) == 1 and text.index(heard[0]) < text.index(lines[0]), err[-2000:]
    shown = [int(n) for n in re.findall(r"(\d+)/60 \[", text[:text.index(heard[0])])]
    assert max(shown, default=0) <= logged + 1, (logged, shown)
    assert "Traceback" not in err and "ChildFailedError" not in err and "exitcode" not in err
    done, total = (int(w) for w in re.split(r"[\s,;()]+", lines[0]) if w.isdigit())  # the step saved, of the run's 60
    assert total == 60 and str(out / "checkpoints" / f"step-{done:06d}") in words(lines[0]), lines[0]
    # soon after the signal, counted in steps of the 60: rank 0 logs a step once the next one runs, the
    # processes agree on a stop one step after it came (2 steps here), and the launcher passes it on
    assert logged <= done <= logged + 10, (logged, done)
    assert (out / "checkpoints" / f"step-{done:06d}" / "state.json").is_file()
    assert not any(w.is_running() and w.status() != "zombie" for w in workers)
    _resumed_equals(out, unbroken)


def test_killing_the_launcher_or_a_worker_ends_the_whole_job(tmp_path):
    import psutil

    proc = _launch(tmp_path / "a")  # SIGKILL to the launcher: the kernel tells torchrun, which stops the workers
    workers = _workers(proc)
    assert len(workers) == 2
    proc.kill()
    proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=60)
    assert not alive

    out = tmp_path / "b"
    proc = _launch(out)  # SIGKILL to one worker: the other cannot go on alone
    os.kill(_workers(proc)[-1].pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode != 0 and "Traceback" not in err, err[-3000:]
    # the console holds ddptune's lines and the bar, no text of torch's or gloo's (that goes to a file they name)
    console = [l for l in err.replace("\r", "\n").splitlines() if l.strip() and not l.startswith("train:")]
    assert all(l.startswith("ddptune: ") for l in console), err[-3000:]
    named = {w for l in console for w in words(l) if w.endswith(launch.RAW_LOG)}
    assert named == {str(out / launch.RAW_LOG)} and (out / launch.RAW_LOG).stat().st_size > 0, err[-3000:]
    # rank 0 names the failed collective, or the launcher the killed worker (rank 0's line was missing
    # once in eight runs, when torchrun stopped it before its collective failed; the launcher names the
    # worker that failed first, which is rank 0 when both failed within the same second)
    said = [l for l in err.splitlines() if field(l) == "rank 0" and any(w.startswith("train.timeout_minutes=") for w in words(l))
            and any(w.startswith(str(out / "checkpoints" / "step-")) for w in words(l))
            or l.startswith("ddptune: rank 1 ") and "SIGKILL" in words(l)]
    assert said, err[-3000:]
    # one line only: the launcher's naming the killed worker, rank 0's failed collective going to the log;
    # or, in a race seen once on a loaded host (the launcher took rank 0's failure for the cause:
    # launch.cause), rank 0's line alone
    ours = [l for l in console if l.startswith("ddptune")]
    assert len(ours) == 1 and re.findall(r"\brank (\d+)", ours[0]) in (["1"], ["0"]), err[-3000:]
    assert "SIGKILL" in words(ours[0]) or any(w.startswith("train.timeout_minutes=") for w in words(ours[0])), err[-3000:]
    assert (out / "checkpoints").is_dir() and any(p.name.startswith("step-") for p in (out / "checkpoints").iterdir())
    # (resuming after a killed worker: test_launch restarts one from its checkpoint to the unbroken adapter)


def train_with_a_slow_rank_1(overrides: list[str], metrics_path: str) -> None:
    """Rank 1 is frozen for 2 s in the middle of a step once rank 0 has logged 3 steps."""
    if os.environ["RANK"] == "1":
        def pause() -> None:
            while not (os.path.exists(metrics_path) and len(open(metrics_path).read().splitlines()) >= 3):
                time.sleep(0.01)
            import subprocess

            subprocess.Popen(["sh", "-c", f"sleep 2; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)

        threading.Thread(target=pause, daemon=True).start()
    train.run(config.load(TINY, overrides))


def test_a_straggling_process_is_named(tmp_path):
    out = tmp_path / "run"
    multiproc.run(train_with_a_slow_rank_1, 2, [f"output_dir={out}", "train.max_steps=40", "data.val=null"],
                  str(out / "metrics.jsonl"))
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    slow = [r for r in rows if "slow_rank" in r]
    assert slow and {r["slow_rank"] for r in slow} == {1}, slow
    assert slow[0]["slow_busy_s"] > 1.5 and slow[0]["slow_busy_s"] - slow[0]["others_median_s"] > 1.0  # the 2 s freeze
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 41))  # the run itself went on


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "new-interpreters"])
def test_sigint_to_the_launcher_reaches_each_worker_exactly_once(tmp_path, forked):
    """The launcher side of Ctrl-C (the workers' side, stop after a saved step, is tested above):
    torchrun runs apart from the terminal (start_new_session), and `launch.torchrun` passes the signal on
    to each worker once, forked or (no fork server: a TMPDIR too long for its socket) started as new
    interpreters."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=WORKER_PATH, SIGWORKER_DIR=str(tmp_path))
    if not forked:
        env["TMPDIR"] = str(socketless_tmpdir(tmp_path))
    launcher = subprocess.Popen([sys.executable, "-c", "import sys; from ddptune import launch; "
                                 "sys.exit(launch.torchrun(2, ['sigworker']))"], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)) and time.time() < deadline and launcher.poll() is None:
        time.sleep(0.05)
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + signal.SIGINT, err[-2000:]
    assert [(tmp_path / f"got-{r}").read_text() for r in (0, 1)] == [str(int(signal.SIGINT))] * 2
    assert "Traceback" not in err


def test_a_standby_launcher_starts_no_process_before_its_command_and_none_when_dismissed(tmp_path, monkeypatch):
    """launch.Standby, torch's launcher started while a run is checked: it imports torch, its fork
    server the modules named, and waits, with no worker; dismissed, it ends having started none, its
    fork server with it; sent its command by `launch.torchrun`, it starts the workers (forked ready-
    imported) with the environment sent, not the one it began with."""
    import psutil

    import tempfile

    temporary = Path(tempfile.mkdtemp(prefix="standby-"))  # (short: a socket's path may not be long)
    monkeypatch.setenv("TMPDIR", str(temporary))  # where multiprocessing keeps its fork server's socket, until it exits
    dismissed = launch.Standby(preload=("ddptune.cli",))
    deadline = time.time() + 60
    while len(helpers := psutil.Process(dismissed.proc.pid).children(recursive=True)) < 2 and time.time() < deadline:
        time.sleep(0.05)  # it starts the fork server and multiprocessing's tracker first
    assert len(helpers) == 2 and list(temporary.iterdir())
    dismissed.dismiss()
    assert dismissed.proc.returncode is not None and dismissed.orders.closed
    assert psutil.wait_procs(helpers, timeout=10)[1] == [] and list(temporary.iterdir()) == []  # nothing left behind
    standby = launch.Standby(preload=("ddptune.cli",))
    time.sleep(4.0)  # its imports, then its wait for the command
    assert standby.proc.poll() is None and launch.workers(standby.proc.pid) == []
    assert len(launch._helpers(psutil.Process(standby.proc.pid).children(recursive=True), ("forkserver",))) == 1
    sent = time.time()
    code = launch.torchrun(2, ["envworker"], env=dict(os.environ, PYTHONPATH=WORKER_PATH, ENVWORKER_DIR=str(tmp_path)), standby=standby)
    assert code == 0 and standby.proc.returncode == 0
    seen = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [(s["RANK"], s["WORLD_SIZE"], s["DDPTUNE_VALIDATED"], s["ENVWORKER_DIR"]) for s in seen] == \
        [(str(r), "2", "1", str(tmp_path)) for r in (0, 1)]
    assert all(sent <= float(s["DDPTUNE_SPAWNED"]) <= time.time() for s in seen)
    assert all(s["cli_preloaded"] for s in seen)  # forked with ddptune.cli imported
    assert list(temporary.iterdir()) == []  # nor after a job: its socket, nor torch's launcher's log folders
    temporary.rmdir()
    monkeypatch.delenv("TMPDIR")
    standby.dismiss()  # after its command: a no-op
    assert standby.proc.returncode == 0
    gone = launch.Standby()  # one that ended before its command: its exit code, not an error here
    gone.proc.kill()
    gone.proc.wait()
    assert launch.torchrun(2, ["envworker"], standby=gone) == -signal.SIGKILL and gone.orders.closed


def test_what_a_fork_server_imports_asks_nothing_of_cuda(tmp_path):
    """Workers are forked from a server that imported their modules: had it called into CUDA (even
    torch.cuda.is_available, which starts the driver), no forked worker could use a GPU. Each CUDA
    entry point is watched while the modules of train's and eval's workers are imported."""
    import subprocess
    import sys

    from ddptune import evaluate

    watch = ("is_available", "device_count", "init", "current_device", "get_device_capability", "get_device_properties",
             "get_device_name", "is_bf16_supported", "mem_get_info", "_lazy_init")
    script = "\n".join([
        "import importlib, sys, torch", "called = []",
        f"for name in {watch!r}:",
        "    setattr(torch.cuda, name, lambda *a, _n=name, **k: called.append(_n))",
        f"for module in {tuple(dict.fromkeys(launch.TRAIN_MODULES + evaluate.WORKER_MODULES))!r}:",
        "    importlib.import_module(module)",
        "print(len(sys.modules), called)"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    modules, called = out.stdout.split(" ", 1)
    assert int(modules) > 500 and called.strip() == "[]"  # torch and transformers were imported, and nothing asked


def test_a_signal_forwarded_before_the_workers_start_reaches_torchs_launcher():
    """Before its workers exist, a stop passed on by `launch.torchrun` goes to torch's launcher itself,
    not to the helpers it started first (multiprocessing's fork server and resource tracker)."""
    import psutil

    standby = launch.Standby()
    deadline = time.time() + 60
    while len(psutil.Process(standby.proc.pid).children(recursive=True)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    launch._forward(standby.proc, signal.SIGTERM)
    assert standby.proc.wait(timeout=30) == 0  # a standby stopped before its command exits quietly
    standby.dismiss()


def test_where_cuda_started_in_the_fork_server_each_worker_runs_in_a_new_interpreter(tmp_path, monkeypatch):
    """A fork server whose modules started CUDA (here: one that says so) leaves forks that could not use
    a GPU: each worker then runs its module in a new interpreter, with the environment sent, and the
    job's exit code is still its workers'."""
    monkeypatch.setenv("PYTHONPATH", WORKER_PATH)
    standby = launch.Standby(preload=("ddptune.cli", "cudaseen"))
    code = launch.torchrun(2, ["envworker"], env=dict(os.environ, ENVWORKER_DIR=str(tmp_path)), standby=standby)
    assert code == 0
    seen = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [(s["RANK"], s["WORLD_SIZE"], s["DDPTUNE_VALIDATED"], s["cli_preloaded"]) for s in seen] == \
        [(str(r), "2", "1", False) for r in (0, 1)]  # a new interpreter: nothing imported before it


def test_where_no_fork_server_can_start_the_workers_start_as_new_interpreters(tmp_path, monkeypatch):
    """A TMPDIR whose path is too long for multiprocessing's socket leaves no fork server: the job runs
    all the same, each worker a new interpreter with the environment sent."""
    long = socketless_tmpdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(long))
    code = launch.torchrun(2, ["envworker"], env=dict(os.environ, PYTHONPATH=WORKER_PATH, ENVWORKER_DIR=str(tmp_path)),
                           standby=launch.Standby(preload=("ddptune.cli",)))
    assert code == 0
    seen = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [(s["RANK"], s["WORLD_SIZE"], s["DDPTUNE_VALIDATED"], s["cli_preloaded"]) for s in seen] == \
        [(str(r), "2", "1", False) for r in (0, 1)]
    assert list(long.iterdir()) == []  # torch's launcher's log folders gone with it
