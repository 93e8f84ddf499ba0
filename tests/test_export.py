"""`ddptune export`: the merged model loads with plain transformers and gives the adapter model's
logits; the plain adapter export loads onto a base built as its README says; bad input is refused."""
from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

import conftest
from conftest import ROOT, field, words
from ddptune import cli, config, model as model_lib, train

TINY = str(ROOT / "configs" / "tiny.yaml")
CPU = torch.device("cpu")


def train_run(out, *overrides, source=TINY, keep=False):
    """A finished run, trained in this process (warm-up off: the adapter moves at once); with
    `keep`, also the trained model, as the run left it in memory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DDPTUNE_CACHE", str(out.parent / "cache"))
        _, net = train.run(config.load(source, [f"output_dir={out}", "train.max_steps=2", "train.warmup_steps=0",
                                                "data.val=null", *overrides]))
    return (out, net.eval()) if keep else out


# a checkpoint each step, a validation set and an evaluation (2 rows): every kind of file a run writes
EVERY_FILE = ["train.save_every=1", "data.val=demo", "data.val_rows=560:562", "eval.enabled=true", "eval.max_samples=2",
              "eval.max_new_tokens=4"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A finished LoRA run that wrote every kind of file a run writes, under umask 022; it keeps
    its checkpoints, as a run killed right after saving its final weights does."""
    with conftest.umask(0o022), conftest.checkpoints_kept():
        return train_run(tmp_path_factory.mktemp("export") / "run", *EVERY_FILE)


def logits(net, ids):
    with torch.no_grad():
        return net(input_ids=ids).logits.float()


def trained(run):
    cfg = config.load(run / "config.yaml")
    return model_lib.load_trained(run, cfg.model, cfg.train.method, CPU, cfg.train.precision, cfg.train.seed)


def export(*args):
    assert cli.main(["export", *map(str, args)]) == 0


IDS = torch.tensor([list(b"Anna: are you coming tonight?\nTom: yes, at 8.")])


def test_merged_model_loads_with_plain_transformers_and_gives_the_adapter_logits(lora_run, tmp_path):
    out = tmp_path / "merged"
    export(lora_run, out, "--merge")
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md"} <= {
        p.name for p in out.iterdir()}
    assert not (out / "adapter_config.json").exists()
    assert "varlen" not in (out / "config.json").read_text()  # ddptune's kernel is unknown to plain transformers
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert type(merged).__name__ == "LlamaForCausalLM" and merged.dtype == torch.float32  # a CPU run: fp32
    adapted = trained(lora_run)
    want = logits(adapted, IDS)
    assert torch.allclose(logits(merged, IDS), want, atol=1e-5)
    with adapted.disable_adapter():  # the adapter moved the model: the check above is not base == base
        assert (logits(adapted, IDS) - want).abs().max() > 1e-3
    text = "Tom: yes, at 8."
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == model_lib.byte_tokenizer()(text)["input_ids"]

    half = tmp_path / "bf16"
    export(lora_run, half, "--merge", "--dtype", "bf16")
    small = AutoModelForCausalLM.from_pretrained(half)
    assert small.dtype == torch.bfloat16
    size = lambda d: (d / "model.safetensors").stat().st_size  # noqa: E731
    assert size(half) < 0.52 * size(out)
    assert torch.allclose(logits(small, IDS), want, atol=0.05)  # bf16 weights


def test_adapter_export_names_the_source_and_loads_onto_the_base(lora_run, tmp_path):
    out = tmp_path / "adapter"
    export(lora_run, out)
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == "preset:tiny"
    readme = (out / "README.md").read_text()
    assert "build_preset('tiny', seed=0" in readme and "### Summary:" in readme
    base = model_lib.build_preset("tiny", seed=0, dtype=torch.float32, device=CPU)  # as README.md says
    net = PeftModel.from_pretrained(base, out)
    assert torch.equal(logits(net, IDS), logits(trained(lora_run), IDS))
    assert (out / "tokenizer.json").is_file()


def test_what_runs_and_exports_write_is_readable_by_others(lora_run, tmp_path):
    """Under umask 022 every file a run, an export and the cache hold is readable by others, every
    folder readable and searchable: temporary folders (mkdtemp: 0700) and safetensors' files (0600)
    get plain permissions before they are renamed into place."""
    with conftest.umask(0o022):
        export(lora_run, tmp_path / "adapter")
        export(lora_run, tmp_path / "merged", "--merge")
        preset = model_lib.preset_folder("tiny", 0, cache_dir=tmp_path / "cache")  # what a QLoRA run of a preset loads
    assert {"checkpoints", "adapter", "eval", "eval-base", "summary.json"} <= {p.name for p in lora_run.iterdir()}
    assert list((lora_run / "checkpoints").glob("step-*/weights.safetensors"))
    for folder in (lora_run, lora_run.parent / "cache", tmp_path / "adapter", tmp_path / "merged", preset):
        assert conftest.unreadable(folder) == [], folder


def test_the_runs_model_card_names_its_base_by_hub_id_or_not_at_all(lora_run, tmp_path):
    """peft's card in adapter/ took its base_model from the folder the base loaded from: a GGUF
    source's conversion in the cache, '' for a preset. Its front matter holds a hub id or no base,
    and its text names the source."""
    import shutil

    from huggingface_hub import ModelCard

    from ddptune import saving
    from test_gguf_cache import tiny_gguf

    gguf = str(tiny_gguf(tmp_path / "tiny.gguf"))
    run = train_run(tmp_path / "run", f"model.source={gguf}", "train.max_steps=1", "data.max_length=64")
    for card_path, source in ((run / "adapter" / "README.md", gguf), (lora_run / "adapter" / "README.md", "preset:tiny")):
        card = ModelCard.load(card_path)
        assert card.data.library_name == "peft" and "base_model" not in card.data.to_dict(), card.data
        assert not any(t.startswith("base_model") for t in card.data.tags) and card.text.count(f"`{source}`") == 1
    hub = "HuggingFaceTB/SmolLM2-135M-Instruct"
    path = shutil.copy(run / "adapter" / "README.md", tmp_path / "README.md")
    saving.name_the_base(path, config.ModelConfig(source=hub), "lora")
    card = ModelCard.load(path)
    assert card.data.base_model == hub and [t for t in card.data.tags if t.startswith("base_model")] == [f"base_model:adapter:{hub}"]


def test_qlora_is_merged_into_its_dequantized_base(tmp_path):
    run = train_run(tmp_path / "run", "train.method=qlora")
    out = tmp_path / "merged"
    export(run, out, "--merge")
    conf = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in conf
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any(p.dtype == torch.uint8 for p in merged.parameters())
    cfg = config.load(run / "config.yaml")
    dequantized = model_lib.load_trained(run, cfg.model, "qlora", CPU, "auto", 0, dequantize=True)
    assert torch.allclose(logits(merged, IDS), logits(dequantized, IDS), atol=1e-5)
    # against the 4-bit model itself: bitsandbytes' CPU kernel rounds differently, within bf16 tolerance
    assert torch.allclose(logits(merged, IDS), logits(trained(run), IDS), atol=2e-2)
    # the GGUF export merges the same way: its bf16 file holds the merged matrices rounded to bf16
    export(run, tmp_path / "gguf", "--format", "gguf")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "gguf", gguf_file="model-bf16.gguf", dtype=torch.float32)
    with torch.no_grad():
        for p in merged.parameters():
            p.copy_(p.to(torch.bfloat16).float()) if p.dim() == 2 else None
    assert torch.equal(logits(back, IDS), logits(merged, IDS))


def test_dequantizing_frees_the_4_bit_codes_at_once():
    """transformers' dequantize leaves the replaced 4-bit modules in reference cycles. Training runs
    with Python's collector off and freezes what lives after its first step, so uncollected they
    held 8B's 4-bit codes (3.4 GiB of an H200) all run beside the bf16 weights."""
    import bitsandbytes as bnb

    base = model_lib.load_model(config.ModelConfig(source="preset:tiny"), "qlora", CPU, "auto", 0)
    codes = [weakref.ref(m.weight) for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(codes) == 14  # 7 projections in each of the tiny preset's 2 layers
    gc.disable()  # as in the training loop: nothing is collected unless asked
    try:
        base = model_lib.dequantize_base(base, "auto", CPU)
        assert sum(ref() is not None for ref in codes) == 0
    finally:
        gc.enable()
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in base.modules())


def test_a_full_fine_tune_exports_its_full_model(tmp_path, capsys):
    run = train_run(tmp_path / "run", "train.method=full", "train.lr=1e-3")
    out = tmp_path / "full"
    export(run, out)  # no --merge needed: there is no adapter
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert torch.allclose(logits(merged, IDS), logits(trained(run), IDS), atol=1e-6)
    for name, content in (("model/model.safetensors", lambda old: b"\0" * 10), ("model/config.json", lambda old: b"{not json"),
                          ("model/tokenizer.json", lambda old: b"{not json")):
        copy, damaged = damaged_copy(run, tmp_path / name.replace("/", "-"), name, content)
        assert cli.main(["export", str(copy), str(tmp_path / "again")]) == 2
        assert f"export: {damaged} " in capsys.readouterr().err and not (tmp_path / "again").exists()


def test_bad_input_is_refused_with_one_line_and_nothing_overwritten(lora_run, tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert cli.main(["export", str(lora_run), str(full), "--merge"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and field(err) == "OUT" and str(full) in words(err), err  # the folder that holds files
    assert [p.name for p in full.iterdir()] == ["keep.txt"] and (full / "keep.txt").read_text() == "mine"
    assert cli.main(["export", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()  # the run folder that is not there, and no file in it
    assert field(err) == "export" and str(tmp_path / "nowhere") in words(err) and "config.yaml" not in words(err), err
    assert not (tmp_path / "x").exists()
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text((lora_run / "config.yaml").read_text())
    assert cli.main(["export", str(unfinished), str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err.strip()  # the run's adapter folder, the one missing
    assert err.count("\n") == 0 and field(err) == "export" and str(unfinished / "adapter") in words(err), err
    assert not (tmp_path / "y").exists()
    assert cli.main(["export", str(lora_run), str(tmp_path / "z"), "--dtype", "fp16"]) == 2
    capsys.readouterr()
    # an adapter is copied as trained: a dtype for it would be silently ignored
    assert cli.main(["export", str(lora_run), str(tmp_path / "adapter16"), "--dtype", "bf16"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == "ddptune: invalid config: --dtype: only with --merge (an adapter is copied as trained)"
    assert not (tmp_path / "adapter16").exists()
    assert not list(tmp_path.glob(".*tmp-*"))  # no half-written folder left behind


DORA = ["lora.use_dora=true", "lora.use_rslora=true", "train.max_steps=4", "train.micro_batch_size=2", "train.lr=1e-2",
        "train.warmup_steps=0", "lora.dropout=0.0", "data.val=null"]


def test_dora_with_rslora_takes_one_process_steps_on_two_resumes_and_merges(tmp_path):
    """DoRA and rsLoRA are peft's: two gloo processes take the steps one process takes accumulating
    both shares (losses, gradient norms, every adapter weight, DoRA's magnitudes among them); a run
    that died after its step-2 checkpoint resumes to the unbroken run's weights; the merged export
    gives the adapter's logits."""
    import multiproc
    from safetensors.torch import load_file
    from test_train import assert_ended_as, died_after, losses, train_all

    one, two = tmp_path / "one", tmp_path / "two"
    saving = ["train.save_every=2", "train.keep_checkpoints=5"]
    multiproc.run(train_all, 1, [[f"output_dir={one}", "train.grad_accum=2", *saving, *DORA]])
    multiproc.run(train_all, 2, [[f"output_dir={two}", "train.grad_accum=1", *DORA]])
    assert len(losses(one)) == 4 and losses(two) == pytest.approx(losses(one), abs=1e-5)
    norms = lambda run: [r["grad_norm"] for r in conftest.metrics(run) if "grad_norm" in r]  # noqa: E731
    assert norms(two) == pytest.approx(norms(one), rel=1e-4, abs=1e-6)
    wa, wb = (load_file(r / "adapter" / "adapter_model.safetensors") for r in (one, two))
    assert wa.keys() == wb.keys() and sum("lora_magnitude_vector" in k for k in wa) == 14  # 7 projections x 2 layers
    # Adam moves a weight whose gradient is near 0 by lr * m / sqrt(v): the two processes' summation order moves
    # such elements by up to a few 1e-5 (0.4 % of one step of lr 1e-2); every other element agrees to 1e-5. Seen:
    # one element by 2.1e-5; with torch 2.13's CPU build, two (4.1e-5 and 1.1e-5) of the adapter's elements
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4
    assert sum(int(((wa[k] - wb[k]).abs() > 1e-5).sum()) for k in wa) <= 3
    conf = json.loads((one / "adapter" / "adapter_config.json").read_text())
    assert conf["use_dora"] is True and conf["use_rslora"] is True

    part = died_after(one, tmp_path / "part", checkpoint_step=2, metric_lines=2)
    train.run(config.load(TINY, [f"output_dir={part}", "train.grad_accum=2", *saving, *DORA]), resume=True)
    assert_ended_as(one, part, loss_tol=1e-6, weight_tol=1e-6)

    adapted = trained(one)
    assert adapted.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == pytest.approx(16 / 8 ** 0.5)
    export(one, tmp_path / "merged", "--merge")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    want = logits(adapted, IDS)
    assert torch.allclose(logits(merged, IDS), want, atol=1e-5)
    with adapted.disable_adapter():
        assert (logits(adapted, IDS) - want).abs().max() > 1e-3


def empty_safetensors() -> bytes:
    from safetensors.torch import save

    return save({})


def edited(change):
    """The adapter_config.json it is given, with `change(config)` applied."""
    return lambda old: json.dumps(change(json.loads(old))).encode()


# (id, file of the run, what it is replaced by, from its bytes): each a run whose trained files were damaged after it finished
DAMAGED = [
    ("torn weights", "adapter/adapter_model.safetensors", lambda old: b"\0" * 10),
    ("a weights header claiming 2**60 bytes", "adapter/adapter_model.safetensors",
     lambda old: (2**60).to_bytes(8, "little") + b"{}"),
    ("weights without a tensor", "adapter/adapter_model.safetensors", lambda old: empty_safetensors()),
    ("weights cut short", "adapter/adapter_model.safetensors", lambda old: old[: len(old) // 2]),
    ("adapter_config.json not JSON", "adapter/adapter_config.json", lambda old: b'{"r": 8, '),
    ("adapter_config.json a list", "adapter/adapter_config.json", lambda old: b"[]"),
    ("adapter_config.json without r", "adapter/adapter_config.json",
     lambda old: json.dumps({"peft_type": "LORA", "lora_alpha": 16, "target_modules": ["q_proj"]}).encode()),
    # a config that holds but does not describe the tensors beside it: peft's load fails on "size mismatch" or
    # skips what it does not expect
    ("r unlike the tensors'", "adapter/adapter_config.json", edited(lambda c: {**c, "r": 4})),
    ("an adapted module not among the targets", "adapter/adapter_config.json",
     edited(lambda c: {**c, "target_modules": c["target_modules"][1:]})),
    ("a target without an adapter", "adapter/adapter_config.json",
     edited(lambda c: {**c, "target_modules": [*c["target_modules"], "lm_head"]})),
    ("use_dora without DoRA's magnitudes", "adapter/adapter_config.json", edited(lambda c: {**c, "use_dora": True})),
    ("tokenizer.json not JSON", "adapter/tokenizer.json", lambda old: b"\x00garbage"),
    ("tokenizer.json without a model", "adapter/tokenizer.json", lambda old: b"{}"),
    ("tokenizer_config.json not JSON", "adapter/tokenizer_config.json", lambda old: old[:-3]),
]


def damaged_copy(run, tmp_path, name: str, content) -> tuple:
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    path = copy / name
    path.write_bytes(content(path.read_bytes()))
    return copy, path


@pytest.mark.parametrize("name, content", [c[1:] for c in DAMAGED], ids=[c[0] for c in DAMAGED])
def test_a_damaged_adapter_is_refused_before_anything_is_written(lora_run, tmp_path, capsys, name, content):
    run, damaged = damaged_copy(lora_run, tmp_path, name, content)
    for extra in ([], ["--merge"], ["--format", "gguf"]):
        out = tmp_path / "out"
        assert cli.main(["export", str(run), str(out), *extra]) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"ddptune: invalid config: export: {damaged} "), err
        assert not out.exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("case", ["r unlike the tensors'", "tokenizer.json not JSON"])
def test_predict_and_eval_refuse_a_damaged_adapter_by_the_same_check(lora_run, tmp_path, capsys, case):
    name, content = next(c[1:] for c in DAMAGED if c[0] == case)
    run, damaged = damaged_copy(lora_run, tmp_path, name, content)
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"dialogue": "Ann: lunch at 1?\nBo: sure"}) + "\n")
    for argv, out in ((["predict", run, rows, "--out", tmp_path / "p.jsonl"], tmp_path / "p.jsonl"),
                      (["eval", run, "--out", tmp_path / "eval"], tmp_path / "eval")):
        assert cli.main([*map(str, argv)]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"ddptune: invalid config: {argv[0]}: {damaged} "), err
        assert not out.exists()


SAVED = ["lora.modules_to_save=[lm_head, embed_tokens]", "train.max_steps=3", "train.micro_batch_size=2", "lora.dropout=0.0",
         "data.val=null"]


def test_modules_to_save_are_trained_whole_under_ddp_and_fsdp_saved_and_merged(tmp_path):
    """lora.modules_to_save (peft's): the head and the embeddings are trained whole beside the adapters, taking
    one process's steps under DDP and FSDP over two processes; the adapter holds them, and the merged export
    gives the adapter's logits."""
    import multiproc
    from safetensors.torch import load_file
    from test_train import losses, train_all

    one, ddp, fsdp = tmp_path / "one", tmp_path / "ddp", tmp_path / "fsdp"
    multiproc.run(train_all, 1, [[f"output_dir={one}", "train.grad_accum=2", *SAVED]])
    multiproc.run(train_all, 2, [[f"output_dir={ddp}", "train.grad_accum=1", *SAVED],
                                 [f"output_dir={fsdp}", "train.grad_accum=1", "train.strategy=fsdp", *SAVED]])
    assert len(losses(one)) == 3 and losses(ddp) == pytest.approx(losses(one), abs=1e-5)
    assert losses(fsdp) == pytest.approx(losses(one), abs=1e-5)
    base = model_lib.build_preset("tiny", 0, torch.float32, CPU)
    for run in (one, ddp, fsdp):
        saved = load_file(run / "adapter" / "adapter_model.safetensors")
        assert json.loads((run / "adapter" / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head", "embed_tokens"]
        for key, weight in (("lm_head", base.lm_head.weight), ("model.embed_tokens", base.model.embed_tokens.weight)):
            trained_whole = saved[f"base_model.model.{key}.weight"]
            assert trained_whole.shape == weight.shape and (trained_whole - weight).abs().max() > 1e-3, (run.name, key)
            assert torch.allclose(trained_whole, load_file(one / "adapter" / "adapter_model.safetensors")[f"base_model.model.{key}.weight"],
                                  atol=1e-5), (run.name, key)
    adapted = trained(fsdp)
    export(fsdp, tmp_path / "merged", "--merge")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    want = logits(adapted, IDS)
    assert torch.allclose(logits(merged, IDS), want, atol=1e-5)
    assert torch.equal(merged.lm_head.weight, load_file(fsdp / "adapter" / "adapter_model.safetensors")["base_model.model.lm_head.weight"])


def test_a_tied_head_and_embedding_trained_whole_stay_one_matrix_through_save_and_merge(tmp_path):
    """SmolLM2 ties its head to its embeddings: lora.modules_to_save=[lm_head] trains that one matrix (peft's
    ensure_weight_tying), and the merged model, saved and loaded again, still holds the trained one in both places."""
    from ddptune.config import LoraConfig

    arch = model_lib.preset_config("tiny", "sdpa")
    arch.tie_word_embeddings = True
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(arch)
    base.save_pretrained(tmp_path / "base")
    net = model_lib.add_adapters(base, "lora", LoraConfig(r=4, modules_to_save=["lm_head"]), False)
    trained_whole = [p for n, p in net.named_parameters() if p.requires_grad and "lora_" not in n]
    assert len(trained_whole) == 1 and trained_whole[0].shape == (arch.vocab_size, arch.hidden_size)
    with torch.no_grad():
        trained_whole[0].add_(0.5)
    want = logits(net, IDS)
    model_lib.save_trained(net, tmp_path / "adapter")
    again = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    assert torch.allclose(logits(again, IDS), want, atol=1e-5)
    again.merge_and_unload().save_pretrained(tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(logits(merged, IDS), want, atol=1e-5)
    assert torch.equal(merged.lm_head.weight, merged.model.embed_tokens.weight)
