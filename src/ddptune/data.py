"""Dialogue-summarization data: load rows, build prompts, tokenize once, batch.

A row has a dialogue and a summary. The prompt goes through the tokenizer's chat template when it
has one (else a plain template); the loss covers the summary tokens only (labels -100 elsewhere);
an over-long example is cut inside the dialogue, so the summary always survives. Nothing here
knows about processes: the training loop decides which of a step's samples it computes.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import importlib.util
import json
import os
import tempfile
from importlib import resources
from pathlib import Path

import torch

from ddptune.config import DataConfig, parse_rows

IGNORE = -100
TARGET_PAD = 64  # for CUDA graphs: the loss's target rows come in multiples of this (collate_packed's pad_to)
PLAIN_TEMPLATE = "{instruction}\n\n### Dialogue:\n{dialogue}\n\n### Summary:\n"
_MARK = "\x00DIALOGUE\x00"


# ---------------------------------------------------------------------------------------------
# Rows


def read_rows(source: str) -> list[dict]:
    """All rows of `demo`, a .json list file, a .jsonl file, or `hub:ID[:SPLIT]`. A file is read
    once per process (train and val are often slices of one file): later calls get the same rows."""
    key = (source, Path(source).stat().st_mtime_ns if Path(source).is_file() else None)
    if key not in _ROWS:
        _ROWS.clear()  # keep one file's rows at most
        _ROWS[key] = _read_rows(source)
    return _ROWS[key]


_ROWS: dict = {}


def _read_rows(source: str) -> list[dict]:
    if source == "demo":
        text = resources.files("ddptune").joinpath("demo_data/demo.jsonl").read_text(encoding="utf-8")
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if source.startswith("hub:"):
        from datasets import load_dataset  # optional; only for hub datasets

        ident, _, split = source[4:].partition(":")
        return [dict(r) for r in load_dataset(ident, split=split or "train")]
    path = Path(source)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    rows = json.loads(text)
    if not isinstance(rows, list):
        raise ValueError(f"{source} holds a JSON {type(rows).__name__}, not a list of rows")
    return rows


def load_split(source: str, rows: str | None, d: DataConfig) -> list[dict]:
    """The selected rows as {"id", "dialogue", "summary"} dicts."""
    data = read_rows(source)
    out = []
    for i, r in enumerate(data):
        out.append({"id": str(r.get("id", i)), "dialogue": r[d.dialogue_column], "summary": r[d.summary_column]})
    return out[parse_rows(rows)]


def check(d: DataConfig) -> tuple[list[str], int | None]:
    """(problems with the data files and columns, the number of training rows selected or None
    when unknown before loading: hub data). Reads each file once; tokenizes nothing."""
    problems, n_train = [], None
    for field, source, rows in (("data.train", d.train, d.train_rows), ("data.val", d.val, d.val_rows)):
        if source is None:
            continue
        if source.startswith("hub:"):
            if importlib.util.find_spec("datasets") is None:
                problems.append(f"{field}: {source} needs the datasets package (pip install 'ddptune[hub]', and internet), "
                                "or give a local .json/.jsonl file")
            continue
        if source != "demo" and not Path(source).is_file():
            problems.append(f"{field}: file {source!r} not found (give a .json/.jsonl path, `demo`, or hub:ID)")
            continue
        try:
            data = read_rows(source)
        except (ValueError, json.JSONDecodeError) as e:
            problems.append(f"{field}: cannot read {source} ({str(e).splitlines()[0]}; expected a JSON list or JSON lines)")
            continue
        if not data:
            problems.append(f"{field}: {source} holds no rows (give a JSON list or JSON lines of rows with "
                            f"{d.dialogue_column!r} and {d.summary_column!r} text)")
            continue
        columns = [column_problem(field, source, data, col, key)
                   for col, key in ((d.dialogue_column, "dialogue_column"), (d.summary_column, "summary_column"))]
        problems += [p for p in dict.fromkeys(columns) if p]  # a row that is not an object: said once
        selected = len(data[parse_rows(rows)])
        if not selected:
            problems.append(f"{field}: rows {rows!r} select nothing from {len(data)} rows of {source}")
        if field == "data.train":
            n_train = selected
    return problems, n_train


KINDS = {bool: "true/false", int: "a number", float: "a number", list: "a list", dict: "an object", type(None): "null"}


def column_problem(field: str, source: str, data: list, col: str, key: str) -> str | None:
    """The first row of `data` whose `col` is not text: a row that is not an object, one without
    the column, or one whose column holds something else (a number, a list...), each said as it is."""
    i = next((i for i, r in enumerate(data) if not isinstance(r, dict) or not isinstance(r.get(col), str)), None)
    if i is None:
        return None
    row = data[i]
    if not isinstance(row, dict):
        return (f"{field}: row {i} of {source} is {KINDS.get(type(row), type(row).__name__)}, not an object of "
                "columns (give every row its dialogue and summary as text columns)")
    if col not in row:
        return (f"{field}: row {i} of {source} has no text column {col!r} "
                f"(set data.{key} to one of: {', '.join(sorted(map(str, row))) or 'none'})")
    value = repr(row[col])
    return (f"{field}: row {i} of {source}: column {col!r} holds {KINDS.get(type(row[col]), type(row[col]).__name__)} "
            f"({value if len(value) <= 40 else value[:37] + '...'}), not text (write it as a string, or set data.{key} "
            "to a column of text)")


# ---------------------------------------------------------------------------------------------
# Prompts and tokens


def prompt_pieces(tokenizer, instruction: str) -> tuple[str, str, str]:
    """(text before the dialogue, text after it up to the summary, text after the summary)."""
    if getattr(tokenizer, "chat_template", None):
        user = [{"role": "user", "content": f"{instruction}\n\n{_MARK}"}]
        prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(
            user + [{"role": "assistant", "content": "S"}], tokenize=False
        )
        end = full[len(prompt) + 1:] if full.startswith(prompt + "S") else (tokenizer.eos_token or "")
    else:
        prompt = (tokenizer.bos_token or "") + PLAIN_TEMPLATE.format(instruction=instruction, dialogue=_MARK)
        end = tokenizer.eos_token or ""
    before, after = prompt.split(_MARK)
    return before, after, end


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


MARGIN_TOKENS = 64  # first_ids tokenizes this many longest tokens' worth of characters past what it keeps, twice


@functools.lru_cache(maxsize=8)
def longest_token(tokenizer) -> int:
    """Characters in the longest token string of the tokenizer's vocabulary (added tokens too).
    A byte-level vocabulary spells each byte of the text as one character of its own, a
    SentencePiece one each character as at least one: no token covers more characters of a text."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def first_ids(tokenizer, text: str, n: int) -> list[int]:
    """`_ids(tokenizer, text)[:n]`, without tokenizing more of a long text than can matter (a
    5 MB line tokenized whole took 1.8 GB). The first n tokens cover at most n x longest_token
    characters, so only that many, and a margin, are tokenized. The cut may change the tokens just
    before it (a word cut in two), so the n kept ones must end a margin before the cut, by the
    tokenizer's own offsets; if not (a normalizer that merges characters) or without offsets (a slow
    tokenizer), the whole text is tokenized after all."""
    if n <= 0:
        return []
    longest = longest_token(tokenizer)
    margin = MARGIN_TOKENS * longest
    bound = n * longest + 2 * margin
    if len(text) <= bound or not getattr(tokenizer, "is_fast", False):
        return _ids(tokenizer, text)[:n]
    encoded = tokenizer(text[:bound], add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    if len(ids) >= n and offsets[n - 1][1] + longest <= bound - margin:
        return ids[:n]
    return _ids(tokenizer, text)[:n]


def tokenize_example(tokenizer, pieces: tuple[str, str, str], dialogue: str, summary: str, max_length: int) -> dict:
    """Prompt and summary ids; the dialogue is cut at its end if the example is too long (only as
    much of a long dialogue or summary is tokenized as can be kept: first_ids)."""
    before, after, end = pieces
    pre, post = _ids(tokenizer, before), _ids(tokenizer, after)
    half = max_length // 2
    target = (first_ids(tokenizer, summary, half) + _ids(tokenizer, end))[:half]
    room = max_length - len(pre) - len(post) - len(target)
    dia = first_ids(tokenizer, dialogue, room)
    prompt = pre + dia + post
    return {"input_ids": prompt + target, "labels": [IGNORE] * len(prompt) + target, "prompt_len": len(prompt)}


def tokenize(rows: list[dict], tokenizer, d: DataConfig, progress: bool = False) -> list[dict]:
    """Every row tokenized; `progress`: a bar on stderr (tens of thousands of rows take a while)."""
    from tqdm.auto import tqdm

    pieces = prompt_pieces(tokenizer, d.instruction)
    return [tokenize_example(tokenizer, pieces, r["dialogue"], r["summary"], d.max_length)
            for r in tqdm(rows, desc="tokenize", disable=not progress, leave=False, dynamic_ncols=True)]


def tokenize_cached(rows: list[dict], tokenizer, d: DataConfig, cache_dir: str | os.PathLike, tok_id: str,
                    progress: bool = False) -> list[dict]:
    """Tokenize once and keep the result in `cache_dir` as JSON (data only: nothing is unpickled);
    later callers (other processes) read it. The caller makes one process go first; the file is
    written atomically, and one that cannot be read is made again."""
    key = hashlib.sha256(
        json.dumps([rows, d.instruction, d.max_length, tok_id], sort_keys=True).encode()
    ).hexdigest()[:20]
    path = Path(cache_dir) / f"tokenized-{key}.json"
    if path.exists():
        try:
            cached = json.loads(path.read_text())
            if isinstance(cached, list) and all(isinstance(e, dict) and set(e) == {"input_ids", "labels", "prompt_len"}
                                                for e in cached):
                return cached
        except (ValueError, UnicodeDecodeError):
            pass
    out = tokenize(rows, tokenizer, d, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(out, f)
    os.replace(tmp, path)
    return out


# ---------------------------------------------------------------------------------------------
# Steps and batches


def step_samples(n_rows: int, global_batch: int, step: int, seed: int) -> list[int]:
    """Row indices of optimizer step `step` (0-based). The rows form one endless stream, a fresh
    seeded permutation per epoch, and step k takes stream[k·B, (k+1)·B): every row is used once
    per epoch, and a step at the end of an epoch runs on into the next. So step k of global batch
    2B covers exactly steps 2k and 2k+1 of batch B: runs that differ only in their batch see the
    same samples in the same order (what a scaling study compares). Deterministic: resume needs no state."""
    out = []
    for pos in range(step * global_batch, (step + 1) * global_batch):
        epoch, i = divmod(pos, n_rows)
        out.append(_permutation(n_rows, seed, epoch)[i])
    return out


_PERMS: dict = {}


def _permutation(n_rows: int, seed: int, epoch: int) -> list[int]:
    key = (n_rows, seed, epoch)
    if key not in _PERMS:
        if len(_PERMS) > 4:
            _PERMS.clear()
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        _PERMS[key] = torch.randperm(n_rows, generator=g).tolist()
    return _PERMS[key]


def balance(costs: list[float], parts: int, equal_sizes: bool = False) -> list[list[int]]:
    """Split items (by index) into `parts` non-empty groups whose summed costs are as equal as
    possible: longest-processing-time first (each item, costliest first, to the group with the
    least cost so far), then moves and swaps out of the costliest group while they lower its cost.
    `equal_sizes`: every group gets len(costs) // parts items. Deterministic (ties by index)."""
    n = len(costs)
    if n < parts or (equal_sizes and n % parts):
        raise ValueError(f"cannot split {n} items into {parts} {'equal ' if equal_sizes else ''}non-empty groups")
    cap = n // parts if equal_sizes else n
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0.0] * parts
    for i in sorted(range(n), key=lambda i: (-costs[i], i)):
        j = min((j for j in range(parts) if len(groups[j]) < cap), key=lambda j: (load[j], j))
        groups[j].append(i)
        load[j] += costs[i]
    for _ in range(4 * n):  # improve the costliest group: move one item out, or swap one pair
        hi = max(range(parts), key=lambda j: (load[j], -j))
        best = None  # (new max of the two groups, group, item out of hi, item into hi or None)
        for lo in range(parts):
            gap = load[hi] - load[lo]
            if lo == hi or gap <= 0:
                continue
            options = sorted((costs[b], b) for b in groups[lo])
            if not equal_sizes and len(groups[hi]) > 1:
                options.insert(0, (0.0, None))  # a move: nothing comes back
            values = [v for v, _ in options]
            for a in groups[hi]:  # the best partner brings back about costs[a] - gap / 2
                k = bisect.bisect_left(values, costs[a] - gap / 2)
                for v, b in options[max(k - 1, 0):k + 1]:
                    d = costs[a] - v
                    if 0 < d < gap and (best is None or max(load[hi] - d, load[lo] + d) < best[0]):
                        best = (max(load[hi] - d, load[lo] + d), lo, a, b)
        if best is None or best[0] >= load[hi]:
            break
        _, lo, a, b = best
        d = costs[a] - (costs[b] if b is not None else 0.0)
        groups[hi].remove(a)
        groups[lo].append(a)
        if b is not None:
            groups[lo].remove(b)
            groups[hi].append(b)
        load[hi] -= d
        load[lo] += d
    return [sorted(g) for g in groups]


def targets_of(labels: list[list[int]] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat positions that predict a loss target, those targets) of a batch of label rows.
    Position t predicts token t+1; the last position of a row has no target. Computed here, on
    the host, so the loss needs neither a mask over every position nor a GPU sync to find them."""
    labels = torch.as_tensor(labels)
    following = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE).reshape(-1)
    index = (following != IGNORE).nonzero().squeeze(1)
    return index, following.index_select(0, index)


def pad_targets(index: torch.Tensor, targets: torch.Tensor, unit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, targets) padded to a multiple of `unit` entries with position 0 and IGNORE, which
    the loss leaves out. The output head runs at the target positions only, so its matrix products
    have as many rows as there are targets, a new count each step. On an H200 (8B, CUDA graphs) the
    head's backward product spent 4.2-4.6 ms of the host before its launch in every step, the GPU
    idle meanwhile, with another cuBLAS kernel each step (BENCHMARKS.md). In multiples the counts
    repeat, and `padded_targets` lets the graph warm-up meet each of them before the first step."""
    extra = -len(index) % unit
    return torch.cat([index, index.new_zeros(extra)]), torch.cat([targets, targets.new_full((extra,), IGNORE)])


def padded_targets(examples: list[dict]) -> int:
    """How many target rows `collate_packed(examples, pad_to=...)` gives the loss."""
    return -(-target_tokens(examples) // TARGET_PAD) * TARGET_PAD


def collate(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch: input_ids, attention_mask, and the loss targets with their positions."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        labels[i, :n] = torch.tensor(e["labels"])
        mask[i, :n] = 1
    index, targets = targets_of(labels)
    return {"input_ids": ids, "attention_mask": mask, "target_index": index, "targets": targets}


def pack(examples: list[dict], tokens_per_forward: int) -> list[list[dict]]:
    """Group examples into forward passes of at most `tokens_per_forward` tokens (first fit,
    longest first); each group becomes one packed row."""
    groups: list[list[dict]] = []
    room: list[int] = []
    for e in sorted(examples, key=lambda e: -len(e["input_ids"])):
        n = len(e["input_ids"])
        j = next((j for j, r in enumerate(room) if r >= n), None)
        if j is None:
            groups.append([])
            room.append(tokens_per_forward)
            j = len(groups) - 1
        groups[j].append(e)
        room[j] -= n
    return groups


def collate_packed(examples: list[dict], pad_to: int = 0, max_length: int = 0) -> dict:
    """One row of concatenated samples: input_ids, position_ids that restart at 0 for every sample,
    the boundaries as transformers' varlen arguments (cu_seq_lens_q/k: int32 cumulative lengths;
    max_length_q/k), and the loss targets with their positions. No padding and no mask: the
    attention kernel keeps every sample to itself.

    For replayed CUDA graphs the shapes must repeat: `pad_to` rounds the row up to a multiple of
    that many tokens with pad samples (no targets), the boundaries are repeated up to a multiple of
    64 entries (empty samples), and `max_length` (the data's) is given as the longest sample. No pad
    sample is longer than that: the flash kernel computes nothing past `max_length_q` in a sample and
    leaves those positions' outputs unwritten (whatever the memory held, NaN included, which then
    reaches the weight gradients as 0 * NaN although the loss never looks at them). The targets
    are padded too, to a multiple of TARGET_PAD (`pad_targets`)."""
    lengths = [len(e["input_ids"]) for e in examples]
    longest = max_length or max(lengths)
    pad = -sum(lengths) % pad_to if pad_to else 0
    pads = [longest] * (pad // longest) + ([pad % longest] if pad % longest else [])
    ids = [t for e in examples for t in e["input_ids"]] + [0] * pad
    labels = [[t for e in examples for t in e["labels"]] + [IGNORE] * pad]
    bounds = [0] + lengths + pads
    cu = torch.tensor(bounds, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    for a in cu[1:-1].tolist():  # the last token of a sample predicts nothing in the next one
        labels[0][a] = IGNORE
    if pad_to:
        cu = torch.cat([cu, cu[-1:].expand(-len(cu) % 64)])
    index, targets = targets_of(labels)
    if pad_to:
        index, targets = pad_targets(index, targets, TARGET_PAD)
    return {
        "input_ids": torch.tensor([ids]),
        "position_ids": torch.cat([torch.arange(n) for n in bounds[1:]]).unsqueeze(0),
        "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest,
        "target_index": index, "targets": targets,
    }


def packed_shape(examples: list[dict], pad_to: int, max_length: int) -> tuple[int, int, int]:
    """The shapes `collate_packed(examples, pad_to, max_length)` gives, without building it: the row's
    tokens, its boundary entries and its target rows (what a recorded CUDA graph is recorded for)."""
    tokens = sum(len(e["input_ids"]) for e in examples)
    pad = -tokens % pad_to
    bounds = 1 + len(examples) + -(-pad // max_length)
    return tokens + pad, bounds + -bounds % 64, padded_targets(examples)


def pad_lengths(rows: list[int], k: int, unit: int) -> list[int]:
    """At most `k` lengths, multiples of `unit`, such that every row length in `rows` fits one of them
    and padding each row to the shortest that fits leaves the least padding in all (ascending). The
    longest row's rounded length is always one; the others come from an exact search over the rounded
    row lengths (best[j][i]: least padding of the rows up to candidate i with j lengths, i the top)."""
    cands = sorted({-(-n // unit) * unit for n in rows})
    groups = [[n for n in rows if -(-n // unit) * unit == c] for c in cands]

    def padding(lo: int, hi: int) -> int:  # rows of candidates lo+1..hi, all padded to candidate hi
        return sum(cands[hi] * len(g) - sum(g) for g in groups[lo + 1:hi + 1])

    best = [{i: (padding(-1, i), [cands[i]]) for i in range(len(cands))}]
    for _ in range(1, min(k, len(cands))):
        best.append({i: min([best[-1][i]] + [(best[-1][j][0] + padding(j, i), best[-1][j][1] + [cands[i]])
                                              for j in range(i)]) for i in range(len(cands))})
    return best[-1][len(cands) - 1][1]


def target_tokens(examples: list[dict]) -> int:
    """Tokens the loss is computed on (summary tokens, not counting each sample's first label)."""
    return sum(sum(1 for t in e["labels"][1:] if t != IGNORE) for e in examples)
