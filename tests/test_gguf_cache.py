"""A GGUF source is converted once into a plain folder in the cache, and loads from it with the values
transformers gives when it reads the GGUF file itself."""
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ddptune import config, memory, model as model_lib, sources

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"


def test_a_gguf_model_and_tokenizer_load_from_their_converted_folders_with_the_files_values(tmp_path, monkeypatch,
                                                                                           parsed_once):
    monkeypatch.setenv("DDPTUNE_CACHE", str(tmp_path / "cache"))
    m = config.load(DEMO, []).model
    src = model_lib.resolve_source(m)
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
    assert (tok.eos_token, tok.bos_token) == (ref_tok.eos_token, ref_tok.bos_token)

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
