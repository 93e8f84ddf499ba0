"""A merged model as one GGUF file for llama.cpp and Ollama: weights, vocabulary, chat template.

`write` streams a merged transformers model into one GGUF file through the `gguf` package, one
tensor at a time (the host holds the model and one converted tensor, never a second copy), with
what llama.cpp needs to run it as a chat model: the hyperparameters, the byte-level BPE vocabulary
with its merges, token types and llama.cpp's name for its pre-tokenizer (recognised from the
tokenizer's own pre-tokenizer, so that llama.cpp splits text as the run's tokenizer did), the
bos/eos/end-of-turn ids and the chat template.

Architectures: the Llama family (SmolLM2, Llama 3.x, with the `rope_freqs` tensor for llama3 rope
scaling; tied embeddings write no output tensor), Mistral (llama.cpp runs it as llama), Qwen2 and
Qwen3. llama.cpp's llama architecture rotates interleaved pairs (x0, x1), (x2, x3)... where
transformers rotates the two halves of each head, so the Q and K rows of each head are reordered
into pairs (row i with row i + head_dim/2); Qwen's rope reads halves, as transformers does.

Weights: bf16 and f16 as such, q8_0 through gguf's own quantizer (blocks of 32 with an f16 scale);
1-D tensors (norms, rope factors) stay f32, as llama.cpp's converter keeps them. K-quants are
llama.cpp's (`llama-quantize`) or Ollama's (`ollama create -q`): `quantize_command` finds one.
`modelfile` writes Ollama's Modelfile: the chat template as a Go template, its stop tokens and
greedy decoding, as `ddptune predict` generates.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import torch

from ddptune import arch
from ddptune.data import chat
from ddptune.config import ConfigError

# transformers' model_type -> (GGUF architecture, whether Q and K rows are reordered into rope pairs)
ARCHES = {"llama": ("llama", True), "mistral": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False)}
SUPPORTED = "llama (SmolLM2, Llama 3.x), mistral, qwen2, qwen3"
Q = gguf.GGMLQuantizationType
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
# What refuses, before anything is loaded


def architecture_problem(model_type: str | None) -> str | None:
    """Why a model of this transformers model_type cannot be written (one line), or None (also for
    None: not known yet)."""
    if model_type is None or model_type in ARCHES:
        return None
    return f"model: {model_type} cannot be exported to GGUF (supported: {SUPPORTED}); export --merge for transformers instead"


def model_problem(config) -> str | None:
    """Why this model config cannot be written (one line), or None."""
    if problem := architecture_problem(getattr(config, "model_type", None) or "unknown"):
        return problem
    if (a := arch.of(config)).windowed:
        return (f"model: {a.family} attends within a sliding window of {max(w for w in a.windows if w)} tokens, which is not "
                "written to GGUF here (a reader would attend to every earlier token); export --merge for transformers instead")
    scaling = _rope(config)[1]
    if scaling.get("rope_type", "default") not in ROPE_SCALINGS:
        return (f"model: rope scaling {scaling.get('rope_type')!r} is not written to GGUF here (supported: "
                f"{', '.join(ROPE_SCALINGS)}); export --merge for transformers instead")
    return None


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
    """The model and its tokenizer as one GGUF file at `path`, its weights in `outtype`."""
    config = model.config
    if problem := model_problem(config) or tokenizer_problem(tokenizer):
        raise ConfigError([problem])
    arch, permuted = ARCHES[config.model_type]
    plan = tensor_plan(model, arch, permuted, OUTTYPES[outtype][0])
    writer = gguf.GGUFWriter(path, arch)
    _hparams(writer, config, OUTTYPES[outtype][1], name)
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


def tensor_plan(model, arch: str, permuted: bool, qtype) -> list[tuple]:
    """(GGUF name, tensor, GGUF type, transform) for each tensor the file holds, in order."""
    c = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
    plan = []
    for hf_name, tensor in _named_tensors(model):
        stem, _, suffix = hf_name.rpartition(".")
        mapped = names.get_name(stem)
        if mapped is None:
            raise ConfigError([f"model: tensor {hf_name} has no GGUF name for {arch} (supported: {SUPPORTED})"])
        transform = _same
        if permuted and stem.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            transform = _rope_pairs(heads if stem.endswith("q_proj") else kv_heads)
        plan.append((f"{mapped}.{suffix}", tensor, _tensor_type(tensor, qtype), transform))
    theta, scaling = _rope(c)
    if scaling.get("rope_type") == "llama3":
        factors = llama3_rope_factors(theta, _head_dim(c), scaling)
        plan.insert(0, (gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors, Q.F32, _same))
    return plan


def _named_tensors(model):
    """The model's weights by transformers name; a tied output head once, as the embedding."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        yield name, tensor


def _tensor_type(tensor, qtype):
    """1-D tensors stay f32; a row that q8_0's blocks of 32 do not divide is written f16."""
    if tensor.dim() == 1:
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


def _rope_pairs(heads: int):
    """Reorder each head's rows from transformers' halves to llama.cpp's pairs: row 2j takes row j
    and row 2j+1 takes row j + head_dim/2 (a bias's entries likewise)."""
    def permute(w):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    return permute


def _head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _rope(c) -> tuple[float, dict]:
    """(rope theta, the rope scaling parameters; rope_type "default" when none), from transformers
    5's `rope_parameters` or older configs' `rope_theta` and `rope_scaling`."""
    params = dict(getattr(c, "rope_parameters", None) or {})
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


def _hparams(writer, c, file_type, name: str) -> None:
    head_dim = _head_dim(c)
    theta, scaling = _rope(c)
    writer.add_name(name)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads or c.num_attention_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_file_type(file_type)
    if file_type not in (gguf.LlamaFileType.MOSTLY_BF16, gguf.LlamaFileType.MOSTLY_F16):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))


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
    `[PADi]` tokens: added special tokens are control tokens, other added tokens user-defined."""
    tokens, types = [f"[PAD{i}]" for i in range(vocab_size)], [int(gguf.TokenType.UNUSED)] * vocab_size
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ConfigError([f"model.tokenizer: it has ids up to {max(vocab.values())}, past the model's "
                           f"{vocab_size} embedding rows (use the tokenizer the model was trained with)"])
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
