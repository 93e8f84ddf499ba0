"""A GGUF source is converted once into a plain folder in the cache, and loads from it with the values
transformers gives when it reads the GGUF file itself; a damaged conversion is converted again, and a
cache that cannot be written is refused in one line."""
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import conftest
from ddptune import config, memory, model as model_lib, sources

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"


@pytest.fixture
def parsed_and_mapped_once():
    """conftest's gguf_parsed_once with gguf's tensor-name map built once too: transformers' loader builds
    it again for each of a model's modules, and the test below loads SmolLM2 from its GGUF file twice."""
    with conftest.gguf_parsed_once(name_map=True) as readers:
        yield readers


def test_a_gguf_model_and_tokenizer_load_from_their_converted_folders_with_the_files_values(tmp_path, monkeypatch,
                                                                                           parsed_and_mapped_once):
    monkeypatch.setenv("DDPTUNE_CACHE", str(tmp_path / "cache"))
    m = config.load(DEMO, []).model
    src = sources.resolve_source(m)
    net = model_lib.load_model(m, "lora", torch.device("cpu"), "fp32", 0)
    tok = model_lib.load_tokenizer(m)
    folder = model_lib.gguf_folder(src, "model", build=False)
    assert folder is not None and "quantization_config" not in (folder / "config.json").read_text()
    assert list(folder.parent.glob(".*")) == []  # no temporary folder left beside the converted ones

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF file was read again")

    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", refuse)
    again = model_lib.load_model(m, "lora", torch.device("cpu"), "bf16", 0)  # from the folder alone
    assert memory.model_shape(config.load(DEMO, [])).vocab == 49152
    monkeypatch.undo()

    ref = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch.float32)
    ref_tok = AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file)
    mine, theirs = net.state_dict(), ref.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert net.lm_head.weight.data_ptr() == net.model.embed_tokens.weight.data_ptr()  # still tied
    assert again.dtype == torch.bfloat16 and torch.equal(again.lm_head.weight, theirs["lm_head.weight"].bfloat16())
    for text in ("Anna: are you coming tonight?\nTom: yes, at 8. <|im_end|> café 🎂", "  two  spaces\t\ttabs\n\n"):
        assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert tok.apply_chat_template(chat, tokenize=False) == ref_tok.apply_chat_template(chat, tokenize=False)
    # the special tokens are the file header's (what llama.cpp uses), whatever transformers' version reads
    header = model_lib.gguf_special_tokens(Path(src.path) / src.gguf_file)
    assert header == {"bos_token": 1, "eos_token": 2, "pad_token": 2}  # SmolLM2: <|im_start|>, <|im_end|>, <|im_end|>
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)

    # a changed file is another key: its folder is not the old one, and none is made without asking
    copy = tmp_path / "pkg" / src.gguf_file
    copy.parent.mkdir()
    shutil.copy(Path(src.path) / src.gguf_file, copy)
    os.utime(copy, ns=(1, 1))
    moved = sources.Source("gguf", str(copy.parent), copy.name)
    assert model_lib.gguf_folder(moved, "model", build=False) is None


def test_a_folder_is_written_whole_or_not_at_all(tmp_path):
    target = tmp_path / "c" / "thing"

    def fails(tmp):
        (tmp / "half").write_text("x")
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError):
        model_lib._written_once(target, fails)
    assert not target.exists() and list(target.parent.iterdir()) == []

    def loses_the_race(tmp):  # another process renamed its folder into place meanwhile
        (tmp / "mine").write_text("mine")
        target.mkdir()
        (target / "theirs").write_text("theirs")

    assert model_lib._written_once(target, loses_the_race) == target
    assert sorted(p.name for p in target.iterdir()) == ["theirs"] and list(target.parent.iterdir()) == [target]
    assert model_lib._written_once(tmp_path / "d", lambda tmp: (tmp / "f").write_text("1")).joinpath("f").read_text() == "1"


def tiny_gguf(path: Path) -> Path:
    """A 2-layer Llama of width 16 with a 23-token byte-level BPE vocabulary, in float32, written as a
    GGUF file (transformers converts it in about a second; SmolLM2's takes 20 s of a 2-core CPU)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    d, ff, heads, kv = 16, 32, 2, 1
    tokens = ["<unk>", "<s>", "</s>", *"abcdehilnorst ", "Ġ", "ab", "cd", "he", "ll", "lo", "ĠĠ"]
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_context_length, 64), (w.add_embedding_length, d), (w.add_block_count, 2),
                       (w.add_feed_forward_length, ff), (w.add_head_count, heads), (w.add_head_count_kv, kv),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0), (w.add_vocab_size, len(tokens)),
                       (w.add_rope_dimension_count, d // heads), (w.add_tokenizer_model, "gpt2"), (w.add_tokenizer_pre, "default"),
                       (w.add_token_list, tokens), (w.add_token_types, [3, 3, 3] + [1] * (len(tokens) - 3)),
                       (w.add_token_merges, ["a b", "c d", "h e", "l l", "l o", "Ġ Ġ"]), (w.add_bos_token_id, 1),
                       (w.add_eos_token_id, 2), (w.add_unk_token_id, 0), (w.add_pad_token_id, 2)):
        add(value)
    shapes = {"token_embd": (len(tokens), d), "output_norm": (d,), "output": (len(tokens), d)}
    for i in range(2):
        shapes |= {f"blk.{i}.{name}": shape for name, shape in (
            ("attn_norm", (d,)), ("ffn_norm", (d,)), ("attn_q", (d, d)), ("attn_k", (kv * d // heads, d)),
            ("attn_v", (kv * d // heads, d)), ("attn_output", (d, d)), ("ffn_gate", (ff, d)), ("ffn_up", (ff, d)),
            ("ffn_down", (d, ff)))}
    for name, shape in shapes.items():
        w.add_tensor(f"{name}.weight", (rng.standard_normal(shape) * 0.1).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A tiny GGUF model (its ModelConfig) and a cache of its own."""
    monkeypatch.setenv("DDPTUNE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "pkg").mkdir()
    return config.ModelConfig(source=str(tiny_gguf(tmp_path / "pkg" / "tiny.gguf")))


def converted(m, part: str) -> Path:
    return model_lib.gguf_folder(sources.resolve_source(m), part, build=False)


def warnings_of(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("ddptune: warning:")]


def test_a_cut_converted_model_is_converted_again_with_one_warning(tiny, capsys):
    """A converted model.safetensors cut short (a full disk, a killed copy) once failed every later run
    with SafetensorError: the next load finds it against the folder's record, says so in one line
    naming the folder, converts the GGUF file again, and loads the file's values."""
    # copies: the loaded weights map the file, and reading a mapped page past the cut kills the process
    first = {k: v.clone() for k, v in model_lib.load_model(tiny, "lora", torch.device("cpu"), "fp32", 0).state_dict().items()}
    folder = converted(tiny, "model")
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    assert converted(tiny, "model") is None  # damaged: not used as it is
    capsys.readouterr()
    again = model_lib.load_model(tiny, "lora", torch.device("cpu"), "fp32", 0).state_dict()
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    said = warnings_of(capsys)
    assert len(said) == 1 and str(folder) in said[0], said
    assert converted(tiny, "model") == folder and list(folder.parent.glob(".*")) == []  # whole, nothing left beside it
    model_lib.load_model(tiny, "lora", torch.device("cpu"), "fp32", 0)
    assert warnings_of(capsys) == []  # whole again: used as it is


def test_conversions_are_readable_by_others(tiny, tmp_path):
    """The cache may be shared: under umask 022 the converted folders are readable by everyone, the
    weights too (safetensors writes its files 0600, mkdtemp its folders 0700)."""
    with conftest.umask(0o022):
        model_lib.load_model(tiny, "lora", torch.device("cpu"), "fp32", 0)
        model_lib.load_tokenizer(tiny)
    assert converted(tiny, "model") is not None and converted(tiny, "tokenizer") is not None
    assert conftest.unreadable(tmp_path / "cache") == []


@pytest.mark.parametrize("damage", ["cut", "overwritten", "removed", "record removed"])
def test_a_damaged_converted_tokenizer_is_converted_again(tiny, capsys, damage):
    text = "hello abcd she shall"
    ids = model_lib.load_tokenizer(tiny)(text)["input_ids"]
    folder = converted(tiny, "tokenizer")
    target = folder / ("ddptune-files.json" if damage == "record removed" else "tokenizer.json")
    if damage == "cut":
        os.truncate(target, 100)
    elif damage == "overwritten":  # the same size, other bytes: the digest tells
        target.write_bytes(b" " * target.stat().st_size)
    else:
        target.unlink()
    capsys.readouterr()
    assert model_lib.load_tokenizer(tiny)(text)["input_ids"] == ids
    said = warnings_of(capsys)
    assert len(said) == 1 and str(folder) in said[0], said
    assert converted(tiny, "tokenizer") == folder


def cache_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "$DDPTUNE_CACHE" in lines[0], (code, err)
    return lines[0]


@pytest.mark.parametrize("where", ["a file", "under a file", "cannot be made", "read-only"])
def test_a_cache_that_cannot_be_written_is_refused_with_one_line_naming_it(tiny, tmp_path, monkeypatch, capsys, where):
    """A conversion that cannot be written: one line naming $DDPTUNE_CACHE and the way out, exit 2,
    before the run starts (not the tokenizer loader's line about the network or HF_HUB_OFFLINE); the
    same line from loading itself. A damaged conversion in a cache that cannot be written says so."""
    from ddptune import cli

    if where == "read-only" and os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    cache = {"a file": tmp_path / "cache-file", "under a file": tmp_path / "cache-file" / "cache",
             "cannot be made": Path("/sys/ddptune-cache"), "read-only": tmp_path / "ro"}[where]
    (tmp_path / "cache-file").write_text("not a folder\n")
    if where == "read-only":  # a whole tokenizer, then a damaged model, in a cache made read-only
        monkeypatch.setenv("DDPTUNE_CACHE", str(cache))
        model_lib.load_tokenizer(tiny)
        model_lib.gguf_folder(sources.resolve_source(tiny), "model")
        os.truncate(converted(tiny, "model") / "model.safetensors", 1000)
        for p in [cache, *cache.rglob("*")]:
            p.chmod(p.stat().st_mode & ~0o222)
    monkeypatch.setenv("DDPTUNE_CACHE", str(cache))
    out = tmp_path / "out"
    line = cache_line(cli.main(["train", str(ROOT / "configs" / "tiny.yaml"), f"model.source={tiny.source}",
                                f"output_dir={out}"]), capsys.readouterr().err)
    assert line.startswith("ddptune: invalid config: model.source: ") and str(cache.parent if where == "under a file"
                                                                              else cache) in line, line
    assert not out.exists()
    with pytest.raises(config.ConfigError) as e:  # loading, where no validation ran before it
        model_lib.load_model(tiny, "lora", torch.device("cpu"), "fp32", 0)
    assert e.value.problems == [line.removeprefix("ddptune: invalid config: ")]
    assert (tmp_path / "cache-file").read_text() == "not a folder\n"


def test_leftovers_of_a_killed_conversion_are_removed_and_a_live_ones_kept(tiny, capsys):
    """A conversion killed midway leaves its temporary folder (for SmolLM2, half a GB) beside the
    converted ones. The next conversion there removes those whose process (on this host, named in
    the folder) has ended, a killed one left unreaped too; a running process's, and another host's,
    stay."""
    import signal
    import socket
    import subprocess
    import sys

    where = sources.converted_folder(sources.resolve_source(tiny), "model").parent
    where.mkdir(parents=True)
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(killed.pid, signal.SIGKILL)  # left unreaped
        ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        host = socket.gethostname()
        names = {"ended": f".model.tmp-{host}-{int(ended.stdout)}-a1", "killed": f".tokenizer.tmp-{host}-{killed.pid}-b2",
                 "running": f".model.tmp-{host}-{running.pid}-c3", "elsewhere": f".model.tmp-elsewhere.example-{killed.pid}-d4",
                 "aside": f".model.old-{host}-{int(ended.stdout)}-e5"}
        for name in names.values():
            (where / name).mkdir()
            (where / name / "model.safetensors").write_bytes(b"\0" * 1000)
        model_lib.load_model(tiny, "lora", torch.device("cpu"), "fp32", 0)
        assert sorted(p.name for p in where.glob(".*")) == sorted([names["running"], names["elsewhere"]])
        assert warnings_of(capsys) == []  # none was damaged: not converted before
    finally:
        for p in (running, killed):
            p.kill()
            p.wait()
