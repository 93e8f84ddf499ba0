"""Checkpoints hold data only: a planted pickle never runs; a checkpoint is checked against the run
before anything of it is used, and a damaged newest one falls back; a step that is not finite stops
the run before anything non-finite is saved."""
from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import multiproc
from conftest import ROOT, checkpoints_kept, field, metrics, words
from ddptune import checkpoint, config, model as model_lib, step, stops, train
from ddptune.data import tokenized
from ddptune.config import ConfigError

TINY = str(ROOT / "configs" / "tiny.yaml")


class Payload:
    """Unpickling this creates the file `path`: proof that a loader ran code from disk."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_planted_pickles_never_run(tmp_path):
    out = tmp_path / "run"
    with checkpoints_kept():
        train.run(config.load(TINY, [f"output_dir={out}", "train.max_steps=2", "train.save_every=2", "data.val=null"]))
    ckpt = out / "checkpoints" / "step-000002"
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == ["optimizer.json", "optimizer.safetensors", "rng.json", "rng.safetensors", "scheduler.json",
                     "state.json", "weights.safetensors"]
    marker = tmp_path / "pwned"
    m = model_lib.add_adapters(model_lib.build_preset("tiny", 0, torch.float32, torch.device("cpu"), "varlen"), "lora",
                               config.LoraConfig(r=8, alpha=16, dropout=0.0), False)
    opt, sched = step.build_optimizer(config.load(TINY).train, m, 2)
    for name in files:  # each file in turn replaced by a pickle that would create `marker`
        bad = tmp_path / "bad" / ckpt.name  # the folder's name is the step's
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(ckpt, bad)
        (bad / name).write_bytes(pickle.dumps(Payload(marker)))
        with pytest.raises(ValueError, match=f"^checkpoint {re.escape(str(bad))} "):
            checkpoint.load(bad, m, opt, sched, 0)
        assert not marker.exists(), name
    # the tokenized data: a pickle planted in its index (with the size its meta.json names) is not
    # read, and the store is made again
    cfg = config.load(TINY)
    tok = model_lib.load_tokenizer(cfg.model)
    folder = Path(tokenized.prepare(cfg.data, tok).train[0][1])
    want = tokenized.load(tokenized.prepare(cfg.data, tok))[0][:]
    (folder / "index.npy").write_bytes(pickle.dumps(Payload(marker)))
    meta = json.loads((folder / "meta.json").read_text())
    meta["bytes"]["index.npy"] = (folder / "index.npy").stat().st_size
    (folder / "meta.json").write_text(json.dumps(meta))
    again = tokenized.prepare(cfg.data, tok)
    assert not marker.exists() and again.made == ("demo",) and tokenized.load(again)[0][:] == want


def test_resume_falls_back_past_a_damaged_checkpoint(tmp_path):
    args = ["train.max_steps=4", "train.save_every=2", "train.keep_checkpoints=3", "lora.dropout=0.0", "data.val=null"]
    full = tmp_path / "full"
    with checkpoints_kept():
        train.run(config.load(TINY, [f"output_dir={full}", *args]))
    part = tmp_path / "part"
    shutil.copytree(full, part, ignore=shutil.ignore_patterns("adapter", "summary.json", "ranks.jsonl"))
    (part / "config.yaml").write_text((full / "config.yaml").read_text().replace(str(full), str(part)))
    shutil.rmtree(part / "checkpoints" / "step-000004")
    newest = part / "checkpoints" / "step-000003"  # a torn copy of step 2 posing as the newest
    shutil.copytree(part / "checkpoints" / "step-000002", newest)
    (newest / "optimizer.safetensors").write_bytes(b"\0" * 10)
    (newest / "state.json").write_text(json.dumps({"step": 3, "world_size": 1}))
    (part / "checkpoints" / ".step-000004.tmp-abc").mkdir()  # what a kill during a save leaves
    with checkpoints_kept():
        summary, _ = train.run(config.load(TINY, [f"output_dir={part}", *args]), resume=True)
    losses = lambda d: [r["loss"] for r in metrics(d) if "loss" in r]  # noqa: E731
    assert losses(part) == pytest.approx(losses(full), abs=1e-6)  # resumed after step 2, not 3
    assert not (part / "checkpoints" / ".step-000004.tmp-abc").exists()  # the next save cleared it
    a, b = load_file(full / "adapter" / "adapter_model.safetensors"), load_file(part / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    (part / "summary.json").unlink()  # as if it had died again, now with nothing readable to go back to
    for p in (part / "checkpoints").iterdir():
        shutil.rmtree(p)
    (part / "checkpoints" / "step-000002").mkdir()
    (part / "checkpoints" / "step-000002" / "state.json").write_text("{not json")
    with pytest.raises(ConfigError) as e:
        train.run(config.load(TINY, [f"output_dir={part}", *args]), resume=True)
    assert field(e.value.problems[0]) == "--resume" and str(part / "checkpoints") in words(e.value.problems[0])


def test_a_step_that_is_not_finite_stops_the_run_before_saving(tmp_path):
    out = tmp_path / "run"
    cfg = config.load(TINY, [f"output_dir={out}", "train.max_steps=8", "train.lr=1e30", "train.max_grad_norm=0",
                             "train.warmup_steps=0", "train.lr_schedule=constant", "data.val=null"])
    with pytest.raises(stops.NonFinite) as e:
        train.run(cfg)
    step = int(re.match(r"step (\d+): ", str(e.value)).group(1))  # the step it names is the first not logged
    assert step >= 1 and [r["step"] for r in metrics(out) if "loss" in r] == list(range(1, step))
    assert not (out / "adapter").exists() and not (out / "summary.json").exists()


def test_a_finished_run_is_not_resumed_over(tmp_path):
    from ddptune import admission

    out = tmp_path / "run"
    args = [f"output_dir={out}", "train.max_steps=2", "train.save_every=2", "data.val=null"]
    train.run(config.load(TINY, args))
    before = (out / "summary.json").read_text()
    with pytest.raises(ConfigError) as e:
        admission.validate(config.load(TINY, args), 1, resume=True)
    assert field(e.value.problems[0]) == "output_dir" and {str(out), "summary.json"} <= words(e.value.problems[0])
    assert (out / "summary.json").read_text() == before


def _save_forever(folder: str) -> None:
    """Write checkpoints of a 128 MB weight, step after step, until killed."""
    w = torch.nn.Parameter(torch.randn(32 * 1024 * 1024))
    opt = torch.optim.SGD([w], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for step in range(1, 10_000):
        checkpoint.save(Path(folder), step, {"w": w.detach()}, opt, sched, [checkpoint.rng_state()], {"world_size": 1})


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_whole(tmp_path):
    import signal
    import time

    folder = tmp_path / "checkpoints"
    proc = multiproc.context().Process(target=_save_forever, args=(str(folder),))
    proc.start()
    deadline = time.time() + 120
    # wait until one checkpoint is complete and the next is being written, then kill -9
    while time.time() < deadline and not (checkpoint.list_checkpoints(folder) and list(folder.glob(".step-*.tmp-*"))):
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    complete = checkpoint.list_checkpoints(folder)
    assert complete and list(folder.glob(".step-*.tmp-*")), "the kill did not land during a save"
    w = torch.nn.Parameter(torch.zeros(32 * 1024 * 1024))
    opt = torch.optim.SGD([w], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model = torch.nn.Module()
    model.w = w
    state = checkpoint.load(complete[-1], model, opt, sched, 0)  # the newest complete one reads back whole
    assert state["step"] == int(complete[-1].name.split("-")[1]) and w.abs().sum() > 0
    (folder / f".{complete[-1].name}.old").mkdir()  # what a kill between commit's two renames leaves
    checkpoint.prune(folder, keep=1)
    assert not list(folder.glob(".step-*.tmp-*")) and checkpoint.list_checkpoints(folder) == complete[-1:]
    assert not list(folder.glob(".step-*.old"))


def test_learning_rates_kept_on_the_gpu_resume_in_either_kind_of_optimizer(tmp_path):
    """A step recorded as CUDA graphs keeps the learning rate as a tensor that its schedule fills in
    place (the recorded update reads it there). A checkpoint stores it as a number: a run with a
    tensor rate resumes one written with a number and the reverse, the tensor stays the object the
    optimizer had (a recording still points at it), and both go on as the unbroken run does."""
    import transformers

    def run_parts(tensor_lr: bool):
        w = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.AdamW([w], lr=torch.tensor(1e-3) if tensor_lr else 1e-3)
        return w, opt, transformers.get_scheduler("linear", opt, num_warmup_steps=2, num_training_steps=10)

    def step(w, opt, sched):
        w.grad = torch.arange(3.0)
        opt.step()
        sched.step()

    for saved_with_tensor in (True, False):
        w, opt, sched = run_parts(saved_with_tensor)
        for _ in range(3):
            step(w, opt, sched)
        path = checkpoint.save(tmp_path / str(saved_with_tensor), 3, {"w": w.detach()}, opt, sched, [checkpoint.rng_state()], {})
        step(w, opt, sched)  # the unbroken run's step 4
        for tensor_lr in (True, False):
            w2, opt2, sched2 = run_parts(tensor_lr)
            lr_object = opt2.param_groups[0]["lr"]
            checkpoint.load(path, torch.nn.ParameterDict({"w": w2}), opt2, sched2, 0)
            assert (opt2.param_groups[0]["lr"] is lr_object) == tensor_lr
            assert float(opt2.param_groups[0]["lr"]) == pytest.approx(8.75e-4)
            step(w2, opt2, sched2)
            assert torch.allclose(w2, w) and float(opt2.param_groups[0]["lr"]) == pytest.approx(float(opt.param_groups[0]["lr"]))


# --- a checkpoint is checked against the run before anything of it is used --------------------------

def small_parts(seed: int):
    """A real two-layer model (one weight frozen: no checkpoint holds it), AdamW and a cosine schedule."""
    import transformers

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].bias.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt, transformers.get_scheduler("cosine", opt, num_warmup_steps=1, num_training_steps=10)


@pytest.fixture(scope="module")
def saved_step_2(tmp_path_factory) -> Path:
    model, opt, sched = small_parts(0)
    for _ in range(2):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    weights = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    return checkpoint.save(tmp_path_factory.mktemp("saved") / "checkpoints", 2, weights, opt, sched,
                           [checkpoint.rng_state()], {"world_size": 1, "global_batch": 4})


def rewrite(stem: str, change):
    """Damage: `change(obj)` on what `stem`.json (with its tensors) holds, written back as a save would."""
    def damage(folder: Path) -> None:
        tensors_file = folder / f"{stem}.safetensors"
        tensors = load_file(tensors_file) if tensors_file.exists() else {}
        obj = change(checkpoint.join_tensors(json.loads((folder / f"{stem}.json").read_text()), tensors))
        out: dict = {}
        (folder / f"{stem}.json").write_text(json.dumps(checkpoint.split_tensors(obj, stem, out)))
        if tensors_file.exists():
            save_file(out, tensors_file)
    return damage


def weights(change):
    def damage(folder: Path) -> None:
        save_file(change(load_file(folder / "weights.safetensors")), folder / "weights.safetensors")
    return damage


def state(**values):
    return lambda folder: (folder / "state.json").write_text(json.dumps({"step": 2, "world_size": 1, **values}))


def write(name: str, content: bytes):
    return lambda folder: (folder / name).write_bytes(content)


def put(key, value):
    return lambda d: {**d, key: value}


def optimizer_state(change):
    return rewrite("optimizer", lambda o: {**o, "state": change(o["state"])})


def first_rng(change):
    return rewrite("rng", lambda rngs: [change(rngs[0])])


DAMAGE = [  # (id, damage to a copy of a good step-2 checkpoint, the run's total_steps)
    ("a weight of shape [1]", weights(put("0.weight", torch.zeros(1))), 10),
    ("a weight of a shape that does not broadcast", weights(put("0.weight", torch.zeros(5, 7))), 10),
    ("a weight of another dtype", weights(lambda w: put("0.weight", w["0.weight"].double())(w)), 10),
    ("a trained weight missing", weights(lambda w: {k: v for k, v in w.items() if k != "0.bias"}), 10),
    ("a weight the model lacks, named like a path", weights(put("../../etc/passwd", torch.zeros(1))), 10),
    ("step -20", state(step=-20), 10),
    ("step 1e15", state(step=1e15), 10),
    ("step as text", state(step="2"), 10),
    ("step true", state(step=True), 10),
    ("step not the folder's", state(step=3), 10),
    ("step past the run's end", lambda folder: None, 1),
    ("world size 0", state(world_size=0), 10),
    ("global batch not a number", state(global_batch="8"), 10),
    ("state.json a list", write("state.json", b"[2]"), 10),
    ("no RNG states", rewrite("rng", lambda rngs: []), 10),
    ("an RNG state not a dict", rewrite("rng", lambda rngs: [1]), 10),
    ("a torch RNG state of the wrong size", first_rng(put("torch", torch.zeros(3, dtype=torch.uint8))), 10),
    ("a torch RNG state not a ByteTensor", first_rng(lambda s: put("torch", s["torch"].float())(s)), 10),
    ("a python RNG state cut short", first_rng(put("python", (3, (1, 2, 3), None))), 10),
    ("a numpy RNG state cut short", first_rng(lambda s: put("numpy", ["MT19937", [1, 2], 0, 0, 0.0])(s)), 10),
    ("optimizer state for a parameter that does not exist", optimizer_state(lambda st: {**st, 99: {k: v.clone() for k, v in st[0].items()}}), 10),
    ("an optimizer state of the wrong shape", optimizer_state(lambda st: {**st, 0: put("exp_avg", torch.zeros(1))(st[0])}), 10),
    ("an optimizer step that is text", optimizer_state(lambda st: {**st, 0: put("step", "many")(st[0])}), 10),
    ("two optimizer parameter groups", rewrite("optimizer", lambda o: put("param_groups", o["param_groups"] * 2)(o)), 10),
    ("an optimizer learning rate that is text",
     rewrite("optimizer", lambda o: put("param_groups", [put("lr", "fast")(o["param_groups"][0])])(o)), 10),
    ("a scheduler state that is a list", rewrite("scheduler", lambda s: [1, 2]), 10),
    ("a scheduler state without last_epoch", rewrite("scheduler", lambda s: {k: v for k, v in s.items() if k != "last_epoch"}), 10),
    ("a scheduler last_epoch that is text", rewrite("scheduler", put("last_epoch", "x")), 10),
    ("a scheduler last_epoch that is a fraction", rewrite("scheduler", put("last_epoch", 2.5)), 10),
    ("a torn optimizer file", write("optimizer.safetensors", b"\0" * 10), 10),
    ("a safetensors header that claims 2**60 bytes", write("weights.safetensors", (2**60).to_bytes(8, "little") + b"{}"), 10),
    ("deep JSON", write("scheduler.json", b"[" * 100_000 + b"]" * 100_000), 10),
]


def everything(model, opt, sched) -> tuple:
    """What a failed load must leave as it was: weights, optimizer and scheduler states, every RNG."""
    return ({k: v.clone() for k, v in model.state_dict().items()}, repr(opt.state_dict()), repr(sched.state_dict()),
            torch.get_rng_state(), random.getstate(), repr(np.random.get_state()))


@pytest.mark.parametrize("damage, total_steps", [c[1:] for c in DAMAGE], ids=[c[0] for c in DAMAGE])
def test_a_checkpoint_unlike_the_run_is_refused_and_changes_nothing(saved_step_2, tmp_path, damage, total_steps):
    folder = tmp_path / "checkpoints" / "step-000002"
    shutil.copytree(saved_step_2, folder)
    damage(folder)
    model, opt, sched = small_parts(1)
    before = everything(model, opt, sched)
    with pytest.raises(ValueError, match=f"^checkpoint {re.escape(str(folder))} "):
        checkpoint.load(folder, model, opt, sched, 0, total_steps=total_steps)
    after = everything(model, opt, sched)
    assert before[0].keys() == after[0].keys() and all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert before[1:3] == after[1:3] and torch.equal(before[3], after[3]) and before[4:] == after[4:]


def test_an_undamaged_checkpoint_restores_everything(saved_step_2):
    model, opt, sched = small_parts(1)
    assert checkpoint.load(saved_step_2, model, opt, sched, 0, total_steps=2)["step"] == 2
    saved = load_file(saved_step_2 / "weights.safetensors")
    assert all(torch.equal(p, saved[n]) for n, p in model.named_parameters() if p.requires_grad)
    assert sched.last_epoch == 2 and len(opt.state) == 3


@pytest.fixture(scope="module")
def unbroken_4(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("unbroken4") / "run"
    with checkpoints_kept():
        train.run(config.load(TINY, [f"output_dir={out}", *RESUME_ARGS]))
    return out


RESUME_ARGS = ["train.max_steps=4", "train.save_every=2", "train.keep_checkpoints=3", "lora.dropout=0.0", "data.val=null"]


@pytest.mark.parametrize("damage", [weights(lambda w: {k: torch.zeros(1) for k in w}), state(step=1e15)],
                         ids=["weights of shape [1]", "step 1e15"])
def test_a_resume_falls_back_past_a_checkpoint_unlike_the_run(unbroken_4, tmp_path, capsys, damage):
    part = tmp_path / "part"
    shutil.copytree(unbroken_4, part, ignore=shutil.ignore_patterns("adapter", "summary.json", "ranks.jsonl"))
    (part / "config.yaml").write_text((unbroken_4 / "config.yaml").read_text().replace(str(unbroken_4), str(part)))
    newest = part / "checkpoints" / "step-000004"
    damage(newest)
    train.run(config.load(TINY, [f"output_dir={part}", *RESUME_ARGS]), resume=True)
    said = capsys.readouterr()
    warned = [l for l in (said.out + said.err).splitlines() if "warning" in l]
    assert any(f"checkpoint {newest} " in l for l in warned), warned
    losses = lambda d: [r["loss"] for r in metrics(d) if "loss" in r]  # noqa: E731
    assert losses(part) == pytest.approx(losses(unbroken_4), abs=1e-6)  # resumed after step 2
    a, b = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (unbroken_4, part))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_committed_folders_get_a_plain_folders_permissions(tmp_path, unbroken_4):
    """mkdtemp makes the temporary folder private (0700); once renamed into place it has what a
    plain mkdir gives, whatever the umask."""
    plain = 0o777 & ~(umask := os.umask(0o027))
    os.umask(umask)
    assert (unbroken_4 / "adapter").stat().st_mode & 0o777 == plain
    assert all(p.stat().st_mode & 0o777 == plain for p in (unbroken_4 / "checkpoints").iterdir())
    saved = os.umask(0o027)
    try:
        w = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([w], lr=0.1)
        path = checkpoint.save(tmp_path / "checkpoints", 1, {"w": w.detach()}, opt,
                               torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), [checkpoint.rng_state()], {})
    finally:
        os.umask(saved)
    assert path.stat().st_mode & 0o777 == 0o750


def test_remove_leftovers_deletes_what_a_killed_save_left_and_nothing_else(tmp_path):
    out = tmp_path / "run"
    (out / "adapter").mkdir(parents=True)
    for name in (".adapter.tmp-abc123", ".adapter.tmp-x9", ".adapter.old"):
        (out / name).mkdir()
        (out / name / "adapter_model.safetensors").write_bytes(b"\0" * 1000)
    (out / ".adapter.tmp-file").write_text("a file by such a name")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    (out / ".adapter.tmp-link").symlink_to(outside)  # removed, never followed
    kept = ["adapter", ".model.tmp-1", "adapter.tmp-2", ".adapterx.old", ".adapter.older"]
    for name in kept[1:]:
        (out / name).mkdir()
    checkpoint.remove_leftovers(out / "adapter")
    assert sorted(p.name for p in out.iterdir()) == sorted(kept)
    assert (outside / "keep.txt").read_text() == "mine"
    checkpoint.remove_leftovers(tmp_path / "nowhere" / "model")  # no folder: nothing to do


def test_a_run_moved_to_another_folder_resumes_there(unbroken_4, tmp_path):
    """The saved config.yaml names the folder the run was started in; a resume from where the run
    now lies goes on as the unbroken run did."""
    from ddptune import cli

    before, after = tmp_path / "before", tmp_path / "moved" / "after"
    shutil.copytree(unbroken_4, before, ignore=shutil.ignore_patterns("adapter", "summary.json", "ranks.jsonl"))
    (before / "config.yaml").write_text((unbroken_4 / "config.yaml").read_text().replace(str(unbroken_4), str(before)))
    shutil.rmtree(before / "checkpoints" / "step-000004")  # stopped after its step-2 checkpoint
    after.parent.mkdir()
    before.rename(after)
    assert cli.main(["train", TINY, f"output_dir={after}", *RESUME_ARGS, "--resume"]) == 0
    losses = lambda d: [r["loss"] for r in metrics(d) if "loss" in r]  # noqa: E731
    assert losses(after) == pytest.approx(losses(unbroken_4), abs=1e-6)
    a, b = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (unbroken_4, after))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)



def test_a_resume_on_a_cpu_takes_the_thread_count_its_checkpoint_was_written_with(tmp_path):
    """A run made in a process allowed one core (this machine's choice there: 1 thread), resumed from
    its step-1 checkpoint where the choice is a thread a core: the resume takes the checkpoint's 1
    thread again, so the order of every sum, and every bit, is the unbroken run's (16 samples a forward:
    sums long enough that torch splits them over threads; at 2 threads step 2 differs by some 1e-8)."""
    from ddptune import dist

    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        pytest.skip("needs 2 cores: the resume's own choice must differ from the checkpoint's")
    args = ["train.max_steps=3", "train.save_every=1", "train.keep_checkpoints=3", "train.micro_batch_size=16",
            "lora.dropout=0.0", "data.val=null", "eval.enabled=false"]
    full, part = tmp_path / "full", tmp_path / "part"
    os.sched_setaffinity(0, {min(cores)})
    try:
        with checkpoints_kept():
            train.run(config.load(TINY, [f"output_dir={full}", *args]))
    finally:
        os.sched_setaffinity(0, cores)
    assert json.loads((full / "checkpoints" / "step-000001" / "state.json").read_text())["threads"] == 1
    shutil.copytree(full, part, ignore=shutil.ignore_patterns("adapter", "summary.json", "ranks.jsonl", "step-000002",
                                                              "step-000003"))
    (part / "config.yaml").write_text((full / "config.yaml").read_text().replace(str(full), str(part)))
    train.run(config.load(TINY, [f"output_dir={part}", *args]), resume=True)
    assert torch.get_num_threads() == 1
    losses = lambda d: [r["loss"] for r in metrics(d) if "loss" in r]  # noqa: E731
    assert losses(part) == losses(full)
    a, b = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (full, part))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a count the user sets (OMP_NUM_THREADS) is kept, with a line that says the resume may differ
    assert dist.resume_threads(2, 1, forced=False) == (2, None) and dist.resume_threads(None, 1, forced=False) == (1, None)
    assert dist.resume_threads(2, 2, forced=True) == (2, None)
    threads, note = dist.resume_threads(2, 1, forced=True)
    assert threads == 1 and {"OMP_NUM_THREADS=1", "2", "OMP_NUM_THREADS=2"} <= words(note) and "\n" not in note, note
