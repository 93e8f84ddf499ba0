"""The training command: real gloo processes (spawned in-process, or through torchrun and accelerate)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

import multiproc
from conftest import ROOT, check, checkpoints_kept, ddptune, field, metrics, words
from ddptune import admission, batches, config, graphs, model as model_lib, speed as speed_lib, stops, train
from ddptune.config import ConfigError

TINY = str(ROOT / "configs" / "tiny.yaml")


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in metrics(run_dir) if "loss" in r]


@contextlib.contextmanager
def forced(overrides: list[str]):
    """The overrides without `env:NAME=VALUE` entries, those set in the environment meanwhile (a run's
    DDPTUNE_SPEED: what a benchmark forces the speed decider to choose)."""
    env = dict(o[4:].split("=", 1) for o in overrides if o.startswith("env:"))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield [o for o in overrides if not o.startswith("env:")]
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def train_tiny(overrides: list[str], resume: bool = False) -> dict:
    """One process's part of `ddptune train configs/tiny.yaml OVERRIDES` (run by multiproc.run); the
    run keeps its checkpoints when it finishes (resume tests cut interrupted runs from them)."""
    with forced(overrides) as rest, checkpoints_kept():
        summary, _ = train.run(config.load(TINY, rest), resume=resume)
    return summary


def test_cli_two_processes_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = check(ddptune("train", TINY, f"output_dir={out}", "--nproc", "2", "train.profile_steps=2", "train.save_every=10"))
    # a checkpoint every 10 steps, removed by rank 0 once the run finished (nothing resumes a finished run)
    assert sorted(p.name for p in out.iterdir()) == [".ddptune-run", "adapter", "config.yaml", "data.json", "metrics.jsonl",
                                                     "profile.txt", "ranks.jsonl", "summary.json", "trace-rank1.json",
                                                     "trace.json"]

    for name in ("config.yaml", "metrics.jsonl", "ranks.jsonl", "summary.json", "adapter/adapter_model.safetensors",
                 "adapter/adapter_config.json", "adapter/tokenizer.json", "adapter/ddptune.yaml", "profile.txt"):
        assert (out / name).is_file(), name
    for trace in ("trace.json", "trace-rank1.json"):  # every process's timeline, each with its profiled steps: the
        # last two of 30 (steps 29 and 30), as late as a run shorter than 60 steps and the two profiled allows
        steps = {e["name"] for e in json.loads((out / trace).read_text())["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#28", "ProfilerStep#29"}, (trace, steps)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch"] == 8 and summary["per_process"] == 4
    assert len(set(summary["replica_fingerprints"])) == 1  # both replicas hold the same weights
    # only rank 0 prints: one start banner, one final line; the banner says what runs
    assert proc.stdout.count("ddptune: done") == 1 and proc.stdout.count("2 process(es)") == 1
    assert "batch: 8 samples per optimizer step = 4 per process x 2 processes, packed" in proc.stdout

    rows = metrics(out)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for key in ("lr", "tokens", "step_time_s", "tokens_per_s_per_gpu", "grad_norm", "compute_s", "wait_s", "optimizer_s"):
        assert all(r[key] >= 0 for r in steps), key
    first, last = sum(losses(out)[:3]) / 3, sum(losses(out)[-3:]) / 3
    assert last < first - 0.3, (first, last)
    assert any("val_loss" in r for r in rows)
    # every process's times and share, side by side; the shares are balanced
    ranks = [json.loads(l) for l in (out / "ranks.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ranks] == list(range(1, 31))
    assert all(len(r["compute_s"]) == len(r["wait_s"]) == len(r["tokens"]) == 2 for r in ranks)
    assert all(sum(r["tokens"]) == s["tokens"] for r, s in zip(ranks, steps))
    assert all(max(r["cost"]) / (sum(r["cost"]) / 2) == pytest.approx(s["balance"]) for r, s in zip(ranks, steps))
    split = summary["time_split"]
    assert split["step_s"] == pytest.approx(split["compute_s"] + split["imbalance_s"] + split["exposed_comm_s"] + split["rest_s"])

    # the adapter loads back with peft onto the same base and changes its output
    from peft import PeftModel

    base = model_lib.build_preset("tiny", 0, torch.float32, torch.device("cpu"))
    ids = torch.tensor([[256, 72, 105, 33, 10, 65]])
    before = base(ids).logits
    tuned = PeftModel.from_pretrained(base, out / "adapter")
    saved = load_file(out / "adapter" / "adapter_model.safetensors")
    loaded = {n: p for n, p in tuned.named_parameters() if "lora_" in n}
    assert len(loaded) == len(saved) > 0
    for name, tensor in saved.items():
        match = [p for n, p in loaded.items() if n.replace(".default", "") == name]
        assert len(match) == 1 and torch.equal(match[0], tensor), name
    assert not torch.allclose(tuned(ids).logits, before)


def train_all(runs: list[list[str]], padded: set[int] = frozenset()) -> list[dict]:
    """One process's part of each `ddptune train configs/tiny.yaml OVERRIDES`, in turn (one set of
    spawned processes serves several runs: each spawn costs seconds of imports); the runs whose
    index is in `padded` pad their rows as train.cuda_graphs does (train_tiny_padded)."""
    return [(train_tiny_padded if i in padded else train_tiny)(overrides) for i, overrides in enumerate(runs)]


ACCUMULATION = ["train.max_steps=4", "train.micro_batch_size=2", "train.lr=1e-2", "lora.dropout=0.0", "train.val_every=2",
                "train.tokens_per_forward=384"]


@pytest.fixture(scope="module")
def accumulation_runs(tmp_path_factory):
    """Padded and packed: one process accumulating 4 micro-batches, two processes with 2 each (packed
    rows of at most 384 tokens: each process's share of 4 samples takes 2 or more forwards too); and
    the golden run (one process, the tiny config's own batch), in the same spawned processes. The
    packed 2-process run all-reduces in buckets of 512 bytes (each LoRA tensor is 1 KiB or more)."""
    root = tmp_path_factory.mktemp("accumulation")
    one = lambda p: [f"output_dir={root / f'one-{p}'}", "train.grad_accum=4", *ACCUMULATION, f"train.packing={p}"]  # noqa: E731
    two = lambda p: [f"output_dir={root / f'two-{p}'}", "train.grad_accum=2", *ACCUMULATION, f"train.packing={p}",  # noqa: E731
                     *(["env:DDPTUNE_SPEED=bucket_mb=0.00048828125"] if p == "true" else [])]
    golden = multiproc.run(train_all, 1, [[f"output_dir={root / 'golden'}", "train.max_steps=4", "data.val=null"],
                                          one("false"), one("true")])[0][0]
    multiproc.run(train_all, 2, [two("false"), two("true")])
    return root, golden


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_two_processes_take_the_same_steps_as_one_with_accumulation(accumulation_runs, packing):
    """Each process runs several forwards a step, all-reducing in the last backward only: a process
    whose all-reduce came in another backward would leave the later ones' gradients its own."""
    root, _ = accumulation_runs
    one, two = root / f"one-{str(packing).lower()}", root / f"two-{str(packing).lower()}"

    rows = [r for r in metrics(one) if "loss" in r]
    # samples of unequal lengths: padded batches compute padding, packed rows none
    assert all((r["padded_tokens"] == r["tokens"]) if packing else (r["padded_tokens"] > r["tokens"]) for r in rows)
    assert len(losses(one)) == 4
    # every process takes 2 forwards or more a step: 2 micro-batches of 2, or more tokens than one packed row holds
    ranks = [json.loads(l) for l in (two / "ranks.jsonl").read_text().splitlines()]
    assert all(len(r["tokens"]) == 2 for r in ranks) and len(ranks) == 4
    if packing:
        assert all(t > 384 for r in ranks for t in r["tokens"]), ranks
    else:
        assert [r["forwards"] for r in metrics(two) if "loss" in r] == [2] * 4
    for a, b in zip(losses(one), losses(two), strict=True):
        assert abs(a - b) < 1e-5, (losses(one), losses(two))
    # the gradients too: a 2-process step whose gradients were averaged instead of summed (loss * world
    # left out) keeps losses within 6e-6 for a while, but not its gradient norms
    norms = lambda run: [r["grad_norm"] for r in metrics(run) if "grad_norm" in r]  # noqa: E731
    assert norms(two) == pytest.approx(norms(one), rel=1e-4, abs=1e-6) and len(norms(one)) == 4
    wa = load_file(one / "adapter" / "adapter_model.safetensors")
    wb = load_file(two / "adapter" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-5, rtol=0), k
    assert any(wa[k].abs().sum() > 0 for k in wa if "lora_B" in k)
    # validation loss: token-weighted sums reduced over processes, then divided
    val = lambda run: [r["val_loss"] for r in metrics(run) if "val_loss" in r]  # noqa: E731
    assert len(val(one)) == 2 and val(one) == pytest.approx(val(two), abs=1e-5)
    summary = json.loads((two / "summary.json").read_text())
    fps = summary["replica_fingerprints"]
    assert len(fps) == 2 and fps[0] == fps[1]
    # torch's default buckets hold all of LoRA's gradients at once; a bucket (forced) below the
    # smallest tensor gives each its own all-reduce, and the same losses
    assert summary["grad_buckets"] == (len(wa) if packing else 1) and len(wa) > 1


def test_golden_losses_of_the_tiny_preset(accumulation_runs):
    """Pinned per-step losses of one process on the tiny preset: a change that alters the maths
    for 1 and N processes alike (data order, loss normalisation, optimizer) shows up here."""
    root, summary = accumulation_runs
    assert losses(root / "golden") == pytest.approx(GOLDEN, abs=1e-4)
    assert summary["final_loss"] == pytest.approx(GOLDEN[-1], abs=1e-4)


GOLDEN = [5.806587219238281, 5.796869277954102, 5.726635456085205, 5.584110736846924]


def died_after(full, part, checkpoint_step: int, metric_lines: int):
    """`part`: what the finished run `full` would have left had it died after that checkpoint and
    that many lines of metrics.jsonl (its config, pointing at `part`)."""
    name = f"step-{checkpoint_step:06d}"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / name, part / "checkpoints" / name)
    saved = yaml.safe_load((full / "config.yaml").read_text()) | {"output_dir": str(part)}
    (part / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    lines = (full / "metrics.jsonl").read_text().splitlines()[:metric_lines]
    (part / "metrics.jsonl").write_text("".join(l + "\n" for l in lines))
    return part


def assert_ended_as(full, part, loss_tol: float, weight_tol: float) -> None:
    """The resumed run `part` logged every step of `full` once, with its losses and adapter."""
    assert [r["step"] for r in metrics(part) if "loss" in r] == [r["step"] for r in metrics(full) if "loss" in r]
    assert losses(part) == pytest.approx(losses(full), abs=loss_tol)
    wa = load_file(full / "adapter" / "adapter_model.safetensors")
    wb = load_file(part / "adapter" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=weight_tol, rtol=0), k


def test_resume_ends_with_the_weights_of_an_unbroken_run(tmp_path):
    # dropout on: the resumed run must also restore every process's RNG to match
    args = ["train.max_steps=6", "train.save_every=3", "train.keep_checkpoints=5", "lora.dropout=0.1", "data.val=null"]
    full = tmp_path / "full"
    multiproc.run(train_tiny, 2, [f"output_dir={full}", *args])
    assert [p.name for p in sorted((full / "checkpoints").iterdir())] == ["step-000003", "step-000006"]

    # the folder of a run that died during step 6, after its step-3 checkpoint and 5 metric lines
    part = died_after(full, tmp_path / "part", checkpoint_step=3, metric_lines=5)
    # a half-written checkpoint left by the crash is ignored
    (part / "checkpoints" / ".step-000006.tmp-x").mkdir()

    # a changed config is refused
    with pytest.raises(ConfigError) as e:
        admission.validate(config.load(TINY, [f"output_dir={part}", *args, "train.lr=0.5"]), 2, resume=True)
    (line,) = e.value.problems  # the key that differs, with the new value and the run's
    assert field(line) == "train.lr" and {"0.5", "0.01"} <= words(line), line

    multiproc.run(train_tiny, 2, [f"output_dir={part}", *args], True)
    assert_ended_as(full, part, loss_tol=1e-6, weight_tol=0.0)  # the same processes: the very same weights


def test_resume_at_another_process_count_keeps_the_global_batch_and_the_losses(tmp_path):
    """Stopped at 2 processes, resumed at 1 with the same samples per step: the data order is a
    function of seed, step and global batch, and the loss a sum over it, so the run continues as if
    unbroken (dropout 0; only the summation order differs)."""
    args = ["train.max_steps=6", "train.save_every=3", "train.keep_checkpoints=5", "lora.dropout=0.0", "data.val=null",
            "train.grad_accum=null", "train.effective_batch_size=8"]
    full = tmp_path / "full"
    multiproc.run(train_tiny, 2, [f"output_dir={full}", *args])
    part = died_after(full, tmp_path / "part", checkpoint_step=3, metric_lines=3)
    # another global batch at the new count is refused, naming the key
    with pytest.raises(ConfigError) as e:
        admission.validate(config.load(TINY, [f"output_dir={part}", *args[:-2]]), 1, resume=True)
    (line,) = e.value.problems  # the override that would take the same samples per step
    assert field(line) == "--resume" and "train.effective_batch_size=8" in words(line), line

    multiproc.run(train_tiny, 1, [f"output_dir={part}", *args], True)
    assert_ended_as(full, part, loss_tol=1e-5, weight_tol=1e-5)


def validate_under_a_launcher(overrides: list[str]) -> str:
    try:
        train.run(config.load(TINY, overrides))
    except ConfigError as e:
        return str(e)
    return "no error"


def test_under_an_external_launcher_rank_0_validates_and_every_process_stops(tmp_path):
    out = tmp_path / "run"
    errors = multiproc.run(validate_under_a_launcher, 2, [f"output_dir={out}", "data.train=no/such.json"])
    assert errors[0] == errors[1] and field(errors[0]) == "data.train" and "'no/such.json'" in words(errors[0]), errors
    assert not out.exists()


def test_lora_weights_change_and_base_weights_stay(tmp_path):
    cfg = config.load(TINY, [f"output_dir={tmp_path / 'run'}", "train.max_steps=5", "data.val=null"])
    _, tuned = train.run(cfg)
    base = model_lib.build_preset("tiny", cfg.train.seed, torch.float32, torch.device("cpu")).state_dict()
    n_lora = n_base = 0
    for name, p in tuned.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: non-zero means it trained
            assert p.requires_grad and p.abs().sum() > 0, name
            n_lora += 1
        elif "lora_" not in name:
            key = name.removeprefix("base_model.model.").replace(".base_layer", "")
            assert not p.requires_grad and torch.equal(p.detach(), base[key]), name
            n_base += 1
    assert n_lora == 2 * 7 and n_base == len(base)  # 7 linear projections per layer, 2 layers


def test_accelerate_launch_with_the_shipped_config(tmp_path):
    """`accelerate launch --config_file configs/accelerate/2gpu.yaml -m ddptune train ...` (CPU: gloo)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    (tmp_path / "tmp").mkdir()  # torch's launcher keeps its workers' error files in a folder it never removes
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TMPDIR=str(tmp_path / "tmp"))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "configs/accelerate/2gpu.yaml"),
           "--main_process_port", str(multiproc.free_port()),
           "-m", "ddptune", "train", TINY, f"output_dir={out}", "train.max_steps=3", "data.val=null"]
    check(subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600))
    # strict JSON (jq, JavaScript): without a validation set the loss is null, not NaN
    summary = json.loads((out / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(f"summary.json holds {c}"))
    assert summary["world_size"] == 2 and len(set(summary["replica_fingerprints"])) == 1
    assert summary["val_loss"] is None


@pytest.mark.parametrize("method", ["qlora"])  # the tutorial's path; LoRA takes the same checkpointing code
def test_gradient_checkpointing_works_under_ddp(method, tmp_path):
    """Non-reentrant checkpointing under DDP (reentrant fails with "marked ready twice"); the
    recomputation replays dropout exactly, so the losses equal a run without it. QLoRA runs on
    bitsandbytes' CPU 4-bit kernels here. A dequantized base (the speed decider's choice where it fits,
    forced here) keeps the NF4-rounded base as plain weights: the same losses and the same adapter as
    dequantizing in every pass."""
    args = [f"train.method={method}", "train.max_steps=3", "lora.dropout=0.1", "data.val=null"]
    on, off, kept = tmp_path / "on", tmp_path / "off", tmp_path / "kept"
    (summary, _, dequantized), _ = multiproc.run(train_all, 2, [
        [f"output_dir={on}", "train.gradient_checkpointing=true", *args],
        [f"output_dir={off}", "train.gradient_checkpointing=false", *args],
        [f"output_dir={kept}", "train.gradient_checkpointing=true", "env:DDPTUNE_SPEED=dequantize=true", *args]])
    assert summary["gradient_checkpointing"] is True and summary["method"] == method
    assert summary["base_4bit"] is True and dequantized["base_4bit"] is False
    assert len(set(summary["replica_fingerprints"])) == 1
    assert losses(on) == pytest.approx(losses(off), abs=1e-5)
    assert losses(kept) == losses(on)  # fp32 on CPU: bit for bit
    adapter = load_file(on / "adapter" / "adapter_model.safetensors")
    assert adapter and all(torch.equal(v, adapter[k]) for k, v in load_file(kept / "adapter" / "adapter_model.safetensors").items())


def test_gradient_checkpointing_keeps_a_fraction_of_the_activations(tmp_path):
    """from_pretrained leaves a model in eval mode, where transformers' layers skip checkpointing:
    the run trains its model in training mode, so that with checkpointing its forward keeps for the
    backward (saved tensors, in bytes) a fraction of what it keeps without. QLoRA: its preset base
    loads through from_pretrained, as a real model does."""
    from ddptune import step as step_lib

    kept = {}
    for on in ("true", "false"):
        r = train.setup(config.load(TINY, [f"output_dir={tmp_path / on}", f"train.gradient_checkpointing={on}",
                                           "train.method=qlora", "train.max_steps=1", "data.val=null"]))
        r.trackers.close()
        stream = r.level.stream
        batch = step_lib.to_device(stream.collate(stream.share(0).forwards[0][0], r.tokenizer.pad_token_id), r.accelerator.device)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
            r.loss_model(**batch, num_items=1).backward()
        kept[on] = sum(saved)
    assert 0 < kept["true"] < kept["false"] / 3, kept


def test_packing_gives_the_padded_losses_without_padding(tmp_path):
    """Padded micro-batches, packed rows, and packed rows padded to one length as train.cuda_graphs
    pads them (pad samples outside the loss): the same losses on 2 processes, different work."""
    args = ["train.max_steps=4", "train.micro_batch_size=2", "train.grad_accum=2", "lora.dropout=0.0", "data.val=null"]
    padded, packed, fixed = tmp_path / "padded", tmp_path / "packed", tmp_path / "fixed"
    multiproc.run(train_all, 2, [[f"output_dir={padded}", "train.packing=false", *args],
                                 [f"output_dir={packed}", "train.packing=true", *args],
                                 [f"output_dir={fixed}", "train.packing=true", *args]],
                  {2})  # the third run pads its rows
    assert losses(packed) == pytest.approx(losses(padded), abs=1e-5)
    assert losses(fixed) == pytest.approx(losses(packed), abs=1e-5)
    a, b, c = ([r for r in metrics(d) if "loss" in r] for d in (padded, packed, fixed))
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b] == [r["tokens"] for r in c]  # the same samples
    assert all(rb["forwards"] == 1 and ra["forwards"] == 2 for ra, rb in zip(a, b))
    # each process's 4 samples fit one 8192-token row: nothing but real tokens is computed
    assert all(r["padded_tokens"] == r["tokens"] for r in b)
    assert all(r["padded_tokens"] > r["tokens"] for r in a)
    # for graphs: one row per process, each padded to one of the run's 2 lengths (multiples of GRAPH_PAD)
    assert all(r["padded_tokens"] % batches.GRAPH_PAD == 0 and r["padded_tokens"] > r["tokens"] for r in c)
    assert len({r["padded_tokens"] for r in c}) > 1  # the steps' rows do not all take the longest length
    lengths = json.loads((fixed / "summary.json").read_text())["padded_lengths"]  # summary.json says which
    assert len(lengths) == 2 and all(n % batches.GRAPH_PAD == 0 for n in lengths)
    assert max(r["padded_tokens"] for r in c) <= 2 * max(lengths)  # 2 processes, a row each
    assert json.loads((packed / "summary.json").read_text())["padded_lengths"] == []


def train_tiny_padded(overrides: list[str], scope: str = "off") -> dict:
    """As train_tiny, with every packed row padded to one of 2 lengths as CUDA graphs pad them: on CPU
    the graphs themselves are off, but the padded lengths, the pad samples and their accounting are the same
    (`scope="step"`: the run is to record the whole step too)."""
    r = train.setup(config.load(TINY, overrides))
    sizes = tuple(speed_lib.padded(speed_lib.Work.of(r.level.stream), 2)[3])  # the 2 lengths the decider would pad to
    r.level = dataclasses.replace(r.level, speed=dataclasses.replace(r.level.speed, lengths=2, sizes=sizes, graphs=scope))
    train.prepare_graphs(r)
    try:
        return train.finish(r, *train.fit(r))[0]
    finally:
        r.trackers.close()


def test_a_step_that_cannot_be_recorded_runs_its_layers_one_by_one_with_the_same_losses(tmp_path, monkeypatch):
    """Recording the whole step fails (an operation a CUDA graph cannot capture): the run goes on with
    its rows padded and its layers launched one by one; summary.json says that no graphs ran, and the
    losses are those of the same padded run that was never to record."""
    args = ["train.max_steps=3", "data.val=null", "lora.dropout=0.0", "eval.enabled=false"]
    padded = train_tiny_padded([f"output_dir={tmp_path / 'padded'}", *args])

    def unrecordable(*_args, **_kwargs):
        raise graphs.Unrecordable("recording the step failed (operation not permitted when stream is capturing)")

    monkeypatch.setattr(graphs, "StepGraphs", unrecordable)
    fell = train_tiny_padded([f"output_dir={tmp_path / 'fell'}", *args], scope="step")
    assert fell["cuda_graphs"] == "off" and fell["speed"]["graphs"] == "off"
    assert fell["speed"]["reasons"]["CUDA graphs"] == {"code": "recording_failed", "why": "recording the step failed "
                                                       "(operation not permitted when stream is capturing)"}
    assert len(fell["padded_lengths"]) == 2 and fell["padded_lengths"] == padded["padded_lengths"]
    assert losses(tmp_path / "fell") == pytest.approx(losses(tmp_path / "padded"), abs=1e-6)


def test_compiled_layers_give_the_eager_losses_and_still_evaluate(tmp_path):
    """train.compile (regional torch.compile, dynamic lengths, varlen attention inside the graph)
    changes speed, not math; validation and generation afterwards run the layers eagerly. Two samples
    a packed row: the attention's loop over samples is traced once per sample, and tracing four of
    them with symbolic lengths cost some 20 s of a 2-core machine's CPU, for no other boundary."""
    args = ["train.max_steps=3", "train.packing=true", "train.micro_batch_size=2", "eval.enabled=true",
            "eval.zero_shot=false", "eval.max_samples=4", "eval.max_new_tokens=8", "data.val_rows=560:564"]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    ((_, summary),) = multiproc.run(train_all, 1, [[f"output_dir={eager}", "train.compile=false", *args],
                                                   [f"output_dir={compiled}", "train.compile=true", *args]])
    assert summary["compiled"] is True
    assert losses(compiled) == pytest.approx(losses(eager), abs=1e-5)
    val = [[r["val_loss"] for r in metrics(d) if "val_loss" in r] for d in (eager, compiled)]
    assert val[1] == pytest.approx(val[0], abs=1e-5) and len(val[0]) == 1
    assert (compiled / "eval" / "predictions.jsonl").is_file()


def test_profile_window_that_does_not_fit_is_refused(tmp_path):
    cfg = config.load(TINY, [f"output_dir={tmp_path / 'run'}", "train.max_steps=3", "train.profile_steps=2"])
    with pytest.raises(ConfigError) as e:
        admission.validate(cfg, 1)
    (line,) = e.value.problems  # the steps the window needs, and the run's
    assert field(line) == "train.profile_steps" and {"4", "3"} <= words(line), line


def test_profiled_steps_come_once_the_run_is_steady_or_as_late_as_it_allows():
    from ddptune import runlog

    # (steps left, steps profiled) -> steps before the profiled ones
    cases = {(921, 3): 60, (64, 3): 60, (63, 3): 60, (62, 3): 59, (7, 3): 4, (5, 3): 2, (4, 3): 2}
    assert {k: runlog.profile_wait(*k) for k in cases} == cases


def _diverge_one_replica(out: str) -> str:
    """Train tiny for 2 steps in each process, then nudge one trained weight on rank 1 only before
    the end-of-run check: the check must stop the run on every process."""
    r = train.setup(config.load(TINY, [f"output_dir={out}", "train.max_steps=2", "data.val=null"]))
    try:
        history, times = train.fit(r)
        if r.accelerator.process_index == 1:
            with torch.no_grad():
                next(p for p in r.model.parameters() if p.requires_grad).add_(1e-3)
        train.finish(r, history, times)
        return "finished"
    except stops.Diverged:
        return "diverged"
    finally:
        r.trackers.close()


def test_a_replica_that_drifts_is_caught_at_the_end_of_the_run(tmp_path):
    assert multiproc.run(_diverge_one_replica, 2, str(tmp_path / "run")) == ["diverged", "diverged"]
    assert not (tmp_path / "run" / "adapter").exists()  # nothing diverged is saved


def test_a_validation_pass_leaves_a_4bit_base_as_it_trains(monkeypatch):
    """bitsandbytes repacks a 4-bit weight for CPU inference at its first eval-mode forward without
    gradients where the CPU has AVX512-BF16 (this process is made to think it has, whatever it has),
    dropping the double quantization and rounding the scales to bf16: validation mid-run would leave
    training on other weights. The base's codes and scales come out of an eval pass bit for bit."""
    import bitsandbytes as bnb

    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)
    cfg = config.load(TINY, [])
    base = model_lib.load_model(cfg.model, "qlora", torch.device("cpu"), cfg.train.precision, 0)
    layers = model_lib.four_bit_layers(base)
    state = lambda: [(m.weight.data.clone(), m.weight.quant_state.absmax.clone()) for m in layers]  # noqa: E731
    before = state()
    base.eval()
    with torch.no_grad():
        base(torch.tensor([[256, 72, 105, 33, 10, 65]]))
    assert len(layers) == 14 and all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(before, state()))


FALLBACK_ARGS = ["train.max_steps=3", "data.val=null", "lora.dropout=0.0"]


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory):
    """The losses of 3 steps with eager layers, which both fallbacks below must give."""
    out = tmp_path_factory.mktemp("eager") / "run"
    train.run(config.load(TINY, [f"output_dir={out}", "train.compile=false", *FALLBACK_ARGS]))
    return losses(out)


def test_a_compile_that_fails_falls_back_to_eager_layers_with_the_same_losses(tmp_path, monkeypatch, eager_losses):
    """Compiling the layers fails in the first step (a backend that raises, as a broken toolchain
    would): the run goes on with eager layers, one line says why, and the losses are eager's."""
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    def compile_with_broken_backend(model, cuda_graphs=False, static=False, **_):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        for layer in base.get_decoder().layers:
            layer.compile(backend=broken)

    monkeypatch.setattr(model_lib, "compile_layers", compile_with_broken_backend)
    fell, _ = train.run(config.load(TINY, [f"output_dir={tmp_path / 'fell'}", "train.compile=true", *FALLBACK_ARGS]))
    assert (fell["compiled"], fell["speed"]["compiled"]) == (False, False)
    assert [fell["speed"]["reasons"][k]["code"] for k in ("compiled layers", "CUDA graphs", "combined kernels")] == [
        "compile_failed", "eager_layers", "eager_layers"]
    assert losses(tmp_path / "fell") == pytest.approx(eager_losses, abs=1e-6)


def test_combined_kernels_that_fail_to_compile_fall_back_to_compiled_layers_without_them(tmp_path, monkeypatch, eager_losses):
    """One level down, not two: where the layers' compile with combined kernels fails in the first step,
    the step runs again with layers compiled without them (here dynamo's eager backend), to eager's losses."""
    def broken(*args, **kwargs):
        raise RuntimeError("no combined kernels here")

    built = []

    def compile_layers(model, cuda_graphs=False, static=False, combo=False):
        built.append(combo)
        for layer in model.get_base_model().get_decoder().layers:
            layer.compile(backend=broken if combo else "eager", dynamic=True)

    monkeypatch.setattr(model_lib, "compile_layers", compile_layers)
    monkeypatch.setenv(speed_lib.FORCE_ENV, "combo=true")
    fell, _ = train.run(config.load(TINY, [f"output_dir={tmp_path / 'fell'}", "train.compile=true", *FALLBACK_ARGS]))
    assert built == [True, False]
    assert (fell["compiled"], fell["speed"]["combo"], fell["speed"]["compiled"]) == (True, False, True)
    assert fell["speed"]["reasons"]["combined kernels"]["code"] == "combo_failed"
    assert losses(tmp_path / "fell") == pytest.approx(eager_losses, abs=1e-6)
