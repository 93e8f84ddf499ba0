"""Batches: the step stream, balanced shares, packing and the padding CUDA graphs need.

A run's samples form one endless stream (`step_samples`): step k takes the k-th global batch of
it, a pure function of the seed and the step, so resume needs no state. `Stream.share(step)` splits
a step's samples into one share per process of equal cost (`balance`), each cut into forwards:
packed rows of at most tokens_per_forward tokens (`pack`, `collate_packed`) or padded micro-batches
(`collate`). Every process computes the same split, so no process ever waits to be told its share.
With CUDA graphs every packed row is padded to one of a few lengths (`pad_lengths`), so shapes repeat.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ddptune.data.tokens import IGNORE

TARGET_PAD = 64  # for CUDA graphs: the loss's target rows come in multiples of this (collate_packed's pad_to)
GRAPH_PAD = 128  # for CUDA graphs: packed rows are padded to multiples of this many tokens (a GEMM tile's rows)


def step_samples(n_rows: int, global_batch: int, step: int, seed: int) -> list[int]:
    """Row indices of optimizer step `step` (0-based). The rows form one endless stream, a fresh
    seeded permutation per epoch, and step k takes stream[k·B, (k+1)·B): every row is used once
    per epoch, and a step at the end of an epoch runs on into the next. So step k of global batch
    2B covers exactly steps 2k and 2k+1 of batch B: runs that differ only in their batch see the
    same samples in the same order (what a scaling study compares). Deterministic: resume needs no state."""
    out: list[int] = []
    pos, end = step * global_batch, (step + 1) * global_batch
    while pos < end:  # a slice of each epoch's order the step reaches (mostly one)
        epoch, i = divmod(pos, n_rows)
        take = min(end - pos, n_rows - i)
        out += _permutation(n_rows, seed, epoch)[i:i + take].tolist()
        pos += take
    return out


_PERMS: dict = {}


def _permutation(n_rows: int, seed: int, epoch: int):
    """An epoch's order of the rows, as an int64 array (8 bytes a row: a Python list took 36)."""
    key = (n_rows, seed, epoch)
    if key not in _PERMS:
        if len(_PERMS) > 8:  # a few: two epochs of each source of a mixture
            _PERMS.pop(next(iter(_PERMS)))
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        _PERMS[key] = torch.randperm(n_rows, generator=g).numpy()
    return _PERMS[key]


def mixed_step_samples(mix: tuple[tuple[int, int], ...], global_batch: int, step: int, seed: int) -> list[int]:
    """step_samples over several sources, their rows one after another: `mix` holds each source's
    (rows, draws per epoch). Each source is an endless stream of its own (step_samples' with its own
    seed; the first's is the run's), and each epoch of the mixture, sum(draws) samples long, takes
    `draws` samples from each, interleaved by a seeded permutation: the stated shares hold exactly
    over an epoch and about so in every step. A pure function of the seed and the step, of one
    endless stream of samples, as step_samples is (resume needs no state; batches of 2B are pairs of B's)."""
    offsets = [sum(rows for rows, _ in mix[:j]) for j in range(len(mix))]
    period = sum(n for _, n in mix)
    out = []
    for pos in range(step * global_batch, (step + 1) * global_batch):
        epoch, i = divmod(pos, period)
        labels, ranks = _interleaving(tuple(n for _, n in mix), seed, epoch)
        j = int(labels[i])
        rows, draws = mix[j]
        source_epoch, k = divmod(epoch * draws + int(ranks[i]), rows)
        out.append(offsets[j] + int(_permutation(rows, seed + 7_919 * j, source_epoch)[k]))
    return out


def mixture_draws(mix: tuple[tuple[int, int], ...], samples: int, seed: int) -> list[int]:
    """How many of the first `samples` samples of mixed_step_samples' stream each source of `mix` gives: its
    draws in each whole epoch of the mixture, and its share of the epoch begun last, as it is interleaved."""
    epochs, rest = divmod(samples, sum(n for _, n in mix))
    labels = _interleaving(tuple(n for _, n in mix), seed, epochs)[0][:rest]
    return [epochs * n + int((labels == j).sum()) for j, (_, n) in enumerate(mix)]


_MIXES: dict = {}


def _interleaving(draws: tuple[int, ...], seed: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the source of each sample of a mixture's epoch, how many of that source's come before it), as arrays."""
    key = (draws, seed, epoch)
    if key not in _MIXES:
        if len(_MIXES) > 2:
            _MIXES.pop(next(iter(_MIXES)))
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch + 500_009)
        order = torch.repeat_interleave(torch.arange(len(draws)), torch.tensor(draws))
        labels = order[torch.randperm(len(order), generator=g)]
        ranks = torch.empty_like(labels)
        for j in range(len(draws)):  # the k-th sample of source j has rank k
            where = (labels == j).nonzero().squeeze(1)
            ranks[where] = torch.arange(len(where))
        _MIXES[key] = (labels.numpy(), ranks.numpy())
    return _MIXES[key]


def balance(costs: list[float], parts: int, equal_sizes: bool = False) -> list[list[int]]:
    """Split items (by index) into `parts` non-empty groups whose summed costs are as equal as
    possible: longest-processing-time first (each item, costliest first, to the group with the
    least cost so far), then moves and swaps out of the costliest group while they lower its cost.
    `equal_sizes`: every group gets len(costs) // parts items. Deterministic (ties by index)."""
    n = len(costs)
    if n < parts or (equal_sizes and n % parts):
        raise ValueError(f"cannot split {n} items into {parts} {'equal ' if equal_sizes else ''}non-empty groups")
    order = sorted(range(n), key=lambda i: (-costs[i], i))
    if n == parts and costs[order[-1]] > 0:  # an item each, costliest first: nothing to improve
        return [[i] for i in order]
    cap = n // parts if equal_sizes else n
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0.0] * parts
    open_ = [(0.0, j) for j in range(parts)]  # a heap of (load, group) of the groups not yet full
    for i in order:
        _, j = heapq.heappop(open_)
        groups[j].append(i)
        load[j] += costs[i]
        if len(groups[j]) < cap:
            heapq.heappush(open_, (load[j], j))
    ranked: dict[int, tuple[list, list]] = {}  # each group's (sorted (cost, item), costs), while it is unchanged
    for _ in range(4 * n):  # improve the costliest group: move one item out, or swap one pair
        hi = max(range(parts), key=lambda j: (load[j], -j))
        best = None  # (new max of the two groups, group, item out of hi, item into hi or None)
        for lo in range(parts):
            gap = load[hi] - load[lo]
            if lo == hi or gap <= 0 or (best is not None and (load[hi] + load[lo]) / 2 > best[0] * (1 + 1e-12)):
                continue  # no pair with this group lowers the costliest below the best found (half their sum)
            if lo not in ranked:
                options = sorted((costs[b], b) for b in groups[lo])
                ranked[lo] = options, [v for v, _ in options]
            options, values = ranked[lo]
            if not equal_sizes and len(groups[hi]) > 1:
                options, values = [(0.0, None), *options], [0.0, *values]  # a move: nothing comes back
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
        ranked.pop(hi, None)
        ranked.pop(lo, None)
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
    return target_rows(target_tokens(examples))


def target_rows(targets: int) -> int:
    """The target rows of a padded packed row with `targets` loss targets: rounded up to TARGET_PAD."""
    return -(-targets // TARGET_PAD) * TARGET_PAD


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
    return [[examples[k] for k in row] for row in pack_lengths([len(e["input_ids"]) for e in examples], tokens_per_forward)]


def pack_lengths(lengths: Sequence[int], tokens_per_forward: int) -> list[list[int]]:
    """pack's rows as positions in `lengths`: first fit, longest first (ties in order)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for k in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        n = lengths[k]
        j = next((j for j, r in enumerate(room) if r >= n), None)
        if j is None:
            rows.append([])
            room.append(tokens_per_forward)
            j = len(rows) - 1
        rows[j].append(k)
        room[j] -= n
    return rows


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
    return row_shape(tokens_of(examples), len(examples), target_tokens(examples), pad_to, max_length)


def row_shape(tokens: int, samples: int, targets: int, pad_to: int, max_length: int) -> tuple[int, int, int]:
    """packed_shape of a row of `samples` samples, `tokens` tokens and `targets` loss targets."""
    pad = -tokens % pad_to
    bounds = 1 + samples + -(-pad // max_length)
    return tokens + pad, bounds + -bounds % 64, target_rows(targets)


def pad_lengths(rows: list[int], k: int, unit: int) -> list[int]:
    """At most `k` lengths, multiples of `unit`, such that every row length in `rows` fits one of them
    and padding each row to the shortest that fits leaves the least padding in all (ascending). The
    longest row's rounded length is always one; the others come from an exact search over the rounded
    row lengths (best[j][i]: least padding of the rows up to candidate i with j lengths, i the top)."""
    rows = np.asarray(rows, dtype=np.int64)
    cands, which = np.unique(-(-rows // unit) * unit, return_inverse=True)
    count, total = np.zeros(len(cands) + 1, dtype=np.int64), np.zeros(len(cands) + 1, dtype=np.int64)
    np.add.at(count, which + 1, 1)
    np.add.at(total, which + 1, rows)
    cands, count, total = cands.tolist(), np.cumsum(count).tolist(), np.cumsum(total).tolist()  # [i + 1]: up to candidate i

    def padding(lo: int, hi: int) -> int:  # rows of candidates lo+1..hi, all padded to candidate hi
        return cands[hi] * (count[hi + 1] - count[lo + 1]) - (total[hi + 1] - total[lo + 1])

    best = [{i: (padding(-1, i), [cands[i]]) for i in range(len(cands))}]
    for _ in range(1, min(k, len(cands))):
        best.append({i: min([best[-1][i]] + [(best[-1][j][0] + padding(j, i), best[-1][j][1] + [cands[i]])
                                              for j in range(i)]) for i in range(len(cands))})
    return best[-1][len(cands) - 1][1]


def target_tokens(examples: list[dict]) -> int:
    """Tokens the loss is computed on (summary tokens, not counting each sample's first label)."""
    return sum(sum(1 for t in e["labels"][1:] if t != IGNORE) for e in examples)


def tokens_of(group: list[dict]) -> int:
    return sum(len(e["input_ids"]) for e in group)


# ---------------------------------------------------------------------------------------------
# A run's stream, cut into shares


@dataclass
class Share:
    """Who computes what in one optimizer step (the same answer on every process)."""
    forwards: list[list[list[dict]]]  # each process's examples, grouped per forward pass
    targets: int             # summary tokens of the whole global batch: every loss divides by it
    tokens: list[int]        # real tokens of each process
    computed: list[int]      # tokens each process computes (real tokens plus padding)
    cost: list[float]        # model FLOPs of each process


@dataclass(frozen=True, kw_only=True)
class Stream:
    """A run's training examples and how each optimizer step is cut: `parts` shares of equal cost
    (equal sample counts too with padded batches, whose micro-batches must line up), each grouped
    into forwards. `lockstep`: every share runs as many forwards (FSDP gathers weights in each).
    `graph_lengths`: with CUDA graphs, the lengths packed rows are padded to."""
    examples: Sequence[dict]  # store.Examples: an example is read when a step takes it
    costs: Sequence[float]   # model FLOPs of each example: what the shares balance
    targets: Sequence[int]   # loss targets (summary tokens) of each example
    global_batch: int
    parts: int
    seed: int
    packing: bool
    micro_batch_size: int
    tokens_per_forward: int
    max_length: int
    lockstep: bool = False
    graph_lengths: tuple[int, ...] = ()
    mix: tuple[tuple[int, int], ...] = ()  # several sources: each one's (rows, draws per epoch), data.mixture

    def samples(self, step: int) -> list[int]:
        """The examples (indices) of optimizer step `step`."""
        if self.mix:
            return mixed_step_samples(self.mix, self.global_batch, step, self.seed)
        return step_samples(len(self.examples), self.global_batch, step, self.seed)

    def with_lengths(self, lengths: list[int]) -> "Stream":
        return dataclasses.replace(self, graph_lengths=tuple(lengths))

    def share(self, step: int) -> Share:
        idx = self.samples(step)
        groups = balance([self.costs[i] for i in idx], self.parts, equal_sizes=not self.packing)
        shares = [[self.examples[idx[j]] for j in g] for g in groups]
        forwards = [self.layout(s) for s in shares]
        if self.lockstep:
            forwards = lockstep(forwards)
        tokens = [tokens_of(s) for s in shares]
        if self.graph_lengths:  # every packed row padded to a length the graphs are recorded at
            computed = [sum(self.padded_length(tokens_of(g)) for g in rows) for rows in forwards]
        elif self.packing:
            computed = tokens
        else:
            computed = [sum(len(g) * max(len(e["input_ids"]) for e in g) for g in rows) for rows in forwards]
        costs = [float(sum(self.costs[idx[j]] for j in g)) for g in groups]
        return Share(forwards, int(sum(self.targets[i] for i in idx)), tokens, computed, costs)

    def row_sizes(self, step: int) -> list[list[tuple[int, int, int]]]:
        """What share(step).forwards holds, as numbers: each process's packed rows as (tokens, samples,
        loss targets), from the examples' lengths and targets without reading their tokens (packed,
        not lockstep: where CUDA graphs are recorded)."""
        if not self.packing or self.lockstep:
            raise ValueError("row_sizes needs packed rows and no lockstep")
        idx = self.samples(step)
        lengths = getattr(self.examples, "lengths", None)
        out = []
        for group in balance([self.costs[i] for i in idx], self.parts):
            mine = [idx[j] for j in group]
            sizes = [int(lengths[i]) if lengths is not None else len(self.examples[i]["input_ids"]) for i in mine]
            out.append([(sum(sizes[k] for k in row), len(row), int(sum(self.targets[mine[k]] for k in row)))
                        for row in pack_lengths(sizes, self.tokens_per_forward)])
        return out

    def layout(self, examples: list[dict]) -> list[list[dict]]:
        """The examples of each forward pass: packed rows of at most tokens_per_forward tokens, or
        padded micro-batches of similar lengths."""
        if self.packing:
            return pack(examples, self.tokens_per_forward)
        ordered = sorted(examples, key=lambda e: -len(e["input_ids"]))
        return [ordered[i:i + self.micro_batch_size] for i in range(0, len(ordered), self.micro_batch_size)]

    def padded_length(self, tokens: int) -> int:
        """With graphs: the shortest recorded length that holds a row of `tokens`; else 0."""
        return min((n for n in self.graph_lengths if n >= tokens), default=0)

    def collate(self, group: list[dict], pad_id: int) -> dict:
        """One forward's examples as tensors on the host (with graphs, packed to a recorded length)."""
        if not self.packing:
            return collate(group, pad_id)
        pad_to = self.padded_length(tokens_of(group))
        return collate_packed(group, pad_to=pad_to, max_length=self.max_length) if pad_to else collate_packed(group)

    def shape(self, forwards: list[list[dict]]) -> tuple:
        """What a recorded step is recorded for: each packed row's (tokens, boundary entries, target rows)."""
        return tuple(packed_shape(g, self.padded_length(tokens_of(g)), self.max_length) for g in forwards)


def lockstep(forwards: list[list[list[dict]]]) -> list[list[list[dict]]]:
    """Every process's forwards, as many for each as the busiest has. Sharded (FSDP), each forward
    and backward gathers weights from all processes, so they must run the same number (DDP only
    meets them at the last backward). A process with fewer splits its rows of the most samples in
    two (the same samples, in smaller forwards); one left with rows of single samples gets empty
    groups: forwards that count nothing."""
    n = max(len(rows) for rows in forwards)
    out = []
    for rows in forwards:
        rows = list(rows)
        while len(rows) < n:
            i = max(range(len(rows)), key=lambda j: len(rows[j]))
            half = len(rows[i]) // 2
            rows[i:i + 1] = [rows[i][:half], rows[i][half:]] if half else [rows[i]]
            if not half:
                rows.append([])
        out.append(rows)
    return out
