"""Attention for packed samples: `attn_implementation="varlen"`, registered with transformers.

A packed forward is one row of concatenated samples whose boundaries travel as `cu_seq_lens_q`; on
CUDA, torch's FlashAttention varlen kernel computes each sample's own causal triangle and never
pairs of samples; on CPU each sample runs through SDPA on its own (same math).
"""
from __future__ import annotations

import importlib
import inspect

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.utils.generic import TransformersKwargs


# transformers' own arguments of every attention call (and the cache's switch); any other that a model's
# code passes with a value (sliding_window, softcap, s_aux, ...) is a variant of attention it defines
_PLAIN = frozenset(TransformersKwargs.__annotations__) | {"use_cache"}


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """`attn_implementation="varlen"`: causal attention within each packed sample and never across.

    A packed forward is one row of concatenated samples (batch size 1) with the sample boundaries
    in `cu_seq_lens_q` (cumulative lengths, int32). On CUDA, torch's FlashAttention varlen kernel
    computes only each sample's own causal triangle (within a layer's sliding window, where the
    model gives one): no mask tensor, no padding, no work on pairs of samples. Elsewhere (CPU), each
    sample runs through SDPA on its own (same math). Without boundaries (generation, padded batches)
    this is SDPA with transformers' mask.

    A variant that neither kernel computes (soft-capped scores, sinks, or any argument this code does
    not know) runs through the model's own eager attention function instead, sample by sample or
    with the padded batch's mask: exact, slower, never silently different (`arch.Arch.slow_attention`
    says which models, before the run).
    """
    window = kwargs.pop("sliding_window", None)
    variant = {k: v for k, v in kwargs.items() if v is not None and k not in _PLAIN}
    if variant:
        return _own_attention(module=module, query=query, key=key, value=value, mask=attention_mask, scaling=scaling,
                              dropout=dropout, window=window, cu=cu_seq_lens_q, variant=variant)
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if query.size(0) != 1:
        raise ValueError("varlen attention takes one packed row per forward")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, head_dim)
    # The flash kernel takes bf16/fp16 only. Full fine-tuning keeps fp32 weights under bf16 autocast,
    # and rotary embeddings (fp32, like the residual stream) turn q and k back to fp32: cast them
    # to autocast's dtype, as autocast would for an op it knew. fp32 without autocast takes SDPA.
    half = torch.get_autocast_dtype("cuda") if q.is_cuda and torch.is_autocast_enabled("cuda") else q.dtype
    if _flash_varlen is not None and q.is_cuda and half in (torch.bfloat16, torch.float16) and (
            window is None or _flash_windows):
        out = _flash_varlen(q.to(half), k.to(half), v.to(half), cu_seq_lens_q, max_length_q, scaling, window)
    else:
        out = _each_sample(q, k, v, cu_seq_lens_q, scaling, window)
    return out.unsqueeze(0), None


@torch.compiler.disable
def _each_sample(q, k, v, cu, scaling, window) -> torch.Tensor:
    """SDPA over each packed sample on its own, (tokens, heads, head_dim) in and out. Run as it is written
    in a compiled layer too: traced, the loop's trip count and each sample's length are data, and
    tracing them cost 50 of a 3-step CPU run's 85 s, for a loop that compiles to the same SDPA calls."""
    bounds = cu.tolist()
    return torch.cat([
        torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
            attn_mask=_band(b - a, window, q.device), is_causal=window is None or b - a <= window,
            scale=scaling, enable_gqa=True).transpose(0, 1)
        for a, b in zip(bounds[:-1], bounds[1:]) if b > a  # empty samples pad the boundaries
    ])


def _own_attention(module, query, key, value, mask, scaling, dropout, window, cu, variant):
    """The model's own eager attention (`own_attention`): over a padded batch with transformers'
    mask, or over each packed sample on its own (its causal mask within `window`)."""
    own = own_attention(module)
    if own is None:
        raise ValueError(f"{type(module).__name__} passes {sorted(variant)} to its attention and has no eager "
                         "attention function that computes them")

    def run(q, k, v, m):
        return own(module, q, k, v, _additive(m, q, k, window), scaling=scaling, dropout=dropout,
                   sliding_window=window, **variant)[0]

    if cu is None:
        return run(query, key, value, mask), None
    bounds = cu.tolist()  # a packed row: its 4-D mask is an empty placeholder (loss.CausalLMLoss)
    return torch.cat([run(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None)
                      for a, b in zip(bounds[:-1], bounds[1:]) if b > a], dim=1), None


def own_function(module, name: str):
    """The function `name` of `module`'s own modeling code (transformers'), or None where it has none."""
    return getattr(importlib.import_module(type(module).__module__), name, None)


def own_attention(module):
    """The eager attention function of `module`'s own modeling code, which computes every variant that
    model defines (soft-caps, sinks), or None where its module has none."""
    return own_function(module, "eager_attention_forward")


def _band(n: int, window: int | None, device) -> torch.Tensor | None:
    """The boolean mask of `n` tokens each seeing itself and the `window` - 1 before it (transformers'
    sliding window), or None where causal alone is the same (no window, or one longer than the sample)."""
    if window is None or n <= window:
        return None
    i = torch.arange(n, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)


def _additive(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, window: int | None) -> torch.Tensor:
    """The additive float mask an eager attention function adds to its scores: transformers' boolean
    mask (True: attend) turned into 0 / the dtype's lowest value, or where there is none (a packed
    sample; a batch without padding) causal, within `window`, for queries that end at the last key."""
    low = torch.finfo(query.dtype).min
    if mask is not None and mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, low)
    if mask is not None:
        return mask
    q_len, k_len = query.size(2), key.size(2)
    q = torch.arange(k_len - q_len, k_len, device=query.device)[:, None]
    k = torch.arange(k_len, device=query.device)[None, :]
    seen = (k <= q) & ((k > q - window) if window is not None else True)
    return torch.zeros(1, 1, q_len, k_len, dtype=query.dtype, device=query.device).masked_fill(~seen, low)


def _make_flash_varlen():
    """torch.nn.attention.varlen.varlen_attn (torch >= 2.9), adapted to its signature in the
    installed torch: causal is `is_causal=True` in early versions, `window_size=(-1, 0)` later;
    grouped-query attention needs `enable_gqa` where it exists, else repeated key/value heads."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    windows = "window_size" in params
    gqa = "enable_gqa" in params

    def run(q, k, v, cu, max_len, scale, window=None):
        # transformers' window of w keys (the query's own and w - 1 before it) is flash's (w - 1, 0)
        causal = {"window_size": (-1 if window is None else window - 1, 0)} if windows else {"is_causal": True}
        extra = dict(causal, scale=scale)
        if q.size(1) != k.size(1):
            if gqa:
                extra["enable_gqa"] = True
            else:
                k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **extra)

    return run, windows


def _varlen_mask(*args, attention_mask=None, **kwargs):
    """Padded batches (evaluation, generation) get SDPA's mask; a packed row needs none: its
    boundaries travel as cu_seq_lens (building a tokens x tokens block mask would be waste)."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


_flash_varlen, _flash_windows = _make_flash_varlen() or (None, False)


def register_attention() -> None:
    """Make `attn_implementation="varlen"` known to transformers (idempotent)."""
    AttentionInterface.register("varlen", varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("varlen", _varlen_mask)
