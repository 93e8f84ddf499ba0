"""Prompt building, label masking, truncation, packing and the step plan (no processes)."""
from __future__ import annotations

import torch

from ddptune import data, model as model_lib
from ddptune.config import DataConfig

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tokenizers():
    plain = model_lib.byte_tokenizer()
    chat = model_lib.byte_tokenizer()
    chat.chat_template = CHAT
    return plain, chat


def test_loss_covers_the_summary_only_in_both_templates():
    for tok in tokenizers():
        pieces = data.prompt_pieces(tok, "Summarize.")
        ex = data.tokenize_example(tok, pieces, "A: hi\nB: hello", "They greet.", 512)
        target = [t for t in ex["labels"] if t != data.IGNORE]
        assert ex["labels"][: ex["prompt_len"]] == [data.IGNORE] * ex["prompt_len"]
        assert tok.decode(target).startswith("They greet.")
        assert len(ex["input_ids"]) == len(ex["labels"])
        prompt = tok.decode(ex["input_ids"][: ex["prompt_len"]])
        assert "A: hi\nB: hello" in prompt and "Summarize." in prompt


def test_chat_template_is_used_when_present():
    _, chat = tokenizers()
    before, after, end = data.prompt_pieces(chat, "Summarize.")
    assert before.startswith("<|user|>Summarize.") and after == "<|end|>\n<|assistant|>" and end == "<|end|>\n"


def test_overlong_examples_are_cut_in_the_dialogue_and_keep_the_summary():
    tok, _ = tokenizers()
    pieces = data.prompt_pieces(tok, "Summarize.")
    ex = data.tokenize_example(tok, pieces, "A: " + "blah " * 500, "Short summary.", 128)
    assert len(ex["input_ids"]) == 128
    assert tok.decode([t for t in ex["labels"] if t != data.IGNORE]).startswith("Short summary.")
    assert tok.decode(ex["input_ids"][: ex["prompt_len"]]).endswith("### Summary:\n")


def test_step_plan_covers_each_epoch_without_repeats_and_reshuffles():
    steps = [data.step_samples(10, 3, s, seed=1) for s in range(6)]  # 3 steps per epoch, 1 row dropped
    first, second = sum(steps[:3], []), sum(steps[3:], [])
    assert len(set(first)) == 9 and len(set(second)) == 9 and first != second
    assert data.step_samples(10, 3, 4, seed=1) == steps[4]  # deterministic: resume needs no state


def test_split_step_gives_equal_micro_batches_of_similar_length():
    lengths = [5, 50, 7, 48, 6, 49, 8, 47]
    parts = data.split_step(list(range(8)), lengths, 4)
    assert [len(p) for p in parts] == [2, 2, 2, 2]
    assert parts[0] == [1, 5] and sorted(sum(parts, [])) == list(range(8))


def test_packing_keeps_samples_apart():
    ex = [{"input_ids": [1] * n, "labels": [data.IGNORE] * (n - 2) + [7, 7]} for n in (5, 3, 4)]
    forwards = data.pack(ex, tokens_per_forward=8)
    assert [[len(e["input_ids"]) for e in f] for f in forwards] == [[5, 3], [4]]
    batch = data.collate_packed(forwards[0])
    assert batch["input_ids"].shape == (1, 8)  # one row, no padding
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 8] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == 5
    assert sum((data.collate_packed(f)["labels"] != data.IGNORE).sum() for f in forwards) == 6 == data.target_tokens(ex)


def test_packed_forward_equals_separate_forwards():
    """No sample attends across another: the packed loss (varlen attention, one row) equals the
    sum of the samples' own losses, and so do its gradients."""
    ex = []
    g = torch.Generator().manual_seed(0)
    for n in (9, 14, 6):
        ids = torch.randint(0, 256, (n,), generator=g).tolist()
        ex.append({"input_ids": ids, "labels": [data.IGNORE] * 3 + ids[3:]})
    grads = []
    for packed in (False, True):
        net = model_lib.CausalLMLoss(model_lib.build_preset("tiny", 0, torch.float32, torch.device("cpu"), "varlen"))
        if packed:
            loss = net(**data.collate_packed(ex), num_items=1)
        else:
            loss = sum(net(**data.collate([e], 0), num_items=1) for e in ex)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in net.parameters()]))
    (separate, g_sep), (packed, g_pack) = grads
    assert torch.allclose(packed, separate, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g_sep, g_pack))


def test_check_reports_missing_rows(tmp_path):
    d = DataConfig(train="demo", train_rows="5000:6000")
    assert any("select nothing" in p for p in data.check(d))
