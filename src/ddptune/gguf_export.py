"""A merged model as one GGUF file for llama.cpp and Ollama: weights, vocabulary, chat template.

`write` streams a merged transformers model into one GGUF file (the `gguf` package), a tensor at a time
(never a second copy), with what llama.cpp needs to run it as a chat model: the hyperparameters, the
byte-level BPE vocabulary with its merges, token types and llama.cpp's pre-tokenizer name (recognised
from the tokenizer's own), the bos/eos/end-of-turn ids and the chat template.

Architectures (`ARCHES`, one row per transformers model_type): the Llama family (SmolLM2, Llama 3.x,
with the `rope_freqs` tensor for llama3 rope scaling; tied embeddings write no output tensor), Mistral
(llama.cpp runs it as llama), Qwen2, Qwen3, Qwen3-MoE, Phi-3, Gemma 2 and Gemma 3 (text). What differs
between transformers' model code and llama.cpp's is written into the tensors:
- llama.cpp's llama architecture rotates interleaved pairs (x0, x1), (x2, x3)... where transformers
  rotates the two halves of each head, so the Q and K rows of each head are reordered into pairs
  (row i with row i + head_dim/2); the other architectures read halves, as transformers does.
- Gemma's RMSNorms scale by 1 + w, llama.cpp's by w: each norm weight is written plus one.
- llama.cpp scales attention scores by 1/sqrt(head_dim) (by 1/sqrt(hidden/heads) at Gemma 27B's depth);
  a model whose own scale differs (Gemma's query_pre_attn_scalar) has the ratio folded into Q (its
  q_norm where it has one).
- A mixture's experts (3-D `gate_up_proj`) become llama.cpp's stacked `ffn_gate_exps` and `ffn_up_exps`.
Phi-3's fused `qkv_proj` and `gate_up_proj` are llama.cpp's `attn_qkv` and `ffn_up` as they are.
Sliding windows: Gemma's architectures record one window, and llama.cpp derives which layers slide (Gemma 2:
1 of 2, Gemma 3: 5 of 6), so a model is written where its `layer_types` are that pattern; others record none. Gemma 2's soft-caps are written. What a file cannot
record (another window pattern, a window or soft-caps elsewhere, experts not renormalized, a head
apart from Gemma 2's embedding) is refused in one line by `model_problem`, from the config alone;
export asks `problems` (that, the tokenizer's, the vocabulary's size) before any weight is loaded.

Weights: bf16 and f16 as such, q8_0 through gguf's quantizer; 1-D tensors and routers stay f32, as
llama.cpp's converter keeps them. K-quants are `llama-quantize`'s or `ollama create -q`'s (`quantize_command`).
`modelfile` writes Ollama's Modelfile: the chat template as a Go template, stop tokens, greedy decoding.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from ddptune import arch
from ddptune.data import chat
from ddptune.config import ConfigError

Q = gguf.GGMLQuantizationType
T = gguf.MODEL_TENSOR


@dataclass(frozen=True)
class Family:
    """How one transformers model_type is written as one of llama.cpp's architectures."""
    arch: str                  # llama.cpp's architecture (general.architecture)
    label: str = ""            # what the list of supported families says beside the model_type
    rope_pairs: bool = False   # Q and K rows reordered from transformers' halves into llama.cpp's pairs
    norm_shift: float = 0.0    # added to every RMSNorm weight (Gemma's norms scale by 1 + w)
    window_every: int = 0      # llama.cpp slides the file's window on n - 1 of every n layers; 0: on none
    window_rope_theta: float | None = None  # llama.cpp's fixed rope base on windowed layers; None: the model's
    softcapped: bool = False   # llama.cpp soft-caps attention and output logits by the file's caps (always)
    big_depth: int = 0         # at this depth llama.cpp scales scores by hidden/heads, not head_dim (27B)
    splits: dict = field(default_factory=dict)  # a fused tensor (name in its layer) -> llama.cpp's, in row order


# transformers' model_type -> how llama.cpp holds it
ARCHES = {
    "llama": Family("llama", "SmolLM2, Llama 3.x", rope_pairs=True),
    "mistral": Family("llama", rope_pairs=True),
    "qwen2": Family("qwen2"),
    "qwen3": Family("qwen3"),
    "qwen3_moe": Family("qwen3moe", splits={"mlp.experts.gate_up_proj": (T.FFN_GATE_EXP, T.FFN_UP_EXP)}),
    "phi3": Family("phi3"),
    "gemma2": Family("gemma2", norm_shift=1.0, window_every=2, softcapped=True, big_depth=46),
    "gemma3_text": Family("gemma3", "Gemma 3 text", norm_shift=1.0, window_every=6, window_rope_theta=10000.0,
                          big_depth=62),
}
SUPPORTED = ", ".join(f"{t} ({f.label})" if f.label else t for t, f in ARCHES.items())
OUTTYPES = {"bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16), "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
            "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}
K_QUANTS = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")
ROPE_SCALINGS = ("default", "linear", "llama3")
# the split regexes of tokenizer.json files that llama.cpp knows by name
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"  # Mistral Nemo, Small 3
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# ---------------------------------------------------------------------------------------------
# What refuses, before anything is loaded (from the config and the tokenizer)


def problems(config, tokenizer) -> list[str]:
    """Every reason the model of this transformers config (None: not known, a problem said elsewhere) and
    its tokenizer cannot be written, one line each: what export refuses before any weight is loaded."""
    found = [tokenizer_problem(tokenizer)]
    if config is not None:
        found.append(model_problem(config))
    if config is not None and not found[-1] and (top := max(tokenizer.get_vocab().values())) >= config.vocab_size:
        found.append(f"model.tokenizer: it has ids up to {top}, past the model's {config.vocab_size} embedding rows "
                     "(use the tokenizer the model was trained with)")
    return [p for p in found if p]


def model_problem(config) -> str | None:
    """Why a model of this transformers config cannot be written (one line), or None: everything a file
    cannot record that the config alone tells, so that export refuses before any weight is loaded."""
    model_type = getattr(config, "model_type", None) or "unknown"
    if model_type not in ARCHES:
        return (f"model: {model_type} cannot be exported to GGUF (supported: {SUPPORTED}); export --merge for "
                "transformers instead")
    fam, a = ARCHES[config.model_type], arch.of(config)
    tensors = gguf.MODEL_TENSORS[_model_arch(fam.arch)]
    window = max((w for w in a.windows if w), default=None)
    instead = "; export --merge for transformers instead"
    if not fam.window_every and a.windowed:
        return (f"model: {a.family} attends within a sliding window of {window} tokens, which llama.cpp's {fam.arch} does "
                f"not record (a reader would attend to every earlier token){instead}")
    if fam.window_every and a.windows != _windows(fam, len(a.windows), window):
        n = fam.window_every
        return (f"model: {a.family} slides a window on layers {_slid(a.windows)} (layer_types), where llama.cpp's "
                f"{fam.arch} slides one on {n - 1} of every {n} layers{instead}")
    if (a.attn_softcap is not None, a.final_softcap is not None) != (fam.softcapped, fam.softcapped):
        caps = f"attention {a.attn_softcap}, output {a.final_softcap}"
        return (f"model: {a.family} soft-caps logits ({caps}), where llama.cpp's {fam.arch} caps "
                f"{'both, always' if fam.softcapped else 'neither'}{instead}")
    if a.sinks or a.logit_scale != 1.0:
        return f"model: {a.family}'s attention sinks or output logit scale are not written to GGUF here{instead}"
    if a.moe and not a.experts_normalized:
        return (f"model: {a.family} weighs its chosen experts without renormalizing them (norm_topk_prob false), which "
                f"llama.cpp's {fam.arch} always does{instead}")
    if not a.tied_head and T.OUTPUT not in tensors:
        return (f"model: {a.family}'s output head is apart from its embedding, which llama.cpp's {fam.arch} ties to it"
                f"{instead}")
    scaling = _rope(config)[1]
    allowed = ROPE_SCALINGS if T.ROPE_FREQS in tensors else ("default", "linear")
    if scaling["rope_type"] not in allowed:
        return (f"model: rope scaling {scaling['rope_type']!r} is not written to GGUF for {fam.arch} here (supported: "
                f"{', '.join(allowed)}){instead}")
    theta, scaling = _rope(config, "sliding_attention")
    if fam.window_rope_theta and a.windowed and (theta, scaling["rope_type"]) != (fam.window_rope_theta, "default"):
        return (f"model: {a.family}'s windowed layers rotate with rope base {theta:g} ({scaling['rope_type']}), where "
                f"llama.cpp's {fam.arch} uses {fam.window_rope_theta:g} unscaled{instead}")
    return None


def _windows(fam: Family, layers: int, window: int | None) -> tuple:
    """Each layer's window as llama.cpp derives it for the architecture from the file's one window."""
    n = fam.window_every
    return tuple(window if n and window and i % n < n - 1 else None for i in range(layers))


def _slid(windows: tuple) -> str:
    return ",".join(str(i) for i, w in enumerate(windows) if w) or "none"


def _model_arch(name: str):
    """gguf's MODEL_ARCH for llama.cpp's architecture name."""
    return next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == name)


def pre_tokenizer(tokenizer) -> str | None:
    """llama.cpp's name for how this tokenizer splits text before its merges, read from the
    tokenizer's own pre-tokenizer: GPT-2's regex (`gpt-2`), digits one by one then GPT-2's regex
    (`smollm`), Llama 3's regex (`llama-bpe`), Qwen2's (`qwen2`) or Mistral's tekken; None for any other
    (SentencePiece-style tokenizers, such as Mistral 7B's, are not byte-level BPE: refused)."""
    pre = _backend(tokenizer).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True) and steps[0].get("behavior") == "Isolated":
        return {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2", TEKKEN_SPLIT: "tekken"}.get(
            steps[0].get("pattern", {}).get("Regex"))
    return None


def tokenizer_problem(tokenizer) -> str | None:
    """Why this tokenizer cannot go into a GGUF file as llama.cpp reads it (one line), or None."""
    j = _backend(tokenizer)
    decoder = j.get("decoder") or {}
    # transformers before 5.25 reads a GGUF file's byte-level vocabulary with a decoder sequence around
    # its ByteLevel step (ByteFallback, Fuse, a "▁" replacement): the vocabulary is byte-level all the same
    steps = [d.get("type") for d in decoder.get("decoders", [decoder])]
    if (j.get("model") or {}).get("type") != "BPE" or "ByteLevel" not in steps:
        return ("model.tokenizer: GGUF export writes byte-level BPE vocabularies (Llama 3, SmolLM2, Qwen, GPT-2 "
                "style); this tokenizer is not one: export --merge for transformers instead")
    if pre_tokenizer(tokenizer) is None:
        return ("model.tokenizer: its pre-tokenizer is none that llama.cpp names (gpt-2, smollm, llama-bpe, qwen2, tekken), "
                "so llama.cpp would split text otherwise: export --merge for transformers instead")
    return None


def quantize_command(kind: str, ollama_name: str | None) -> tuple[list[str] | None, str | None]:
    """(the command that turns an f16 GGUF file into `kind`, or None; a problem line, or None):
    llama.cpp's llama-quantize writes a file, Ollama's `ollama create -q` quantizes into its store."""
    if tool := shutil.which("llama-quantize"):
        return [tool], None
    if tool := shutil.which("ollama"):
        if not ollama_name:
            return None, ("--quantize: only ollama is on PATH, which quantizes into its own store: add --ollama NAME, "
                          "or install llama.cpp's llama-quantize for a quantized file")
        return [tool, "create", ollama_name, "-q", _ollama_quant(kind)], None
    return None, (f"--quantize: {kind} needs llama.cpp's llama-quantize or ollama on PATH (install llama.cpp or "
                  "Ollama), or write --outtype q8_0 without it")


def _ollama_quant(kind: str) -> str:
    """Ollama's spelling of a K-quant: q4_K_M."""
    head, *rest = kind.split("_")
    return "_".join([head, *(p.upper() for p in rest)])


def size_estimate(model, tokenizer, outtype: str) -> int:
    """Bytes the GGUF file will take, within a few percent (its metadata is mostly the vocabulary)."""
    per = {"bf16": 2.0, "f16": 2.0, "q8_0": 34 / 32}[outtype]
    weights = sum(int(t.numel()) * (4 if t.dim() == 1 else per) for _, t in _named_tensors(model))
    vocab = sum(len(t) + 16 for t in tokenizer.get_vocab()) + sum(len(str(m)) + 8 for m in _merges(tokenizer))
    return int(weights + vocab + (1 << 20))


# ---------------------------------------------------------------------------------------------
# Writing


def write(model, tokenizer, path: Path, outtype: str, name: str, chat_template: str | None, eot_id: int | None) -> None:
    """The model and its tokenizer as one GGUF file at `path`, its weights in `outtype`. The caller has
    refused what `problems` names (export asks it before loading the model); what only the tensors tell
    (a tensor without a GGUF name, a scale with no query tensor to fold into) is refused here, before the
    file is opened."""
    config = model.config
    family = ARCHES[config.model_type]
    plan = tensor_plan(model, family, OUTTYPES[outtype][0])
    writer = gguf.GGUFWriter(path, family.arch)
    _hparams(writer, config, family, OUTTYPES[outtype][1], name)
    _vocabulary(writer, tokenizer, config.vocab_size, chat_template, eot_id)
    for gguf_name, tensor, qtype, _ in plan:
        shape = tuple(tensor.shape)
        if qtype in (Q.F32, Q.F16):
            dtype = np.float32 if qtype == Q.F32 else np.float16
            writer.add_tensor_info(gguf_name, shape, np.dtype(dtype), tensor.numel() * np.dtype(dtype).itemsize)
        else:
            raw = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
            writer.add_tensor_info(gguf_name, raw, np.dtype(np.uint8), math.prod(raw), raw_dtype=qtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, tensor, qtype, transform in plan:
            writer.write_tensor_data(encode(transform(tensor), qtype).view(_FileWrite))
    finally:
        writer.close()


LAYER = re.compile(r"\.layers\.(\d+)\.(.+)$")


def tensor_plan(model, family: Family, qtype) -> list[tuple]:
    """(GGUF name, tensor, GGUF type, transform) for each tensor the file holds, in order: a fused
    tensor that llama.cpp holds as several is one entry per part (a view of its rows)."""
    c = model.config
    names = gguf.get_tensor_name_map(_model_arch(family.arch), c.num_hidden_layers)
    fold = _query_fold(c, family)
    has_q_norm = any(n.endswith("self_attn.q_norm.weight") for n, _ in model.named_parameters())
    fold_into = "self_attn.q_norm" if has_q_norm else "self_attn.q_proj"
    plan, folded = [], False
    for hf_name, tensor in _named_tensors(model):
        stem, _, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):  # an experts' 3-D parameter, named without a suffix
            stem, suffix = hf_name, "weight"
        layer = LAYER.search(stem)
        if layer and (parts := family.splits.get(layer[2])):
            rows = tensor.shape[-2] // len(parts)
            pieces = [(gguf.TENSOR_NAMES[t].format(bid=layer[1]), tensor.narrow(-2, i * rows, rows))
                      for i, t in enumerate(parts)]
        elif (mapped := names.get_name(stem)) is not None:
            pieces = [(mapped, tensor)]
        else:
            raise ConfigError([f"model: tensor {hf_name} has no GGUF name for {family.arch} (supported: {SUPPORTED})"])
        scale = fold if stem.endswith(fold_into) else 1.0
        folded |= scale != 1.0
        transform = _transform(stem, suffix, family, c, scale)
        for gguf_name, part in pieces:
            plan.append((f"{gguf_name}.{suffix}", part, _tensor_type(gguf_name, part, qtype), transform))
    if fold != 1.0 and not folded:
        raise ConfigError([f"model: its attention scale has no query tensor to be folded into for {family.arch}"])
    theta, scaling = _rope(c)
    if scaling.get("rope_type") == "llama3":
        factors = llama3_rope_factors(theta, arch.of(c).head_dim, scaling)
        plan.insert(0, (gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors, Q.F32, _same))
    return plan


def _named_tensors(model):
    """The model's weights by transformers name; a tied output head once, as the embedding."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        yield name, tensor


def _tensor_type(gguf_name: str, tensor, qtype):
    """1-D tensors and routers stay f32 (as llama.cpp's converter keeps them); a row that q8_0's
    blocks of 32 do not divide is written f16."""
    if tensor.dim() == 1 or gguf_name.endswith(".ffn_gate_inp"):
        return Q.F32
    if qtype == Q.Q8_0 and tensor.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
        return Q.F16
    return qtype


def encode(tensor: torch.Tensor, qtype) -> np.ndarray:
    """A tensor's bytes as GGUF stores them in `qtype` (on the host)."""
    t = tensor.detach().to("cpu")
    if qtype == Q.F32:
        return t.float().contiguous().numpy()
    if qtype == Q.F16:
        return t.to(torch.float16).contiguous().numpy()
    if qtype == Q.BF16:
        return t.to(torch.bfloat16).contiguous().view(torch.uint8).numpy()
    return gguf.quants.quantize(t.float().contiguous().numpy(), qtype)


class _FileWrite(np.ndarray):
    """An array whose `tofile` goes through the Python file object: numpy's own reports a full disk
    as a short write without its errno, this raises OSError(ENOSPC or EFBIG) as any write does."""

    def tofile(self, f, *args, **kwargs):
        f.write(memoryview(np.ascontiguousarray(self).view(np.uint8).reshape(-1)))


def _same(tensor):
    return tensor


def _transform(stem: str, suffix: str, family: Family, c, scale: float):
    """What turns this transformers tensor into llama.cpp's values: rope pairs, Gemma's norm shift, then
    `scale` (the attention scale folded into Q)."""
    steps = []
    if family.rope_pairs and stem.endswith(("self_attn.q_proj", "self_attn.k_proj")):
        kv_heads = c.num_key_value_heads or c.num_attention_heads
        steps.append(_rope_pairs(c.num_attention_heads if stem.endswith("q_proj") else kv_heads))
    if family.norm_shift and stem.endswith("norm") and suffix == "weight":
        steps.append(lambda t: t + family.norm_shift)
    if scale != 1.0:
        steps.append(lambda t: t * scale)
    if not steps:
        return _same
    def apply(t):
        for step in steps:
            t = step(t)
        return t
    return apply


def _query_fold(c, family: Family) -> float:
    """What Q is multiplied by so that llama.cpp's fixed attention scale, 1/sqrt(head_dim) (or
    1/sqrt(hidden/heads) at `big_depth`), gives the model's own (`arch.Arch.attn_scale`)."""
    a = arch.of(c)
    base = c.hidden_size // c.num_attention_heads if c.num_hidden_layers == family.big_depth else a.head_dim
    fold = a.attn_scale * math.sqrt(base)
    return 1.0 if math.isclose(fold, 1.0, rel_tol=1e-9) else fold


def _rope_pairs(heads: int):
    """Reorder each head's rows from transformers' halves to llama.cpp's pairs: row 2j takes row j
    and row 2j+1 takes row j + head_dim/2 (a bias's entries likewise)."""
    def permute(w):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    return permute


def _rope(c, layer_type: str = "full_attention") -> tuple[float, dict]:
    """(rope theta, the rope scaling parameters; rope_type "default" when none) of `layer_type`'s
    layers, from transformers 5's `rope_parameters` (per layer type, as Gemma 3 has them, or one for
    all) or older configs' `rope_theta` and `rope_scaling`."""
    params = dict(getattr(c, "rope_parameters", None) or {})
    params = dict(params.get(layer_type) or params)
    if not params:
        params = dict(getattr(c, "rope_scaling", None) or {}) | {"rope_theta": getattr(c, "rope_theta", 10000.0)}
    params.setdefault("rope_type", params.pop("type", "default"))
    return float(params.get("rope_theta", 10000.0)), params


def llama3_rope_factors(theta: float, head_dim: int, s: dict) -> torch.Tensor:
    """What llama.cpp divides each rope frequency by for llama3 scaling (its `rope_freqs`): 1 for
    wavelengths shorter than original_max_position_embeddings / high_freq_factor, `factor` for those
    longer than it / low_freq_factor, and a smooth blend between."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    old, low, high, factor = (s["original_max_position_embeddings"], s.get("low_freq_factor", 1.0),
                              s.get("high_freq_factor", 4.0), s["factor"])
    smooth = (old / wavelen - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    out = torch.where(wavelen < old / high, torch.ones_like(freqs), torch.where(wavelen > old / low, factor, blend))
    return out.float()


def _hparams(writer, c, family: Family, file_type, name: str) -> None:
    a = arch.of(c)
    head_dim, (theta, scaling) = a.head_dim, _rope(c)
    rotated = scaling.get("partial_rotary_factor") or getattr(c, "partial_rotary_factor", None) or 1.0
    writer.add_name(name)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads or c.num_attention_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * rotated))
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_file_type(file_type)
    if file_type not in (gguf.LlamaFileType.MOSTLY_BF16, gguf.LlamaFileType.MOSTLY_F16):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    if a.windowed:
        writer.add_sliding_window(max(w for w in a.windows if w))
    if family.softcapped:
        writer.add_attn_logit_softcapping(a.attn_softcap)
        writer.add_final_logit_softcapping(a.final_softcap)
    if a.moe:
        writer.add_expert_count(a.experts)
        writer.add_expert_used_count(a.experts_per_token)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)


# ---------------------------------------------------------------------------------------------
# Vocabulary


def _backend(tokenizer) -> dict:
    return json.loads(tokenizer.backend_tokenizer.to_str())


def _merges(tokenizer) -> list[str]:
    """The merges as "left right" strings (tokenizer.json holds them as strings or as pairs)."""
    merges = (_backend(tokenizer).get("model") or {}).get("merges") or []
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def vocabulary(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """Every id's token and llama.cpp token type, padded to the embedding's rows with unused
    `[PADi]` tokens: added special tokens are control tokens, other added tokens user-defined (`problems`
    has refused ids past the embedding's rows)."""
    tokens, types = [f"[PAD{i}]" for i in range(vocab_size)], [int(gguf.TokenType.UNUSED)] * vocab_size
    vocab = tokenizer.get_vocab()
    for token, i in vocab.items():
        tokens[i], types[i] = token, int(gguf.TokenType.NORMAL)
    for i, added in tokenizer.added_tokens_decoder.items():
        types[i] = int(gguf.TokenType.CONTROL if added.special else gguf.TokenType.USER_DEFINED)
    return tokens, types


def _vocabulary(writer, tokenizer, vocab_size: int, chat_template: str | None, eot_id: int | None) -> None:
    tokens, types = vocabulary(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(pre_tokenizer(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(_merges(tokenizer))
    ids = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "unk": tokenizer.unk_token_id,
           "pad": tokenizer.pad_token_id, "eot": eot_id}
    for role, token_id in ids.items():
        if token_id is not None:
            getattr(writer, f"add_{role}_token_id")(token_id)
    ids = tokenizer("a")["input_ids"]  # what the tokenizer adds around a text by itself
    writer.add_add_bos_token(tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id])
    writer.add_add_eos_token(tokenizer.eos_token_id is not None and ids[-1:] == [tokenizer.eos_token_id])
    if chat_template:
        writer.add_chat_template(chat_template)


# ---------------------------------------------------------------------------------------------
# Ollama and quantizing


def turn_pieces(tokenizer) -> dict | None:
    """The chat template as fixed text around each turn, found by rendering turns whose contents are
    markers: {"system" | "user" | "assistant": (before, after), "default": what comes first when
    the conversation has no system turn, "generation": the generation prompt}; None when the
    template does not render a conversation as its turns one after another."""
    m = {r: f"\x02{r[0].upper()}\x03" for r in ("system", "user", "assistant")}
    turn = {r: {"role": r, "content": m[r]} for r in m}
    su = chat.render(tokenizer, [turn["system"], turn["user"]], False)
    sua = chat.render(tokenizer, [turn["system"], turn["user"], turn["assistant"]], False)
    suau = chat.render(tokenizer, [turn["system"], turn["user"], turn["assistant"], turn["user"]], False)
    gen = chat.render(tokenizer, [turn["system"], turn["user"]], True)
    alone = chat.render(tokenizer, [turn["user"]], False)
    if not (sua.startswith(su) and suau.startswith(sua) and gen.startswith(su) and su.count(m["user"]) == 1):
        return None
    user_after = su[su.index(m["user"]) + 3:]
    assistant_after = sua[sua.index(m["assistant"]) + 3:]
    user_before = suau[len(sua):suau.rindex(m["user"])]
    assistant_before = sua[len(su):sua.index(m["assistant"])]
    between = su[su.index(m["system"]) + 3:su.index(m["user"])]
    if not between.endswith(user_before) or not alone.endswith(user_before + m["user"] + user_after):
        return None
    return {"system": (su[:su.index(m["system"])], between[:len(between) - len(user_before)]),
            "user": (user_before, user_after), "assistant": (assistant_before, assistant_after),
            "default": alone[:len(alone) - len(user_before + m["user"] + user_after)], "generation": gen[len(su):]}


def render_turns(pieces: dict, messages: list[dict], generation_prompt: bool) -> str:
    """A conversation rendered from `turn_pieces` (what the Modelfile's template does)."""
    text = "" if messages[0]["role"] == "system" else pieces["default"]
    for msg in messages:
        before, after = pieces[msg["role"]]
        text += before + msg["content"] + after
    return text + (pieces["generation"] if generation_prompt else "")


def modelfile(gguf_name: str, pieces: dict, stops: list[str], max_new_tokens: int, user_prefix: str = "",
              drop: str = "") -> str:
    """Ollama's Modelfile for the file: the turns as a Go template (`user_prefix` goes before each
    user turn's text: a dialogue run's instruction), `drop` removed where a conversation starts
    (the bos text, which llama.cpp adds by itself), stop texts, greedy decoding."""
    def go(text: str) -> str:
        if '"""' in text:
            raise ConfigError(['--ollama: the chat template holds """, which a Modelfile cannot quote'])
        return text.replace("{{", '{{ "{{" }}')

    def start(text: str) -> str:
        return go(text.removeprefix(drop) if drop else text)

    (sb, sa), (ub, ua), (ab, aa) = pieces["system"], pieces["user"], pieces["assistant"]
    template = (f'{{{{ if ne (index .Messages 0).Role "system" }}}}{start(pieces["default"])}{{{{ end }}}}'
                f'{{{{ range .Messages }}}}{{{{ if eq .Role "system" }}}}{start(sb)}{{{{ .Content }}}}{go(sa)}'
                f'{{{{ else if eq .Role "user" }}}}{go(ub + user_prefix)}{{{{ .Content }}}}{go(ua)}'
                f'{{{{ else if eq .Role "assistant" }}}}{go(ab)}{{{{ .Content }}}}{go(aa)}'
                f'{{{{ end }}}}{{{{ end }}}}{go(pieces["generation"])}')
    lines = ["# Ollama Modelfile written by ddptune export: ollama create NAME -f Modelfile",
             f"FROM ./{gguf_name}", f'TEMPLATE """{template}"""']
    lines += [f"PARAMETER stop {json.dumps(s)}" for s in stops]
    lines += ["PARAMETER temperature 0", "PARAMETER top_k 1", "PARAMETER repeat_penalty 1",
              f"PARAMETER num_predict {max_new_tokens}"]  # greedy, as ddptune predict and eval generate
    return "\n".join(lines) + "\n"


class QuantizeFailed(Exception):
    """The quantize tool failed or wrote no GGUF file: the line that says so (the f16 file stays)."""


def quantize(command: list[str], source: Path, kind: str, folder: Path) -> Path | None:
    """Run `quantize_command`'s command on `source` (an f16 GGUF file): llama-quantize writes
    `model-KIND.gguf` beside it, which is returned once it reads as a GGUF file; `ollama create -q`
    reads the Modelfile in `folder` and stores the model in Ollama (None). QuantizeFailed when the
    tool fails or its file is missing, empty or no GGUF (that file is removed; `source` is kept)."""
    tool = Path(command[0]).name
    if tool == "llama-quantize":
        target = source.with_name(f"model-{kind}.gguf")
        argv = [*command, str(source), str(target), kind.upper()]
    else:
        target, argv = None, [*command, "-f", str(folder / "Modelfile")]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        _remove(target)
        raise QuantizeFailed(f"{tool} failed: {last[0][:300]}")
    if target is not None and (problem := gguf_problem(target)):
        _remove(target)
        raise QuantizeFailed(f"{tool} exited 0 but {problem}")
    return target


def _remove(path: Path | None) -> None:
    if path is not None and path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path is not None:
        path.unlink(missing_ok=True)


def gguf_problem(path: Path) -> str | None:
    """What keeps `path` from being a GGUF file that gguf's reader opens (its header and tensor
    index are read; the tensors are mapped, not read), or None."""
    if not path.is_file():
        return f"wrote no {path.name}"
    if path.stat().st_size == 0:
        return f"wrote an empty {path.name}"
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            return f"wrote {path.name} without GGUF's magic bytes at its start"
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the reader of a damaged file fails in many ways (ValueError, IndexError, ...)
        return f"wrote {path.name}, which gguf cannot read ({type(e).__name__}: {' '.join(str(e).split())[:160]})"
    del reader
    return None
