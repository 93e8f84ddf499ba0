"""`ddptune plan`: its predictions against the peaks measured on an H200, its recommendations, and
`ddptune train` refusing a run the plan says will not fit (before loading anything)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import re

import pytest

from conftest import ROOT, SHARED_DATA, field, words
from ddptune import card, cli, config, memory, plan, speed, ways

CONFIG_8B = str(ROOT / "configs" / "samsum_qlora_llama31_8b.yaml")  # the tutorial's job


def refusal(overrides: list[str], world: int, gib: float) -> list[str]:
    """speed.memory_problems for the 8B config (with `overrides`) on `world` GPUs of `gib` GiB, from
    the choices the decider makes there for SAMSum-sized steps."""
    from test_speed import samsum_like

    cfg = config.load(CONFIG_8B, overrides)
    shape = memory.model_shape(cfg)
    chosen = speed.decide(cfg=cfg, cuda=True, shape=shape, world=world, free_gib=gib, work=samsum_like(parts=world),
                          card=dataclasses.replace(card.REFERENCE, matrix_tflops=989.0))
    return speed.memory_problems(cfg, shape, world, chosen)


def _plan_check():
    spec = importlib.util.spec_from_file_location("plan_check", ROOT / "benchmarks" / "plan_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data is not beside this checkout")
def test_prediction_inside_the_stated_band_of_every_measured_peak():
    """Each peak measured on an H200 (benchmarks/results), read from its raw file with the settings
    its run used; the largest forward recomputed from the same data and tokenizer. Every prediction
    lies inside the band memory.py (and the README) state: from PLAN_UNDER under to PLAN_OVER over.
    Not covered: the 1B QLoRA scale run the plan missed by 38 % (its raw peak lacks the run's
    largest forward; the run is in git history at commit 19efb42)."""
    check = _plan_check()
    runs = check.measured_runs()
    assert {r["file"] for r in runs} >= {"h200_llama31_8b_qlora_v2.json", "h200_llama31_8b_lora_bf16.json"}
    assert any(r["checkpointing"] for r in runs) and any(not r["checkpointing"] for r in runs)
    assert any(r["dequantized"] for r in runs if "dequantized" in r)  # a QLoRA base kept dequantized
    assert any(r.get("graphs") == "step" and not r["checkpointing"] for r in runs)  # CUDA graphs' pool counted
    assert any(r.get("graphs") == "step" and r["checkpointing"] for r in runs)  # ... recorded with checkpointing
    assert any(r.get("fsdp") and r["method"] == "qlora" for r in runs)  # FSDP over a 4-bit base
    misses, known = [], {}
    for r in runs:
        predicted = check.predict(r)
        inside = -memory.PLAN_UNDER <= predicted / r["measured_gib"] - 1 <= memory.PLAN_OVER
        if r["name"] in check.outside_band():
            known[r["name"]] = inside
        elif not inside:
            misses.append(f"{r['name']}: predicted {predicted:.2f} GiB, measured {r['measured_gib']:.2f} GiB")
    assert not misses, misses
    assert known == {name: False for name in check.outside_band()}  # each listed run is measured, and still outside


def test_8b_full_fine_tuning_just_fits_one_h200_and_an_80_gib_gpu_is_sent_to_fsdp():
    """AdamW's 16 bytes a weight (fp32 weights, gradients, two states) are 119.6 GiB at 8B: one H200
    held the run at 119.8 GiB (benchmarks/results/h200x2_llama31_8b_full_1gpu_metrics.jsonl), and
    plan says it fits, inside its own error of the GPU's size. An 80 GiB GPU cannot: FSDP over 2."""
    cfg = config.load(CONFIG_8B, ["train.method=full", "train.optimizer=adamw", "train.gradient_checkpointing=true"])
    shape = memory.model_shape(cfg)
    p = ways.plan(cfg, shape, gpus=1, gpu_gib=memory.DEFAULT_GPU_GIB)
    assert p["verdict"] == "ddp" and p["options"][0]["fits"]
    assert sum(p["options"][0][k] for k in ("weights", "gradients", "optimizer")) * memory.GIB > 16 * shape.params
    assert -memory.PLAN_UNDER < p["margin"] < 0  # fits, but closer to the GPU's size than plan's measured error
    p = ways.plan(cfg, shape, gpus=1, gpu_gib=80)
    n = p["fsdp_gpus_needed"]
    assert p["verdict"] == "does_not_fit" and n == 2 and p["options"][-1]["fits"] and p["options"][-1]["shards"] == n
    assert p["recommendation"].startswith("does not fit on 1 GPU") and f"FSDP (full shard) over {n} GPUs" in p["recommendation"]
    # with those GPUs given, FSDP over them is the recommendation itself
    assert ways.plan(cfg, shape, gpus=n, gpu_gib=80)["verdict"] == "fsdp"


def test_tiny_runs_ddp_as_is_and_checkpointing_is_recommended_when_activations_do_not_fit():
    tiny = config.load(ROOT / "configs" / "tiny.yaml")
    assert ways.plan(tiny, memory.model_shape(tiny))["verdict"] == "ddp"
    cfg = config.load(CONFIG_8B, ["train.gradient_checkpointing=false"])
    p = ways.plan(cfg, memory.model_shape(cfg), gpus=1, gpu_gib=40)
    assert p["verdict"] == "ddp_checkpointing"
    off, on = p["options"]
    assert off["activations"] > 5 * on["activations"] and off["weights"] == on["weights"]
    # forced on, the recorded CUDA graphs' pool is counted: a share of the activations
    graphs = config.load(CONFIG_8B, ["train.cuda_graphs=true", "train.gradient_checkpointing=false"])
    with_graphs = ways.plan(graphs, memory.model_shape(graphs), gpus=1, gpu_gib=400)["options"][0]
    assert with_graphs["graphs"] == pytest.approx(memory.GRAPH_POOL * with_graphs["activations"])
    assert off["graphs"] == 0


def test_plan_command_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli.main(["plan", CONFIG_8B, "--gpu-memory", "80",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "weights" in text and "activations" in text and "recommendation: DDP as is" in text
    saved = json.loads(out.read_text())
    assert saved["verdict"] == "ddp" and saved["gpu_memory_gib"] == 80 and saved["tokens_per_forward"] == 8192


def test_plan_and_train_record_the_same_choices_on_the_same_device(tmp_path, capsys):
    """`ddptune plan --json` and `ddptune train` of one config on one device (this machine's) make
    the speed choices once each, with one function from the same sample of the steps: the same
    choices and the same step estimate. A plan for GPUs of a given size (--gpu-memory) decides for a
    CUDA device. The 8B config's hub data: no sample here, so no choices, and the plan says so."""
    from ddptune import train

    tiny, keys = ROOT / "configs" / "tiny.yaml", ["train.max_steps=3", "data.val=null", f"output_dir={tmp_path / 'run'}"]
    assert cli.main(["plan", str(tiny), *keys, "--json", str(tmp_path / "plan.json")]) == 0
    planned = json.loads((tmp_path / "plan.json").read_text())["speed"]
    train.run(config.load(tiny, keys))
    ran = json.loads((tmp_path / "run" / "summary.json").read_text())["speed"]
    program = ("compiled", "graphs", "lengths", "sizes", "checkpointing", "dequantize", "bucket_mb", "combo", "forced")
    assert {k: planned[k] for k in program} == {k: ran[k] for k in program}
    assert planned["estimate"]["step_s"] == ran["estimate"]["step_s"] > 0
    assert planned["reasons"].keys() == ran["reasons"].keys()
    capsys.readouterr()
    assert cli.main(["plan", str(tiny), *keys, "--gpu-memory", "80", "--json", str(tmp_path / "gpu.json")]) == 0
    gpu = json.loads((tmp_path / "gpu.json").read_text())["speed"]
    assert gpu["compiled"] and gpu["graphs"] == "step" and gpu["estimate"]["free_gib"] == 80
    assert cli.main(["plan", CONFIG_8B, "--json", str(tmp_path / "hub.json")]) == 0
    assert json.loads((tmp_path / "hub.json").read_text())["speed"] is None


def test_plan_json_makes_its_folder_and_replaces_an_older_plan_whole(tmp_path, capsys):
    """--json as compare's: a missing folder is made; an existing file is replaced by a whole new
    one (a temporary file renamed over it), never left half-written."""
    out = tmp_path / "new" / "plan.json"
    tiny = str(ROOT / "configs" / "tiny.yaml")
    assert cli.main(["plan", tiny, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["gpus"] == 1
    assert cli.main(["plan", tiny, "--gpus", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["gpus"] == 2 and [p.name for p in out.parent.iterdir()] == ["plan.json"]


def test_train_refuses_a_run_that_will_not_fit_in_one_line_before_loading(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["train", CONFIG_8B, "train.method=full",
                     "data.train=demo", "data.train_rows=null", "data.val=null", "data.val_rows=null",
                     f"output_dir={out}", "--gpu-memory", "80"])  # an 80 GiB GPU: the 8B full fine-tune needs FSDP
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and field(err) == "memory", err
    # the method, the model and the 80 GiB given; the way out: FSDP over 2 GPUs (from 1), or the override that tries anyway
    assert {"full", "preset:llama-3.1-8b", "80.0", "FSDP", "train.memory_check=false"} <= words(err), err
    assert re.findall(r"\b(\d+) GPUs?\b", err) == ["1", "2"], err
    assert not out.exists() or not any(out.iterdir())
    # the plan is an estimate: a user who knows better can still try
    assert refusal(["train.method=full"], 1, 80)
    assert refusal(["train.method=full", "train.memory_check=false"], 1, 80) == []


def test_the_choices_say_whether_the_job_fits_and_the_refusal_follows_them():
    """`Speed.fits` (the least memory of the options costed within the free memory) is the one answer the
    admission reads: refused exactly where it is False; a mixture has no estimate (None) and is not refused."""
    from test_speed import samsum_like

    for overrides, world, gib, fits in ((["train.method=full"], 1, 80, False), (["train.method=full"], 1, 200, True),
                                         ([], 1, 12, True), ([], 1, 10, False), (["train.method=lora"], 2, 18, False)):
        cfg = config.load(CONFIG_8B, overrides)
        shape = memory.model_shape(cfg)
        chosen = speed.decide(cfg=cfg, cuda=True, shape=shape, world=world, free_gib=gib, work=samsum_like(parts=world))
        assert chosen.fits is fits and fits == (min(o["memory_gib"] for o in chosen.estimate["options"]) <= gib)
        assert (speed.memory_problems(cfg, shape, world, chosen) == []) is fits, (overrides, gib)
        assert (speed.memory_problems(cfg, shape, world, dataclasses.replace(chosen, fits=not fits)) == []) is (not fits)
    moe = dataclasses.replace(memory.model_shape(config.load(CONFIG_8B, [])), experts=8)
    chosen = speed.decide(cfg=config.load(CONFIG_8B, []), cuda=True, shape=moe, world=1, free_gib=1.0, work=samsum_like())
    assert chosen.fits is None and speed.memory_problems(config.load(CONFIG_8B, []), moe, 1, chosen) == []


def test_fsdp_auto_checkpointing_is_not_refused():
    # FSDP with checkpointing `auto`: turning it on is the way out the run takes itself, not a refusal
    shape = memory.model_shape(config.load(CONFIG_8B, []))
    auto = config.load(CONFIG_8B, ["train.method=full", "train.strategy=fsdp", "train.gradient_checkpointing=auto"])
    assert ways.plan(auto, shape, gpus=2, gpu_gib=100)["options"][0]["fits"] is False
    assert refusal(["train.method=full", "train.strategy=fsdp", "train.gradient_checkpointing=auto"], 2, 100) == []
    assert refusal(["train.method=full", "train.strategy=fsdp", "train.gradient_checkpointing=auto"], 2, 60)  # checkpointed: 80 GiB


def test_70b_qlora_on_two_48_gib_gpus_is_sent_to_fsdp_qlora(capsys):
    """Neither DDP-QLoRA (the whole 4-bit base, 37 GiB, on each GPU) nor LoRA on the bf16 base sharded
    over both (73 GiB of weights each) fits; FSDP-QLoRA with checkpointing does. Its weights term is
    each part of the sharded 4-bit base: the codes' half, the quantization state whole, the bf16
    embeddings and head's half, two gathered layers of codes, the gathered root unit, one matrix
    dequantized."""
    cfg = config.load(CONFIG_8B, ["model.source=preset:llama-3.1-70b"])
    shape = memory.model_shape(cfg)
    assert (shape.layers, shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.vocab, shape.tied) == \
        (80, 8192, 28672, 64, 8, 128256, False)
    p = ways.plan(cfg, shape, gpus=2, gpu_gib=48)
    assert (p["verdict"], p["recommended_method"]) == ("fsdp", "qlora")
    assert [(o["method"], o["fsdp"], o["gradient_checkpointing"], o["fits"]) for o in p["options"]] == [
        ("qlora", False, False, False), ("qlora", False, True, False),  # DDP-QLoRA
        ("lora", True, False, False), ("lora", True, True, False),      # bf16 LoRA, sharded
        ("qlora", True, False, False), ("qlora", True, True, True)]     # FSDP-QLoRA
    ddp, fsdp = p["options"][1], p["options"][-1]
    big = max(a * b for a, b in (f(shape) for f in memory.PROJECTIONS.values()))
    weights = (shape.matrix_params * 0.5 / 2 + shape.matrix_params * (memory.NF4_BYTES - 0.5) + shape.other_params * 2 / 2
               + 2 * 0.5 * shape.layer_params + shape.other_params * 2 + 2 * big)
    assert fsdp["weights"] == pytest.approx(weights / memory.GIB)
    assert 23 < fsdp["weights"] < 25 and ddp["weights"] > 37
    for term in ("adapters", "gradients", "optimizer"):  # sharded in two (DDP also keeps its reducer's copy of the gradients)
        assert fsdp[term] == pytest.approx(ddp[term] / (4 if term == "gradients" else 2))
    assert fsdp["activations"] == ddp["activations"] and fsdp["load_gib"] == pytest.approx(p["load_gib"])
    assert 37 < p["load_gib"] < 39 < fsdp["total"] < 48  # the whole 4-bit base loads onto each GPU first
    assert refusal(["model.source=preset:llama-3.1-70b", "train.strategy=fsdp", "train.gradient_checkpointing=true"], 2, 48) == []
    assert cli.main(["plan", CONFIG_8B, "model.source=preset:llama-3.1-70b", "--gpus", "2", "--gpu-memory", "48"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ("recommendation: FSDP (full shard) over 2 GPUs with gradient "
                                                        "checkpointing (train.strategy=fsdp)")
    # asked for LoRA on the bf16 base, which fits neither way: FSDP-QLoRA again, the method named
    lora = ways.plan(config.load(CONFIG_8B, ["model.source=preset:llama-3.1-70b", "train.method=lora"]), shape, 2, 48)
    assert (lora["verdict"], lora["recommended_method"]) == ("fsdp", "qlora")
    assert "train.method=qlora" in lora["recommendation"] and "train.strategy=fsdp" in lora["recommendation"]
    assert [o["fits"] for o in lora["options"]].index(True) == len(lora["options"]) - 1


def test_where_a_pair_of_24_gib_gpus_stops_being_enough():
    """70B: each process first loads the whole 4-bit base (38.0 GiB) onto its GPU, so no count of 24 GiB
    GPUs holds it; a pair needs 45.75 GiB each. The 70B shape cut to fewer layers (8192 tokens a
    forward, checkpointing): a 24 GiB pair holds 23 layers (21.8 B parameters), where one such GPU
    holds 19 with DDP; at 24 layers it takes 3 GPUs. With 2048-token forwards the load binds first:
    45 layers (40.6 B) fit, 46 do not load."""
    cfg = config.load(CONFIG_8B, ["model.source=preset:llama-3.1-70b"])
    shape = memory.model_shape(cfg)
    p = ways.plan(cfg, shape, gpus=2, gpu_gib=24)
    assert p["verdict"] == "does_not_fit" and p["fsdp_gpus_needed"] is None and "38.0 GiB for qlora" in p["recommendation"]
    assert ways.plan(cfg, shape, 2, 45.75)["verdict"] == "fsdp" and ways.plan(cfg, shape, 2, 45.5)["verdict"] == "does_not_fit"
    cut = lambda n: dataclasses.replace(shape, layers=n)  # noqa: E731
    assert ways.plan(cfg, cut(23), 2, 24)["verdict"] == "fsdp"
    assert ways.plan(cfg, cut(24), 2, 24)["fsdp_gpus_needed"] == 3
    assert ways.plan(cfg, cut(19), 1, 24)["verdict"] == "ddp_checkpointing"
    assert ways.plan(cfg, cut(20), 1, 24)["verdict"] == "does_not_fit"
    short = config.load(CONFIG_8B, ["model.source=preset:llama-3.1-70b", "train.tokens_per_forward=2048"])
    assert ways.plan(short, cut(45), 2, 24)["verdict"] == "fsdp"
    assert memory.load_gib(cut(46), "qlora") > 24 and ways.plan(short, cut(46), 2, 24)["fsdp_gpus_needed"] is None


def test_qlora_prefers_lora_on_the_bf16_base_sharded_to_its_own_base_sharded():
    """Where DDP-QLoRA does not fit but LoRA on the bf16 base sharded does, that is the recommendation
    (the exact weights, nothing dequantized in every pass), though FSDP-QLoRA would fit as well."""
    cfg = config.load(CONFIG_8B, ["model.source=preset:llama-3.2-1b"])
    shape = memory.model_shape(cfg)
    assert ways.plan(cfg, shape, 8, 100)["verdict"] == "ddp"
    need = memory.estimate(shape, memory.job_of(cfg, 8, checkpointing=True))["total"] / memory.GIB  # DDP-QLoRA's least
    p = ways.plan(cfg, shape, 8, need - 0.05)
    assert (p["verdict"], p["recommended_method"]) == ("fsdp", "lora")
    assert p["recommendation"].startswith("LoRA on the bf16 base (train.method=lora), FSDP (full shard) over 8 GPUs")
    four_bit = memory.estimate(shape, memory.job_of(cfg, 8, checkpointing=True, shards=8))["total"] / memory.GIB
    assert four_bit < need - 0.05


def test_fsdp_over_one_process_counts_its_gathered_copies():
    """One FSDP process still gathers each unit into buffers of its own: QLoRA's plan for it is
    DDP-QLoRA's plus two layers of codes and the root unit (the embeddings and head in bf16)."""
    cfg = config.load(CONFIG_8B, ["train.gradient_checkpointing=true"])
    shape = memory.model_shape(cfg)
    ddp = memory.estimate(shape, memory.job_of(cfg, 1))
    fsdp = memory.estimate(shape, memory.job_of(config.load(CONFIG_8B, ["train.gradient_checkpointing=true",
                                                                        "train.strategy=fsdp"]), 1))
    assert fsdp["weights"] - ddp["weights"] == pytest.approx(2 * 0.5 * shape.layer_params + shape.other_params * 2)
    assert 1.9 < (fsdp["weights"] - ddp["weights"]) / memory.GIB < 2.3


def test_qlora_with_room_is_told_its_base_fits_dequantized_and_that_costs_lora_s_weights():
    cfg = config.load(CONFIG_8B, [])
    shape = memory.model_shape(cfg)
    roomy, tight = ways.plan(cfg, shape, gpus=2, gpu_gib=139.8), ways.plan(cfg, shape, gpus=2, gpu_gib=20)
    lora = ways.plan(config.load(CONFIG_8B, ["train.method=lora"]), shape, gpus=2, gpu_gib=139.8)["options"][0]
    # LoRA's bf16 weights: the 4-bit codes are freed once the base is dequantized
    assert roomy["dequantized_base_gib"] == pytest.approx(lora["total"], rel=1e-6)
    assert roomy["dequantized_base_gib"] > roomy["options"][0]["total"] + 9 and "faster: the base fits dequantized" in plan.table(roomy)
    assert tight["dequantized_base_gib"] is None and "faster" not in plan.table(tight)


def test_a_dequantized_base_peaks_while_it_is_dequantized_where_training_needs_less():
    """While the base is dequantized its bf16 weights and the 4-bit codes live side by side; with
    checkpointing and short rows training needs less than that (8B on an H200: 18.8 GiB measured,
    18.3 of it that moment)."""
    shape = memory.model_shape(config.load(CONFIG_8B, []))
    small = memory.job_of(config.load(CONFIG_8B, ["train.gradient_checkpointing=true"]), 1, tokens=256, targets=64)
    dq = dataclasses.replace(small, dequantized=True)
    both = shape.params * 2 + shape.matrix_params * memory.NF4_BYTES
    assert memory.estimate(shape, dq)["allocated"] == pytest.approx(both)
    assert memory.estimate(shape, dataclasses.replace(small, method="lora"))["allocated"] < both - 2 * memory.GIB
    big = dataclasses.replace(dq, tokens=8192, targets=2048, checkpointing=False)
    assert memory.estimate(shape, big)["allocated"] > both  # training's own peak, the codes gone


def test_fsdp_is_refused_when_the_whole_model_cannot_load_onto_one_gpu():
    """FSDP shards after loading: each process first holds the whole model (fp32 for full)."""
    cfg = config.load(CONFIG_8B, ["train.method=full", "train.strategy=fsdp"])
    load = memory.load_gib(memory.model_shape(cfg), "full")
    assert 30 < load < 31  # 8.03 B fp32 weights and the CUDA context
    (problem,) = refusal(["train.method=full", "train.strategy=fsdp"], 8, 24)
    assert problem.startswith("memory: train.strategy=fsdp: each process loads the whole model") and "30." in problem
    assert refusal(["train.method=full", "train.strategy=fsdp"], 2, memory.DEFAULT_GPU_GIB) == []


def test_a_verdict_inside_the_plans_error_is_called_close():
    cfg = config.load(CONFIG_8B, ["train.method=full", "train.gradient_checkpointing=true"])
    shape = memory.model_shape(cfg)
    tight = ways.plan(cfg, shape, 1, memory.DEFAULT_GPU_GIB)  # 137.7 GiB on 139.8 (a run held it at 119.8 allocated)
    assert tight["margin"] == pytest.approx(137.71 / memory.DEFAULT_GPU_GIB - 1, abs=1e-3)
    assert plan.table(tight).splitlines()[-1].startswith("close: as configured it leaves 1% of the GPU free")
    assert plan.table(ways.plan(cfg, shape, 1, 130)).splitlines()[-1].startswith("close: as configured it needs 6% more than the GPU holds")
    far = ways.plan(config.load(CONFIG_8B, ["train.gradient_checkpointing=true"]), shape, 1, memory.DEFAULT_GPU_GIB)
    assert not plan.table(far).splitlines()[-1].startswith("close:")


@pytest.mark.parametrize("gib", [0.1, memory.CUDA_CONTEXT_GIB])
def test_a_gpu_smaller_than_the_cuda_context_is_blamed_on_the_context(gib, capsys):
    """Below the CUDA context every GPU count is too small, whatever the activations: the line says so."""
    tiny = config.load(ROOT / "configs" / "tiny.yaml")
    p = ways.plan(tiny, memory.model_shape(tiny), gpus=1, gpu_gib=gib)
    assert p["verdict"] == "does_not_fit" and p["options"][0]["activations"] < 0.05
    assert p["recommendation"] == (f"does not fit on 1 GPU of {gib:g} GiB: the CUDA context alone takes "
                                   f"{memory.CUDA_CONTEXT_GIB} GiB of each GPU (use GPUs with more memory)")
    assert "activations" not in p["recommendation"]
    just_above = ways.plan(tiny, memory.model_shape(tiny), gpus=1, gpu_gib=2 * memory.CUDA_CONTEXT_GIB)
    assert just_above["verdict"] == "ddp"
    assert cli.main(["plan", str(ROOT / "configs" / "tiny.yaml"), "--gpu-memory", str(gib)]) == 0
    assert "the CUDA context alone takes" in capsys.readouterr().out


def test_modules_trained_whole_count_in_the_plan_once_per_matrix():
    """lora.modules_to_save: each matrix trained whole adds its weights, gradients and AdamW states; a tied head and
    embedding are one matrix."""
    cfg = config.load(CONFIG_8B)
    shape = memory.model_shape(cfg)
    saved = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, modules_to_save=["lm_head", "embed_tokens"]))
    plain, both = ways.plan(cfg, shape, gpus=1), ways.plan(saved, shape, gpus=1)
    matrix = shape.vocab * shape.hidden
    assert both["trained_params"] - plain["trained_params"] == 2 * matrix  # Llama 3.1: head and embeddings apart
    extra = sum(both["options"][0][k] - plain["options"][0][k] for k in ("adapters", "gradients", "optimizer")) * memory.GIB
    assert extra == pytest.approx(2 * matrix * 16)  # fp32 weights, gradients and two AdamW states
    tied = dataclasses.replace(shape, tied=True)
    assert tied.saved_params(["lm_head", "embed_tokens"]) == tied.saved_params(["lm_head"]) == matrix


def test_plan_check_tells_the_peaks_its_constants_saw_from_those_they_did_not():
    """The band is in-sample; rows measured after the constants were last fitted are out of sample, and the
    predictions runs recorded when they ran are read back beside their peaks."""
    check = _plan_check()
    assert check.in_sample("h200_llama31_8b_qlora_v2.json") is True
    assert check.in_sample("h200_llama31_8b_qlora_epoch_2026-12-01.json") is True  # added by the fitting commit
    assert check.in_sample("h200_llama31_8b_qlora_epoch_2026-12-01b.json") is False
    recorded = check.recorded_predictions()
    assert len(recorded) == 4 and all(r["error"] > 0 for r in recorded)  # the plan without data: an upper bound
