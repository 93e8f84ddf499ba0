"""The training objective around a causal LM: token cross-entropy at the loss targets, as the model defines it.

Summed, then divided by the step's target count, with what the architecture adds (the head's scale and
soft-cap, a mixture's router loss).

Nothing here knows about processes: DDP wraps this module, and the step divides by the whole step's count.
"""
from __future__ import annotations

import torch

from ddptune import arch
from ddptune.attention import own_function


class CausalLMLoss(torch.nn.Module):
    """The training objective around a causal LM: summed token cross-entropy / `num_items`.

    It runs the decoder, then applies the output head only at the positions that predict a target
    (summary tokens), given as `target_index` into the flattened (rows x tokens) positions with their
    `targets` (`batches.targets_of`, computed on the host: finding them here would be a GPU sync).
    The logits of prompt positions would be thrown away, and for a 128k vocabulary they are the
    largest tensor of the step. This module is what DDP wraps; the model inside is what gets saved
    and evaluated. The head's logits are scaled and soft-capped as the architecture defines
    (`arch.Arch`: Granite's logits_scaling, Gemma's final_logit_softcapping), as its own forward does.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.decoder = base.get_decoder()
        self.head = base.get_output_embeddings()
        self.arch = arch.of(base.config)
        # the model's own router balance loss, where its config asks for one (router_loss)
        self.balance = own_function(base, "load_balancing_loss_func") if self.arch.router_aux_coef else None
        self.varlen = base.config._attn_implementation == "varlen"
        # the blocks a device map or a sharding must keep whole (transformers' name): the decoder layers
        self._no_split_modules = getattr(base, "_no_split_modules", None)

    def forward(self, input_ids, target_index, targets, num_items, attention_mask=None, position_ids=None, **packed):
        # packed: a packed row's sample boundaries (cu_seq_lens_q/k, max_length_q/k) for attention
        rows = attention_mask  # a padded batch's (rows x tokens) mask; None for a packed row
        if packed and attention_mask is None and self.varlen:
            # A 4-D mask is final for transformers, so it skips building one: for a row without a
            # padding mask that scans position_ids for packed samples and reads the answer on the
            # host, a GPU sync every forward. varlen attention ignores it (the boundaries are in cu_seq_lens).
            attention_mask = torch.empty(1, 1, 0, 0, device=input_ids.device)
        routed = {"output_router_logits": True} if self.arch.router_aux_coef else {}
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False, **routed, **packed)
        hidden = out.last_hidden_state
        loss = self.head_loss(hidden.reshape(-1, hidden.size(-1)).index_select(0, target_index), targets)
        if routed:
            spans = _spans(packed.get("cu_seq_lens_q"), rows, input_ids.shape)
            loss = loss + self.arch.router_aux_coef * self.router_loss(out.router_logits, spans, target_index, targets)
        return loss / num_items

    def router_loss(self, router_logits, spans, target_index, targets):
        """The router's load-balancing loss as the config asks for it (output_router_logits,
        router_aux_loss_coef): the model's own `load_balancing_loss_func` over each sample's tokens
        (transformers' value for a batch of that one sample), each weighted by the sample's loss
        targets, like its cross-entropy. transformers computes it over a forward's tokens at once, a
        value that would change with how samples are packed and shared out over the processes;
        per sample, the step's sum is the same at every process count."""
        scored = target_index[targets != -100]
        ends = torch.tensor([b for _, b in spans], device=scored.device)
        weights = torch.bincount(torch.searchsorted(ends, scored, right=True), minlength=len(spans))
        return sum(self.balance(tuple(layer[a:b] for layer in router_logits), self.arch.experts, self.arch.experts_per_token, None)
                   * w for (a, b), w in zip(spans, weights) if b > a)

    def head_loss(self, hidden, targets):
        """Summed cross-entropy of the output head at `hidden` (targets x hidden size) against `targets`
        (-100, cross_entropy's ignore_index: left out)."""
        logits = self.head(hidden).float()
        if self.arch.logit_scale != 1.0:
            logits = logits * self.arch.logit_scale
        if cap := self.arch.final_softcap:
            logits = torch.tanh(logits / cap) * cap
        return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")


def _spans(cu, rows, shape) -> list[tuple[int, int]]:
    """Each sample's (start, end) in the flattened (rows x tokens) positions: a packed row's boundaries,
    or each padded row's tokens."""
    if cu is not None:
        bounds = cu.tolist()
        return list(zip(bounds[:-1], bounds[1:]))
    width = shape[1]
    lengths = rows.sum(1).tolist() if rows is not None else [width] * shape[0]
    return [(i * width, i * width + n) for i, n in enumerate(lengths)]
