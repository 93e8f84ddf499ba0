"""Attention for packed samples: `attn_implementation="varlen"`, registered with transformers.

A packed forward is one row of concatenated samples whose boundaries travel as `cu_seq_lens_q`; on
CUDA, torch's FlashAttention varlen kernel computes each sample's own causal triangle and never
pairs of samples; on CPU each sample runs through SDPA on its own (same math).
"""
from __future__ import annotations

import inspect

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """`attn_implementation="varlen"`: causal attention within each packed sample and never across.

    A packed forward is one row of concatenated samples (batch size 1) with the sample boundaries
    in `cu_seq_lens_q` (cumulative lengths, int32). On CUDA, torch's FlashAttention varlen kernel
    computes only each sample's own causal triangle: no mask tensor, no padding, no work on pairs
    of samples. Elsewhere (CPU), each sample runs through SDPA on its own (same math). Without
    boundaries (generation, padded batches) this is plain SDPA with transformers' mask.
    """
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if query.size(0) != 1:
        raise ValueError("varlen attention takes one packed row per forward")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, head_dim)
    # The flash kernel takes bf16/fp16 only. Full fine-tuning keeps fp32 weights under bf16 autocast,
    # and rotary embeddings (fp32, like the residual stream) turn q and k back to fp32: cast them
    # to autocast's dtype, as autocast would for an op it knew. fp32 without autocast takes SDPA.
    half = torch.get_autocast_dtype("cuda") if q.is_cuda and torch.is_autocast_enabled("cuda") else q.dtype
    if _flash_varlen is not None and q.is_cuda and half in (torch.bfloat16, torch.float16):
        out = _flash_varlen(q.to(half), k.to(half), v.to(half), cu_seq_lens_q, max_length_q, scaling)
    else:
        bounds = cu_seq_lens_q.tolist()
        out = torch.cat([
            torch.nn.functional.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                is_causal=True, scale=scaling, enable_gqa=True).transpose(0, 1)
            for a, b in zip(bounds[:-1], bounds[1:]) if b > a  # empty samples pad the boundaries
        ])
    return out.unsqueeze(0), None


def _make_flash_varlen():
    """torch.nn.attention.varlen.varlen_attn (torch >= 2.9), adapted to its signature in the
    installed torch: causal is `is_causal=True` in early versions, `window_size=(-1, 0)` later;
    grouped-query attention needs `enable_gqa` where it exists, else repeated key/value heads."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = "enable_gqa" in params

    def run(q, k, v, cu, max_len, scale):
        extra = dict(causal, scale=scale)
        if q.size(1) != k.size(1):
            if gqa:
                extra["enable_gqa"] = True
            else:
                k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **extra)

    return run


def _varlen_mask(*args, attention_mask=None, **kwargs):
    """Padded batches (evaluation, generation) get SDPA's mask; a packed row needs none: its
    boundaries travel as cu_seq_lens (building a tokens x tokens block mask would be waste)."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


_flash_varlen = _make_flash_varlen()


def register_attention() -> None:
    """Make `attn_implementation="varlen"` known to transformers (idempotent)."""
    AttentionInterface.register("varlen", varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("varlen", _varlen_mask)
