"""The speed decider: what it chooses for the jobs it was calibrated on, and why; what a benchmark may force."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest

from conftest import ROOT, SHARED_DATA, field, words
from ddptune import batches, batchplan, card, config, memory, metrics, model as model_lib, reasons, speed
from ddptune.config import ConfigError

CONFIG_8B = ROOT / "configs" / "samsum_qlora_llama31_8b.yaml"


def shape(preset: str) -> memory.Shape:
    return memory.shape_of(model_lib.preset_config(preset, "sdpa"))


def samsum_like(parts: int = 1, seed: int = 0) -> speed.Work:
    """16 samples a step of 120-360 tokens, a quarter of them summary (SAMSum's sizes), one packed row per share."""
    rng = random.Random(seed)
    examples = [{"input_ids": [0] * (n := rng.randint(120, 360)), "labels": [-100] * (n - n // 4) + [1] * (n // 4)}
                for _ in range(818)]
    stream = batches.Stream(examples=examples, costs=[len(e["input_ids"]) for e in examples],
                            targets=[batches.target_tokens([e]) for e in examples], global_batch=16, parts=parts, seed=0,
                            packing=True, micro_batch_size=4, tokens_per_forward=8192, max_length=512)
    return speed.Work.of(stream)


def decide(overrides: list[str], free: float | None, work: speed.Work, preset: str = "llama-3.1-8b", world: int = 1,
           link: str = "", cuda: bool = True) -> speed.Speed:
    cfg = config.load(CONFIG_8B, [f"model.source=preset:{preset}", *overrides])
    return speed.decide(cfg=cfg, cuda=cuda, shape=shape(preset), world=world, free_gib=free, work=work, card=card.REFERENCE,
                        link=link)


def test_the_8b_qlora_job_on_an_h200_runs_without_checkpointing_on_a_dequantized_base():
    """Measured on an H200, 30 steps of 16: dequantized 0.209 s a step and 47.9 GiB, 4-bit 0.279 s and
    34.9 GiB, both without checkpointing; CUDA graphs bought 2 % on the 4-bit base."""
    chosen = decide([], 139.3, samsum_like())
    assert (chosen.checkpointing, chosen.dequantize, chosen.compiled) == (False, True, True)
    plain = next(o for o in chosen.estimate["options"] if (o["checkpointing"], o["dequantize"], o["graphs"]) == (False, True, "off"))
    assert 0.18 < plain["step_s"] < 0.28 and 40 < plain["memory_gib"] < 60
    assert set(chosen.reasons) == {"compiled layers", "gradient checkpointing", "4-bit base", "CUDA graphs",
                                   "DDP gradient buckets", "combined kernels"}


def test_each_reason_is_a_code_with_the_numbers_its_line_shows_and_the_record_words_the_same_lines():
    """The 8B QLoRA job's reasons: a code each, with the estimates of the options it compares; the
    record (summary.json's `speed`) holds codes and numbers, no words, and words the banner's lines again."""
    chosen = decide([], 139.3, samsum_like())
    options = {(o["checkpointing"], o["dequantize"], o["graphs"], o["lengths"]): o for o in chosen.estimate["options"]}
    mine, four_bit = options[(False, True, "off", 0)], options[(False, False, "off", 0)]
    recorded = [o for o in options.values() if o["graphs"] != "off" and o["memory_gib"] <= 139.3 * (1 - speed.MARGIN)]
    assert {name: r.as_dict() for name, r in chosen.reasons.items()} == {
        "compiled layers": {"code": "cuda"},
        "gradient checkpointing": {"code": "fits_without", "free_gib": 139.3,
                                   "memory_gib": min(o["memory_gib"] for o in options.values() if not o["checkpointing"])},
        "4-bit base": {"code": "dequantized_faster", "step_s": mine["step_s"], "other_step_s": four_bit["step_s"],
                       "memory_gib": mine["memory_gib"]},
        "CUDA graphs": {"code": "graphs_not_faster", "step_s": chosen.estimate["step_s"],
                        "other_step_s": min(o["step_s"] for o in recorded)},
        "DDP gradient buckets": {"code": "one_process"},
        "combined kernels": {"code": "launched_one_by_one"}}
    assert chosen.lines() == [reasons.render(name, r) for name, r in chosen.reasons.items()]
    for run in (chosen, chosen.unrecorded("recording the step failed")):
        record = json.loads(json.dumps(run.as_dict()))["reasons"]
        again = {name: reasons.Reason(code=r.pop("code"), numbers=r) for name, r in record.items()}
        assert again == run.reasons and [reasons.render(name, r) for name, r in again.items()] == run.lines()
        assert not any(line.split(": ", 1)[1] in json.dumps(record) for line in run.lines())  # no words in the record
    assert chosen.unrecorded("x").reasons["CUDA graphs"].as_dict() == {"code": "recording_failed", "why": "x"}
    assert reasons.FORCED_BY == speed.FORCE_ENV  # the words a forced choice names


def test_the_cards_own_figures_time_each_option_and_can_change_the_choice():
    """The card's measured figures scale the constants fitted on the reference card: a host that
    issues work 3x slower makes the 8B step the host issues 3x longer, so recording the step wins; a
    card that dequantizes at half the bandwidth adds the difference to every 4-bit option; the
    reference's own figures change nothing."""
    cfg = config.load(CONFIG_8B, [])
    options = lambda c: {(o["checkpointing"], o["dequantize"], o["graphs"], o["lengths"]): o  # noqa: E731
                         for o in c.estimate["options"]}
    made = lambda figures: speed.decide(cfg=cfg, cuda=True, shape=shape("llama-3.1-8b"), world=1, free_gib=139.3,  # noqa: E731
                                        work=samsum_like(), card=dataclasses.replace(card.REFERENCE, source="measured", **figures))
    ref, same = made({}), made({"name": "another card"})
    assert ref.graphs == "off" and ref.estimate["card"]["factors"] == same.estimate["card"]["factors"] == {
        "kernel": 1.0, "dequant": 1.0, "host": 1.0, "host_4bit": 1.0}
    assert options(same) == options(ref)
    slow_host = made({"host_op_s": 3 * card.REFERENCE.host_op_s})
    assert slow_host.graphs == "step" and slow_host.estimate["card"]["factors"]["host"] == pytest.approx(3.0)
    key = (False, True, "off", 0)
    host_s = 32 * speed.HOST_S_PER_LAYER  # one forward a step, each of 32 layers issued by the host
    assert options(ref)[key]["step_s"] >= host_s and options(slow_host)[key]["step_s"] == pytest.approx(3 * host_s)
    slow_dequant = made({"dequant_bytes_s": card.REFERENCE.dequant_bytes_s / 2})
    for k, o in options(slow_dequant).items():
        extra = 2 * shape("llama-3.1-8b").matrix_params * 2.5 / speed.DEQUANT_BYTES_S  # two passes, 2.5 bytes a weight
        if k[0] or k[1] or k[2] != "step":  # two passes; a dequantized base has nothing to dequantize; unrecorded steps are the host's
            continue
        assert o["step_s"] == pytest.approx(options(ref)[k]["step_s"] + extra, rel=1e-6), k


def test_a_card_is_measured_once_and_a_cpu_takes_the_reference():
    import torch

    assert speed.for_device(cfg=config.load(CONFIG_8B, []), shape=shape("llama-3.1-8b"), work=samsum_like(), world=1,
                            device=torch.device("cpu"), free_gib=None).estimate["card"] is None
    assert card.of(torch.device("cpu")) is card.REFERENCE


def test_kernels_are_combined_only_where_the_host_launches_them(monkeypatch):
    """Combo kernels cut launches, which only a step the host issues kernel by kernel pays for: not a
    recorded step, nor layers left uncompiled (a CPU run)."""
    plain = decide(["train.gradient_checkpointing=true"], 139.3, samsum_like())  # compiled layers, no graphs
    never = decide(["train.cuda_graphs=false"], 139.3, samsum_like())
    assert (plain.graphs, never.graphs) == ("off", "off") and plain.combo and never.combo
    recorded = decide(["train.method=lora"], 139.3, samsum_like(), preset="smollm2-135m")
    assert recorded.graphs == "step" and not recorded.combo
    cpu = decide(["train.method=lora"], None, samsum_like(), preset="tiny", cuda=False)
    assert not cpu.combo and not cpu.compiled
    monkeypatch.setenv(speed.FORCE_ENV, "combo=false")
    forced = decide(["train.cuda_graphs=false"], 139.3, samsum_like())
    assert forced.graphs == "off" and not forced.combo and forced.forced["combo"] is False


def test_a_smaller_gpu_turns_checkpointing_on_and_keeps_the_base_in_4_bits():
    chosen = decide([], 22.0, samsum_like())
    assert (chosen.checkpointing, chosen.dequantize) == (True, False)
    assert chosen.estimate["memory_gib"] < 22.0 * (1 - speed.MARGIN)


def test_a_small_model_records_the_whole_step_at_one_length():
    """SmolLM2-135M's shape: 0.152 s a step with compiled layers, 26.5 ms with the whole step recorded.
    Its step is bound by kernel latency, where padding costs nothing by the estimate: more lengths
    give no shorter a step, so the one that records least (one length, 21.7 s) wins."""
    chosen = decide(["train.method=lora"], 139.3, samsum_like(), preset="smollm2-135m")
    assert (chosen.graphs, chosen.lengths, len(chosen.sizes)) == ("step", 1, 1) and chosen.estimate["step_s"] < 0.03
    assert chosen.estimate["setup_s"] == pytest.approx(speed.LENGTH_S, abs=1.0)
    assert chosen.sizes[0] % batches.GRAPH_PAD == 0 and chosen.sizes[0] >= max(t for t, _ in samsum_like().rows)
    never = decide(["train.method=lora", "train.cuda_graphs=false"], 139.3, samsum_like(), preset="smollm2-135m")
    assert never.graphs == "off" and never.sizes == ()
    assert never.reasons["CUDA graphs"] == reasons.Reason(code="set_by_config", numbers={"graphs": "off", "lengths": 0, "setting": "false"})
    layers = decide(["train.method=lora", "train.optimizer=adamw_8bit"], 139.3, samsum_like(), preset="smollm2-135m")
    assert layers.graphs == "layers"  # an 8-bit optimizer's update cannot be recorded


def test_the_shortest_step_wins_and_set_up_only_breaks_ties():
    """8B QLoRA with checkpointing is bound by the GPU's FLOPs, where padding rows to recorded lengths
    costs more than the launches graphs save: the unpadded path has the shortest step and is chosen,
    however long the run. Of options within TIE of the shortest step, the least set-up wins."""
    for overrides, free in ((["train.gradient_checkpointing=true"], 139.3), ([], 139.3), ([], 22.0),
                            (["train.method=lora"], 139.3)):
        for preset in ("llama-3.1-8b", "smollm2-135m"):
            chosen = decide(overrides, free, samsum_like(), preset=preset)
            fits = [o for o in chosen.estimate["options"] if o["memory_gib"] <= free * (1 - speed.MARGIN)]
            quickest = min(o["step_s"] for o in fits)
            assert chosen.estimate["step_s"] <= quickest * (1 + speed.TIE)
            assert chosen.estimate["setup_s"] == min(o["setup_s"] for o in fits if o["step_s"] <= quickest * (1 + speed.TIE))
    long = decide(["train.gradient_checkpointing=true"], 139.3, samsum_like())
    assert long.graphs == "off" and long.estimate["setup_s"] == speed.DYNAMIC_COMPILE_S


def test_a_benchmark_cannot_force_a_job_length(monkeypatch):
    """The choices do not depend on the run's length, so DDPTUNE_SPEED has no job length to set."""
    for job in ("samples=14736", "epochs=18", "samples=0"):
        monkeypatch.setenv(speed.FORCE_ENV, job)
        with pytest.raises(ConfigError):
            speed.forced()


@pytest.fixture(scope="module")
def byte_tok():
    return model_lib.byte_tokenizer()


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_each_config_runs_one_program_at_every_length_and_process_count(name, byte_tok):
    """For each shipped config on an H100 (79 GiB free, 989 TFLOP/s), with its own data (SAMSum's
    validation rows for the 8B config's hub SAMSum): the choices for a 30-step trial, one epoch and
    three epochs are one program, and so are those at 1 and 2 processes with the same batch a
    process, apart from DDP's buckets. The work is sampled as a run samples it (speed.stream_of)."""
    from ddptune.data import tokenized

    data = [f"data.train={SHARED_DATA / 'samsum_validation.json'}", "data.val=null"] if "8b" in name else []
    preset = "llama-3.1-8b" if "8b" in name else "smollm2-135m"
    programs, buckets = {}, {}
    for key, extra, world in (("trial", ["train.max_steps=30"], 1), ("epoch", ["train.epochs=1", "train.max_steps=null"], 1),
                              ("three", ["train.epochs=3", "train.max_steps=null"], 1), ("n2", ["train.max_steps=30"], 2)):
        cfg = config.load(ROOT / "configs" / name, [*data, "train.effective_batch_size=null", "train.micro_batch_size=4",
                                                    "train.grad_accum=2", *extra])
        train_set, _ = tokenized.load(tokenized.prepare(cfg.data, byte_tok))
        flops = metrics.FlopModel.of_shape(shape(preset), cfg.train.method, cfg.lora.r, list(cfg.lora.target_modules))
        stream = speed.stream_of(cfg, train_set, flops, world, batchplan.batch_plan(cfg.train, world).global_batch)
        chosen = speed.decide(cfg=cfg, cuda=True, shape=shape(preset), world=world, free_gib=79.1, work=speed.Work.of(stream),
                              card=dataclasses.replace(card.REFERENCE, matrix_tflops=989.0), link="NVLink")
        programs[key], buckets[key] = _program(chosen), chosen.bucket_mb
    assert programs["trial"] == programs["epoch"] == programs["three"], programs
    assert programs["n2"][:-1] == programs["trial"][:-1]  # memory apart: DDP's gradient buckets
    assert buckets["trial"] is None and buckets["n2"] is not None  # LoRA's gradients in one bucket over NVLink


def _program(chosen: speed.Speed) -> tuple:
    return (chosen.compiled, chosen.graphs, chosen.lengths, chosen.sizes, chosen.checkpointing, chosen.dequantize,
            chosen.combo, chosen.estimate["step_s"], chosen.estimate["memory_gib"])


def test_a_cpu_run_compiles_nothing_records_nothing_and_checkpoints_nothing():
    chosen = decide(["train.method=lora"], None, samsum_like(), preset="tiny", cuda=False)
    assert (chosen.compiled, chosen.graphs, chosen.checkpointing, chosen.dequantize) == (False, "off", False, False)
    assert chosen.bucket_mb is None


def test_a_cpu_process_checkpoints_only_where_its_share_of_host_memory_is_short():
    """On a CPU the budget is the process's share of the host's available memory, fp32 weights and
    activations counted (SmolLM2-135M LoRA, 16 samples a step in one packed row of about 3,800 tokens:
    about 11 GiB without checkpointing, 3.6 with); checkpointing costs a forward, so it is chosen only
    where the run would not fit."""
    work = samsum_like()
    roomy = decide(["train.method=lora"], 20.0, work, preset="smollm2-135m", cuda=False)
    tight = decide(["train.method=lora"], 5.0, work, preset="smollm2-135m", cuda=False)
    assert (roomy.checkpointing, tight.checkpointing) == (False, True)
    without = [o["memory_gib"] for o in tight.estimate["options"] if not o["checkpointing"]]
    assert tight.estimate["memory_gib"] <= 5.0 * (1 - speed.MARGIN) < min(without) < 20.0 * (1 - speed.MARGIN)
    assert 9.0 < min(without) < 13.0 and 3.0 < tight.estimate["memory_gib"] < 4.0
    gpu = decide(["train.method=lora"], 20.0, work, preset="smollm2-135m")
    assert gpu.estimate["options"][0]["memory_gib"] < min(without)  # bf16 on the GPU: half the bytes


def test_one_bucket_on_nvlink_and_torchs_buckets_elsewhere():
    work = samsum_like(parts=2)
    nvlink = decide([], 139.3, work, world=2, link="NVLink")
    assert nvlink.bucket_mb == 161  # LoRA r=16 on 8B: 160 MiB of fp32 gradients, all in one
    assert decide([], 139.3, work, world=2, link="PCIe").bucket_mb is None
    assert decide([], 139.3, samsum_like(), world=1, link="NVLink").bucket_mb is None


def test_a_benchmark_forces_choices_through_one_variable(monkeypatch):
    monkeypatch.setenv(speed.FORCE_ENV, "graphs=step,lengths=4,checkpointing=true,dequantize=false,bucket_mb=64")
    chosen = decide([], 139.3, samsum_like(), world=2)
    assert (chosen.graphs, chosen.lengths, chosen.checkpointing, chosen.dequantize, chosen.bucket_mb) == ("step", 4, True, False, 64)
    assert chosen.forced == {"graphs": "step", "lengths": 4, "checkpointing": True, "dequantize": False, "bucket_mb": 64.0}
    for bad in ("graphs=sometimes", "lengths=0", "speedy=true", "bucket_mb=nan"):
        monkeypatch.setenv(speed.FORCE_ENV, bad)
        with pytest.raises(ConfigError):
            speed.forced()
    monkeypatch.setenv(speed.FORCE_ENV, "graphs=step")
    with pytest.raises(ConfigError):  # no CUDA device to record on
        decide(["train.method=lora"], None, samsum_like(), preset="tiny", cuda=False)


def test_fsdp_qlora_keeps_its_base_4_bit_and_checkpoints_where_the_sharded_run_needs_it(monkeypatch):
    """70B over two 48 GiB GPUs: the decider costs the sharded 4-bit base (plan's estimate), never a
    dequantized one (it would be dequantized whole on every GPU before sharding), and turns
    checkpointing on because without it the activations do not fit. 8B over one process: the
    whole 4-bit base plus FSDP's gathered copies, checkpointing off on an H200."""
    work = samsum_like(parts=2)
    big = decide(["train.strategy=fsdp"], 47.0, work, preset="llama-3.1-70b", world=2)
    assert (big.checkpointing, big.dequantize, big.graphs) == (True, False, "off")
    assert big.reasons["4-bit base"].code == "fsdp_shards_4bit"
    assert {o["dequantize"] for o in big.estimate["options"]} == {False}
    assert 24 < big.estimate["memory_gib"] < 47 * (1 - speed.MARGIN)
    assert min(o["memory_gib"] for o in big.estimate["options"] if not o["checkpointing"]) > 47
    one = decide(["train.strategy=fsdp"], 139.3, samsum_like(), world=1)
    ddp = decide(["train.strategy=ddp"], 22.0, samsum_like(), world=1)  # the 4-bit base with DDP
    assert (one.checkpointing, one.dequantize) == (False, False)
    ddp_4bit = next(o for o in ddp.estimate["options"] if not o["dequantize"] and not o["checkpointing"] and o["graphs"] == "off")
    assert one.estimate["memory_gib"] - ddp_4bit["memory_gib"] == pytest.approx(
        (2 * 0.5 * shape("llama-3.1-8b").layer_params + shape("llama-3.1-8b").other_params * 2) * (1 + memory.ALLOCATOR_SLACK)
        / memory.GIB, rel=1e-6)
    monkeypatch.setenv(speed.FORCE_ENV, "dequantize=true")
    with pytest.raises(ConfigError) as e:
        decide(["train.strategy=fsdp"], 139.3, work, world=2)
    (line,) = e.value.problems  # the forced choice, and the strategy it needs
    assert field(line) == speed.FORCE_ENV and {"dequantize=true", "train.strategy=ddp"} <= words(line), line
