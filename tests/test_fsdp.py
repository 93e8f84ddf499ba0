"""train.strategy=fsdp: FSDP2 (fully_shard through accelerate) on real gloo processes, on CPU.

FSDP with 2 processes takes the steps DDP with 2 processes takes, and one process takes: the same
losses, gradient norms (FSDP2's reduce-scatter averages as DDP's all-reduce does, so the loss
scaling holds) and final weights, for LoRA and full fine-tuning. Several forwards per step (each
reduce-scattered as it ends, unlike DDP's one all-reduce) and gradient checkpointing are part of the runs. Sharded
checkpoints are data only and resume exactly; the final save loads without ddptune.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

import multiproc
from conftest import ROOT, checkpoints_kept, field, metrics, words
from ddptune import admission, batches, checks, config, dist, train
from ddptune.config import ConfigError

TINY = str(ROOT / "configs" / "tiny.yaml")
# 4 steps of 8 samples; 512-token packed rows: each process runs several forwards a step
COMMON = ["train.max_steps=4", "train.effective_batch_size=8", "train.grad_accum=null", "train.tokens_per_forward=512",
          "lora.dropout=0.0", "data.val_rows=560:565", "train.val_every=2", "train.save_every=2", "train.keep_checkpoints=2"]
METHODS = ("lora", "full")


def train_all(runs: list[tuple[list[str], bool]]) -> list[dict]:
    """One process's part of each `ddptune train configs/tiny.yaml OVERRIDES [--resume]`, in turn; finished
    runs keep their checkpoints (the tests read them and cut interrupted runs from them)."""
    with checkpoints_kept():
        return [train.run(config.load(TINY, overrides), resume=resume)[0] for overrides, resume in runs]


def weights_file(run_dir, method: str):
    return run_dir / ("adapter/adapter_model.safetensors" if method == "lora" else "model/model.safetensors")


def rows(run_dir) -> list[dict]:
    return [r for r in metrics(run_dir) if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """For each method: FSDP over 2 processes (LoRA with gradient checkpointing on), DDP over 2,
    and one process; each strategy's runs share one set of spawned processes."""
    root = tmp_path_factory.mktemp("fsdp")
    dirs = {(s, m): root / f"{s}-{m}" for s in ("fsdp2", "ddp2", "one") for m in METHODS}
    args = lambda s, m: [f"output_dir={dirs[s, m]}", f"train.method={m}", *COMMON]  # noqa: E731
    fsdp = multiproc.run(train_all, 2, [(args("fsdp2", m) + ["train.strategy=fsdp", f"train.gradient_checkpointing={str(m == 'lora').lower()}"], False) for m in METHODS])
    multiproc.run(train_all, 2, [(args("ddp2", m), False) for m in METHODS])
    multiproc.run(train_all, 1, [(args("one", m), False) for m in METHODS])
    return dirs, fsdp[0]


@pytest.mark.parametrize("method", METHODS)
def test_fsdp_takes_the_steps_of_ddp_and_of_one_process(runs, method):
    dirs, summaries = runs
    summary = summaries[METHODS.index(method)]
    assert summary["strategy"] == "fsdp" and summary["world_size"] == 2 and summary["replica_fingerprints"] is None
    assert summary["gradient_checkpointing"] is (method == "lora")
    fsdp, ddp, one = (rows(dirs[s, method]) for s in ("fsdp2", "ddp2", "one"))
    assert len(fsdp) == len(ddp) == len(one) == 4
    assert all(r["forwards"] > 1 for r in fsdp)  # a reduce-scatter after each forward, sums into the shards
    for key in ("loss", "grad_norm"):  # a gradient summed (not averaged) over processes would double the norm
        for other in (ddp, one):
            assert [r[key] for r in fsdp] == pytest.approx([r[key] for r in other], abs=1e-5, rel=1e-5), key
    val = lambda d: [r["val_loss"] for r in metrics(d) if "val_loss" in r]  # noqa: E731
    assert len(val(dirs["fsdp2", method])) == 2
    assert val(dirs["fsdp2", method]) == pytest.approx(val(dirs["one", method]), abs=1e-5)

    # the final save is one plain file set, whole weights, equal to DDP's and one process's
    w = {s: load_file(weights_file(dirs[s, method], method)) for s in ("fsdp2", "ddp2", "one")}
    assert w["fsdp2"].keys() == w["ddp2"].keys() == w["one"].keys() and len(w["fsdp2"]) > 0
    for k in w["one"]:
        assert w["fsdp2"][k].shape == w["one"][k].shape, k
        assert torch.allclose(w["fsdp2"][k], w["ddp2"][k], atol=1e-5, rtol=0), k
        assert torch.allclose(w["fsdp2"][k], w["one"][k], atol=1e-5, rtol=0), k
    trained = [k for k in w["one"] if "lora_B" in k] if method == "lora" else list(w["one"])
    from ddptune import model as model_lib

    base = model_lib.build_preset("tiny", 0, torch.float32, torch.device("cpu")).state_dict()
    assert any(not torch.equal(w["fsdp2"][k], base.get(k, torch.zeros_like(w["fsdp2"][k]))) for k in trained)


def test_the_final_save_loads_without_ddptune(runs):
    """transformers and peft alone read what an FSDP run saved; it computes what the one-process save does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dirs, _ = runs
    ids = torch.tensor([[256, 72, 105, 33, 10, 65]])
    full = {s: AutoModelForCausalLM.from_pretrained(dirs[s, "full"] / "model", attn_implementation="sdpa")
            for s in ("fsdp2", "one")}
    assert torch.allclose(full["fsdp2"](ids).logits, full["one"](ids).logits, atol=1e-4)
    base = lambda: AutoModelForCausalLM.from_pretrained(dirs["one", "full"] / "model", attn_implementation="sdpa")  # noqa: E731
    lora = {s: PeftModel.from_pretrained(base(), dirs[s, "lora"] / "adapter") for s in ("fsdp2", "one")}
    assert torch.allclose(lora["fsdp2"](ids).logits, lora["one"](ids).logits, atol=1e-4)
    assert not torch.allclose(lora["fsdp2"](ids).logits, base()(ids).logits, atol=1e-4)  # the adapter does something


def test_sharded_checkpoints_hold_data_only_and_resume_exactly(runs, tmp_path):
    dirs, _ = runs
    full = dirs["fsdp2", "lora"]
    ckpt = full / "checkpoints" / "step-000002"
    assert json.loads((ckpt / "state.json").read_text())["shards"] == 2
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == ["optimizer.shard-00000.json", "optimizer.shard-00000.safetensors", "optimizer.shard-00001.json",
                     "optimizer.shard-00001.safetensors", "rng.json", "rng.safetensors", "scheduler.json", "state.json",
                     "weights.shard-00000.safetensors", "weights.shard-00001.safetensors"]
    # each process holds its own half of every adapter matrix (dim 0 split in two)
    halves = [load_file(ckpt / f"weights.shard-0000{i}.safetensors") for i in range(2)]
    whole = {k: v.shape for k, v in load_file(dirs["one", "lora"] / "checkpoints" / "step-000002" / "weights.safetensors").items()}
    assert halves[0].keys() == halves[1].keys() == whole.keys()
    assert all(halves[0][k].shape[0] + halves[1][k].shape[0] == whole[k][0] for k in whole)

    # the folder of a run that died during step 4, after its step-2 checkpoint and 3 metric lines
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, part / "checkpoints" / "step-000002")
    saved = yaml.safe_load((full / "config.yaml").read_text()) | {"output_dir": str(part)}
    (part / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    (part / "metrics.jsonl").write_text("".join(l + "\n" for l in (full / "metrics.jsonl").read_text().splitlines()[:3]))
    # and a newer checkpoint whose second part is damaged: it reads back on process 0 only, so both
    # processes must pass it over together (process 0 alone at step 3 would leave the two apart)
    newer = part / "checkpoints" / "step-000003"
    shutil.copytree(ckpt, newer)
    (newer / "state.json").write_text(json.dumps(json.loads((ckpt / "state.json").read_text()) | {"step": 3}))
    (newer / "weights.shard-00001.safetensors").write_bytes(b"not safetensors")
    args = [f"output_dir={part}", "train.method=lora", *COMMON, "train.strategy=fsdp", "train.gradient_checkpointing=true"]
    with pytest.raises(ConfigError) as e:
        admission.validate(config.load(TINY, args + ["train.effective_batch_size=8"]), 1, resume=True)
    (line,) = e.value.problems  # the newest checkpoint (process 0 reads its part), its 2 parts, the 1 process, --nproc 2
    assert field(line) == "--resume" and str(newer) in words(line), line
    assert [w for w in line.split() if w.strip("()").isdigit()] == ["2", "1", "2)"], line
    multiproc.run(train_all, 2, [(args, True)])
    assert [r["step"] for r in rows(part)] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows(part)] == pytest.approx([r["loss"] for r in rows(full)], abs=1e-6)
    a, b = load_file(weights_file(full, "lora")), load_file(weights_file(part, "lora"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_fsdp_refuses_what_it_does_not_cover():
    problems = checks.check_values(config.load(TINY, ["train.strategy=fsdp", "train.method=qlora", "eval.enabled=true"]))
    assert len(problems) == 1 and field(problems[0]) == "eval.enabled" and "train.strategy=fsdp" in words(problems[0]), problems
    assert checks.check_values(config.load(TINY, ["train.strategy=fsdp", "train.method=qlora"])) == []  # tests/test_fsdp_qlora.py
    with pytest.raises(ConfigError) as e:
        config.load(TINY, ["train.strategy=zero"])
    (line,) = e.value.problems
    assert field(line) == "train.strategy" and "'zero'" in words(line), line
    assert checks.check_values(config.load(TINY, ["train.strategy=fsdp", "train.method=full"])) == []
    policy = dist.fsdp_plugin(bf16=True).mixed_precision_policy  # bf16 compute, gradients reduced in fp32 as DDP's
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32


def test_lockstep_gives_every_process_as_many_forwards():
    a, b, c, d, e = ({"id": i} for i in range(5))
    out = batches.lockstep([[[a, b, c], [d]], [[e]], [[a], [b], [c]]])
    assert [len(rows) for rows in out] == [3, 3, 3]
    assert out[0] == [[a], [b, c], [d]]  # the row of the most samples split in two: the same samples
    assert out[1] == [[e], [], []]  # one sample cannot be split: forwards that count nothing
    assert out[2] == [[a], [b], [c]]


def test_the_cost_model_counts_fsdp_traffic():
    from ddptune import comm, scale

    p, g, bw = 1_000_000, 400_000, 1e9  # bytes of all weights (as gathered), of trainable gradients; busbw
    t = comm.fsdp_traffic(p, g, 4, bw)
    assert t["all_gathers"] == 2  # forward, and again for backward (reshard_after_forward)
    assert t["comm_s"] == pytest.approx(0.75 * (2 * p + g) / bw)
    assert comm.fsdp_traffic(p, g, 4, bw, forwards=3)["comm_s"] == pytest.approx(0.75 * (6 * p + g) / bw)
    assert comm.fsdp_traffic(p, g, 4, bw, reshard_after_forward=False)["comm_s"] == pytest.approx(0.75 * (p + g) / bw)
    assert comm.fsdp_traffic(p, g, 1, bw)["comm_s"] == 0
    # full fine-tuning in fp32: 1.5x the bytes of DDP's ring all-reduce of the same gradients
    assert comm.fsdp_traffic(g, g, 8, bw)["comm_s"] == pytest.approx(1.5 * comm.ring_allreduce_s(g, 8, bw))
    # `ddptune scale` on an FSDP run predicts with it: LoRA moves the whole (frozen) base every pass
    summary = {"method": "lora", "gradient_checkpointing": False, "trainable_params": 1000, "total_params": 10**6,
               "strategy": "fsdp", "mixed_precision": "bf16"}
    rows = [{"mode": "same-global", "nproc": n, "per_process": 8 // n, "step_s": 1.0 / n, "exposed_comm_s": 0.0, "speedup": n}
            for n in (1, 2)]
    out = scale.communication(rows, summary, {"peak_busbw_GBps": 1.0}, "PCIe", "same-global")
    (two,) = [m for m in out["measured"] if m["nproc"] == 2]
    assert two["pred_comm_s"] == pytest.approx(0.5 * (2 * 2e6 + 4000) / 1e9)
    ddp = scale.communication(rows, dict(summary, strategy="ddp"), {"peak_busbw_GBps": 1.0}, "PCIe", "same-global")
    assert [m for m in ddp["measured"] if m["nproc"] == 2][0]["pred_comm_s"] == pytest.approx(comm.ring_allreduce_s(4000, 2, 1e9))
