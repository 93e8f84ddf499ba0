"""What a model's architecture defines beyond a plain Llama-shaped decoder, read once from its config.

transformers' model code is the reference for what an architecture computes. Its config names the
attention each layer uses (`layer_types`, `sliding_window`, `use_sliding_window`, `attention_chunk_size`),
soft-caps (`attn_logit_softcapping`, `final_logit_softcapping`), scales on the output head
(`logits_scaling`, `logit_scale`), the attention's scale (`query_pre_attn_scalar`, `attention_multiplier`), and
experts (`num_local_experts` / `num_experts`, `num_experts_per_tok`, `norm_topk_prob`, `output_router_logits`,
`router_aux_loss_coef`); attention sinks are parameters of the attention modules.
`of(config)` reads them into one frozen `Arch`; attention, the loss, the LoRA targets, the speed choices,
`plan`, the banner and the GGUF writer ask it instead of testing `model_type`.
"""
from __future__ import annotations

from dataclasses import dataclass

# model types whose attention modules hold learned sinks (one logit per head that takes part in every softmax)
_SINKS = ("gpt_oss",)


@dataclass(frozen=True, kw_only=True, slots=True)
class Arch:
    family: str                      # transformers' model_type
    windows: tuple                   # each layer's sliding window (keys a query sees, itself included); None: all before it
    chunked: bool                    # some layers attend within fixed chunks (attention_chunk_size)
    attn_softcap: float | None       # attention logits soft-capped: cap * tanh(scores / cap)
    final_softcap: float | None      # output logits soft-capped likewise
    logit_scale: float               # output logits multiplied by this (1 / logits_scaling, or logit_scale)
    sinks: bool                      # attention sinks
    experts: int                     # experts per MoE layer; 0: dense
    experts_per_token: int
    experts_normalized: bool         # the chosen experts' router weights renormalized to sum to 1 (norm_topk_prob)
    router_aux_coef: float | None    # router load-balancing loss coefficient, where the config asks for it
    tied_head: bool                  # the output head is the input embedding
    head_dim: int
    attn_scale: float                # attention scores multiplied by this (query_pre_attn_scalar, attention_multiplier)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def windowed(self) -> bool:
        return any(w is not None for w in self.windows)

    def slow_attention(self) -> list[str]:
        """What the packed fast path's kernels do not compute, by name: such layers run each packed
        sample through the model's own (eager) attention function instead (exact, slower)."""
        return (["attention soft-capping"] if self.attn_softcap else []) + (["attention sinks"] if self.sinks else [])

    def packing_problem(self) -> str | None:
        """What no packed path computes (a problem line for train.packing), or None."""
        if self.chunked:
            return (f"train.packing: {self.family} attends within chunks (attention_chunk_size), which packed samples "
                    "cannot express: set train.packing=false (padded batches through transformers' own attention)")
        return None

    def features(self) -> list[str]:
        """What the model defines beyond a plain causal decoder, for the banner and the support table."""
        out = []
        if self.windowed:
            sizes = sorted({w for w in self.windows if w is not None})
            n = sum(w is not None for w in self.windows)
            out.append(f"sliding window {'/'.join(map(str, sizes))} on {n} of {len(self.windows)} layers")
        out += self.slow_attention()
        if self.final_softcap:
            out.append(f"final logit soft-cap {self.final_softcap:g}")
        if self.logit_scale != 1.0:
            out.append(f"logits scaled by {self.logit_scale:g}")
        if self.moe:
            out.append(f"{self.experts} experts, {self.experts_per_token} a token"
                       + (f", router loss x{self.router_aux_coef:g}" if self.router_aux_coef else ""))
        return out


def of(config) -> Arch:
    """The architecture `config` (a transformers PretrainedConfig of a causal LM) defines."""
    text = getattr(config, "get_text_config", lambda: config)()
    layers = text.num_hidden_layers
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is not None:
        windows = tuple(window if t == "sliding_attention" else None for t in types)
    elif getattr(text, "use_sliding_window", True) is False or not isinstance(window, int):
        windows = (None,) * layers
    else:
        windows = (window,) * layers
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or 0
    scaling = getattr(text, "logits_scaling", None)
    scale = (1.0 / scaling if scaling else 1.0) * (getattr(text, "logit_scale", None) or 1.0)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    return Arch(
        family=text.model_type,
        windows=windows,
        chunked=bool(getattr(text, "attention_chunk_size", None)) or "chunked_attention" in (types or ()),
        attn_softcap=getattr(text, "attn_logit_softcapping", None) or None,
        final_softcap=getattr(text, "final_logit_softcapping", None) or None,
        logit_scale=float(scale),
        sinks=text.model_type in _SINKS,
        experts=int(experts),
        experts_per_token=int(getattr(text, "num_experts_per_tok", 0) or 0) if experts else 0,
        experts_normalized=bool(experts) and bool(getattr(text, "norm_topk_prob", True)),
        router_aux_coef=(getattr(text, "router_aux_loss_coef", None) or None)
        if experts and getattr(text, "output_router_logits", False) else None,
        tied_head=bool(getattr(config, "tie_word_embeddings", False)),
        head_dim=head_dim,
        attn_scale=float(getattr(text, "attention_multiplier", None)
                         or (getattr(text, "query_pre_attn_scalar", None) or head_dim) ** -0.5),
    )

