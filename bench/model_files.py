"""Random-weight model files at the sizes agents run (1B, 8B), for benchmarks and memory tests.

:func:`write_gguf` writes a GGUF with ``gguf``'s ``GGUFWriter`` a tensor at a time (tensor infos
first, then each tensor's bytes), so an 8B file never sits in memory: quantized tensors are random
blocks whose float16 scales are set to small values (every code random), float ones random
normals. The tokenizer is SmolLM2's (49,152 tokens), copied from the default model's GGUF, so
the files load with a real tokenizer and chat template. :func:`write_hf_folder` writes a bfloat16
HF folder of a transformers config (names and shapes from transformers' own class, built on the
meta device) with the same tokenizer.

Shapes (:data:`SHAPES`) follow the public configs of Llama 3.2 1B, Llama 3.1 8B and Qwen2.5 1.5B /
7B, with SmolLM2's vocabulary. Not for quality: the outputs are noise.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# float16 fields of each GGML block type: (byte offset, multiple of the block's scale), so that a
# block's weights centre on zero (a random model whose weights were all positive overflows to
# inf in a few layers, which no engine then runs at its real speed): Q4_1's m = -7.5 d, Q5_1's
# -15.5 d; the K-quants' dmin times a random 6-bit min ~ their d times a random 6-bit scale
# times half the code range.
_FIELDS = {"Q4_0": ((0, 1.0),), "Q4_1": ((0, 1.0), (2, -7.5)), "Q5_0": ((0, 1.0),), "Q5_1": ((0, 1.0), (2, -15.5)),
           "Q8_0": ((0, 1.0),), "Q4_K": ((0, 1.0), (2, 7.5)), "Q5_K": ((0, 1.0), (2, 15.5)), "Q6_K": ((208, 1.0),),
           # (types sgrt's kernels have no form for, each dequantized at load: Q2_K's dmin times a
           # random 4-bit min ~ its d times a random 4-bit scale times half the code range)
           "Q2_K": ((80, 1.0), (82, 1.5)), "Q3_K": ((108, 1.0),), "IQ4_NL": ((0, 1.0),), "IQ4_XS": ((0, 1.0),)}
# a scale per type, for weights of ~0.01-0.05
_SCALE = {"Q4_0": 0.004, "Q4_1": 0.004, "Q5_0": 0.002, "Q5_1": 0.002, "Q8_0": 0.0003, "Q4_K": 0.0002,
          "Q5_K": 0.0001, "Q6_K": 0.0001, "Q2_K": 0.0005, "Q3_K": 0.0002, "IQ4_NL": 0.0002, "IQ4_XS": 0.00001}
_FLOATS = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # (BF16: its bits, as gguf writes them)


@dataclass(frozen=True)
class Shape:
    """A decoder's shape (``arch``: the GGUF architecture, ``llama`` or ``qwen2``)."""

    arch: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    context: int = 8192
    rope_theta: float = 500000.0
    tied: bool = True
    qkv_bias: bool = False


SHAPES = {
    "llama-1b": Shape("llama", 16, 2048, 8192, 32, 8, tied=True),
    "llama-8b": Shape("llama", 32, 4096, 14336, 32, 8, tied=False),
    "qwen2-1.5b": Shape("qwen2", 28, 1536, 8960, 12, 2, rope_theta=1000000.0, tied=True, qkv_bias=True),
    "qwen2-7b": Shape("qwen2", 28, 3584, 18944, 28, 4, rope_theta=1000000.0, tied=False, qkv_bias=True),
}


@dataclass
class Types:
    """GGML types by tensor role (``attn_q``, ``attn_k``, ``attn_v``, ``attn_output``, ``ffn_gate``,
    ``ffn_up``, ``ffn_down``, ``token_embd``, ``output``); ``down_every``: a second type for
    ``ffn_down`` / ``attn_v`` on every ``n``-th layer (Q4_K_M's mix), as ``{role: (n, type)}``."""

    default: str = "Q4_1"
    roles: dict[str, str] = field(default_factory=dict)
    every: dict[str, tuple[int, str]] = field(default_factory=dict)

    def of(self, role: str, layer: int | None = None) -> str:
        if layer is not None and role in self.every and layer % self.every[role][0] == 0:
            return self.every[role][1]
        return self.roles.get(role, self.default)


# The 1B file (Q4_1 projections, Q8_0 embedding) and a Q4_K_M-like mix.
Q4_1_FILE = Types("Q4_1", {"token_embd": "Q8_0", "output": "Q8_0"})
Q4_K_M = Types("Q4_K", {"token_embd": "Q4_K", "output": "Q6_K"}, {"ffn_down": (2, "Q6_K"), "attn_v": (2, "Q6_K")})


def _tokenizer_fields() -> dict:
    """SmolLM2's tokenizer as GGUF key -> value (from the default model's GGUF)."""
    import gguf

    from sgrt.models.specs import default_gguf_path

    r = gguf.GGUFReader(str(default_gguf_path()))
    out = {}
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"):
        f = r.fields.get(key)
        if f is not None:
            out[key] = f.contents()
    return out


def _random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d = rng.uniform(0.5, 1.5, size=(rows, cols // block)) * _SCALE[kind]
    for at, times in _FIELDS[kind]:
        raw[..., at:at + 2] = (d * times).astype(np.float16).view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def _tensor(kind: str, rows: int, cols: int | None, rng: np.random.Generator) -> np.ndarray:
    if kind in _FLOATS:
        shape = (rows,) if cols is None else (rows, cols)
        std = 0.02 if cols is not None else 0.1
        w = rng.standard_normal(shape, dtype=np.float32) * std + (1.0 if cols is None else 0.0)
        if kind == "BF16":  # (rounded to nearest even)
            bits = w.view(np.uint32)
            return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return w.astype(_FLOATS[kind])
    return _random_blocks(kind, rows, cols, rng)


def gguf_tensors(shape: Shape, types: Types, vocab: int) -> list[tuple[str, str, int, int | None]]:
    """``(GGUF name, type, rows, cols)`` of every tensor of a file of ``shape`` (``cols`` None for a
    vector), in file order."""
    hd = shape.hidden // shape.heads
    q, kv = shape.heads * hd, shape.kv_heads * hd
    out = [("token_embd.weight", types.of("token_embd"), vocab, shape.hidden)]
    for i in range(shape.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", "F32", shape.hidden, None),
                (b + "attn_q.weight", types.of("attn_q", i), q, shape.hidden),
                (b + "attn_k.weight", types.of("attn_k", i), kv, shape.hidden),
                (b + "attn_v.weight", types.of("attn_v", i), kv, shape.hidden)]
        if shape.qkv_bias:
            out += [(b + "attn_q.bias", "F32", q, None), (b + "attn_k.bias", "F32", kv, None),
                    (b + "attn_v.bias", "F32", kv, None)]
        out += [(b + "attn_output.weight", types.of("attn_output", i), shape.hidden, q),
                (b + "ffn_norm.weight", "F32", shape.hidden, None),
                (b + "ffn_gate.weight", types.of("ffn_gate", i), shape.ffn, shape.hidden),
                (b + "ffn_up.weight", types.of("ffn_up", i), shape.ffn, shape.hidden),
                (b + "ffn_down.weight", types.of("ffn_down", i), shape.hidden, shape.ffn)]
    out.append(("output_norm.weight", "F32", shape.hidden, None))
    if not shape.tied:
        out.append(("output.weight", types.of("output"), vocab, shape.hidden))
    return out


def write_gguf(path: Path, shape: Shape, types: Types, seed: int = 0, vocab: int | None = None) -> Path:
    """Write a random-weight GGUF of ``shape`` with ``types`` at ``path`` (module docstring).
    ``vocab``: keep only the tokenizer's first ``vocab`` tokens (>= 256 + its 17 special tokens)
    and the merges that make them, for tests: SmolLM2's merge ``i`` makes token ``252 + i``, so
    the cut tokenizer is a whole BPE tokenizer, read from a GGUF in a fraction of the time."""
    import gguf

    tok = _tokenizer_fields()
    if vocab is not None:
        first_merged = len(tok["tokenizer.ggml.tokens"]) - len(tok["tokenizer.ggml.merges"])
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            tok[key] = tok[key][:vocab]
        tok["tokenizer.ggml.merges"] = tok["tokenizer.ggml.merges"][:max(0, vocab - first_merged)]
    vocab = len(tok["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name(f"random {shape.arch} {path.stem}")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(shape.hidden // shape.heads)
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(tok["tokenizer.ggml.tokens"])
    w.add_token_types(tok["tokenizer.ggml.token_type"])
    w.add_token_merges(tok["tokenizer.ggml.merges"])
    w.add_bos_token_id(tok["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(tok["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(bool(tok.get("tokenizer.ggml.add_bos_token", False)))
    if "tokenizer.chat_template" in tok:
        w.add_chat_template(tok["tokenizer.chat_template"])
    tensors = gguf_tensors(shape, types, vocab)
    for name, kind, rows, cols in tensors:
        qt = gguf.GGMLQuantizationType[kind]
        if kind in _FLOATS:
            n = rows * (cols or 1)
            dims = (rows,) if cols is None else (rows, cols)
            dtype = np.dtype(_FLOATS[kind])
            w.add_tensor_info(name, dims, dtype, n * dtype.itemsize, raw_dtype=qt if kind == "BF16" else None)
        else:
            block, size = gguf.GGML_QUANT_SIZES[qt]
            w.add_tensor_info(name, (rows, cols // block * size), np.dtype(np.uint8), rows * (cols // block) * size,
                              raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, kind, rows, cols in tensors:
        w.write_tensor_data(_tensor(kind, rows, cols, rng))
    w.close()
    return path


def write_hf_folder(folder: Path, shape: Shape, seed: int = 0) -> Path:
    """Write a random bfloat16 HF folder of ``shape`` (transformers' Llama / Qwen2 class for the
    names and shapes, on the meta device; weights ~N(0, 0.02), norms 1) with SmolLM2's tokenizer."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from sgrt.models.loader import tokenizer_folder

    hd = shape.hidden // shape.heads
    common = dict(vocab_size=49152, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                  num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.context,
                  rope_theta=shape.rope_theta, tie_word_embeddings=shape.tied, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", head_dim=hd)
    if shape.arch == "qwen2":
        config, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    with torch.device("meta"):
        model = cls(config)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in model.state_dict().items():
        if shape.tied and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            state[name] = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            state[name] = (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    del state
    config.save_pretrained(folder)
    for f in tokenizer_folder().iterdir():
        if f.name != "generation_config.json":
            (folder / f.name).write_bytes(f.read_bytes())
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return folder
