"""Building a :class:`~sgrt.models.layers.CausalLM` over a weight store's tensors.

The model is made on the meta device (nothing allocated) and each weight is put in place as the
store's own tensor, a view of its memory-mapped file (:mod:`sgrt.models.weight_store`): float
weights become the parameters, the native kernel's layers (:class:`~sgrt.models.quant_native.
GroupLinear`) take their streams as they are, and a quantized input embedding reads the LM
head's or its own table in place (:class:`~sgrt.models.quant_native.GroupEmbedding`). Only
torch's packed kernels (CUDA, CPUs without AVX2) copy: their layouts are the device's, packed
here from the store's codes. How each weight was packed is in the store's ``meta``
(:mod:`sgrt.models.weight_packer`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sgrt.models.config import ModelConfig
from sgrt.models.weight_store import DamagedStore, WeightStore

FORMS = ("dense", "group", "int8_torch", "int4_torch")
EMBEDDINGS = ("dense", "head", "group")
QUANTIZATIONS = ("none", "int8", "int4")


def _parameter(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def quantized_layer(store: WeightStore, name: str, form: dict[str, Any], activations: str,
                    device: torch.device) -> nn.Module:
    """The layer a ``"group"`` / ``"int8_torch"`` / ``"int4_torch"`` form of weight ``name`` runs
    (``activations``: the int4 projections' activation precision, :func:`sgrt.kernels.woq.
    check_activations`; int8 layers and the LM head keep ``"int16"``)."""
    from sgrt.models.quant import GroupLinear, Int4Linear, Int8Linear

    n, k, bits = form["rows"], form["cols"], form["bits"]
    if form["form"] == "group":
        extra = {}
        if f"{name}.scales" in store.tensors:  # (the AVX-512 BF16 build: codes beside their scales)
            extra = {"scales": store[f"{name}.scales"], "offsets": store[f"{name}.offsets"]}
        return GroupLinear.from_stream(store[f"{name}.stream"], form["stream_bits"], n, k, bits,
                                       activations=activations if bits == 4 else "int16", **extra)
    if form["form"] == "int8_torch":
        return Int8Linear(store[f"{name}.qweight"].to(device), store[f"{name}.scales"].to(device))
    packed = store[f"{name}.codes"]
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(n, k)
    return Int4Linear(codes, store[f"{name}.scales_and_zeros"].transpose(0, 1), 32, device)


def _tensor(store: WeightStore, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = store[name]
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise DamagedStore(store.folder, f"tensor {name!r} is {str(t.dtype).removeprefix('torch.')} "
                                         f"{list(t.shape)}; the model takes {str(dtype).removeprefix('torch.')} "
                                         f"{list(shape)}")


def _check_form(store: WeightStore, name: str, form: Any, shape: tuple[int, int], dtype: torch.dtype) -> None:
    """``form`` (a manifest's) is one the model's weight ``name`` of ``shape`` can take, and the
    store holds its tensors as that form lays them out."""
    from sgrt.kernels import woq
    from sgrt.models.quant import GroupLinear

    if not isinstance(form, dict) or form.get("form") not in FORMS:
        raise DamagedStore(store.folder, f"{name} has no known form ({form!r})")
    n, k, bits = form.get("rows"), form.get("cols"), form.get("bits")
    if (n, k) != tuple(shape):
        raise DamagedStore(store.folder, f"{name} is packed as {n} x {k}; the model's is {shape[0]} x {shape[1]}")
    if form["form"] == "dense":
        if name != "embed_tokens":  # (the embedding's dense table is a parameter, checked as one)
            _tensor(store, f"{name}.weight", dtype, shape)
        return
    if bits not in (4, 8) or k % 32 or (form["form"] == "group" and not GroupLinear.supports(n, k, torch.device("cpu"))):
        raise DamagedStore(store.folder, f"{name}: {form['form']} with {bits!r} bits cannot hold {n} x {k}")
    g = k // 32
    if form["form"] == "int8_torch":
        _tensor(store, f"{name}.qweight", torch.int8, (n, k))
        _tensor(store, f"{name}.scales", torch.bfloat16, (n,))
    elif form["form"] == "int4_torch":
        _tensor(store, f"{name}.codes", torch.uint8, (n, k // 2))
        _tensor(store, f"{name}.scales_and_zeros", torch.bfloat16, (n, g, 2))
    elif f"{name}.scales" in store.tensors:  # (the AVX-512 BF16 build's codes beside their scales)
        if form.get("stream_bits") != bits:
            raise DamagedStore(store.folder, f"{name}: kernel bits {form.get('stream_bits')!r} for {bits}-bit codes")
        _tensor(store, f"{name}.stream", torch.uint8, (n * k * bits // 8,))
        _tensor(store, f"{name}.scales", torch.float16, (n, g))
        _tensor(store, f"{name}.offsets", torch.float16, (n, g))
    else:  # (the AVX2 build's stream: its size follows from the kernel bits)
        kernel_bits = form.get("stream_bits")
        if not isinstance(kernel_bits, int) or woq.stream_format(kernel_bits)[0] not in ((4,) if bits == 4 else (5, 8)):
            raise DamagedStore(store.folder, f"{name}: kernel bits {kernel_bits!r} for {bits}-bit codes")
        if woq.is_kquant(kernel_bits) and (bits != 4 or k % woq.KQ_SUPER or kernel_bits != woq.KQ4_BITS):
            raise DamagedStore(store.folder, f"{name}: a K-quant stream (kernel bits {kernel_bits!r}) cannot hold "
                                             f"{n} x {k} {bits}-bit codes")
        _tensor(store, f"{name}.stream", torch.uint8, (woq.stream_bytes(n, k, kernel_bits),))


def check_store(store: WeightStore, model: Any, dtype: torch.dtype) -> None:
    """The store holds what ``model`` (made on the meta device) takes: its ``meta`` names a
    quantization and a source of the input embedding; every projection, and the LM head and
    embedding where they have one, a form of its own shape whose tensors are in the store with the
    dtypes and shapes that form lays out; every parameter the store holds has the model's dtype
    and the parameter's shape.

    Raises:
        DamagedStore: anything else (names what; the manifest's layout against ``weights.bin`` was
            checked when the store was opened).
    """
    from sgrt.models.layers import FUSED_PROJECTIONS

    meta, config = store.meta, model.config
    forms, embedding = meta.get("forms"), meta.get("embedding")
    if not isinstance(forms, dict) or embedding not in EMBEDDINGS or meta.get("quantization") not in QUANTIZATIONS:
        raise DamagedStore(store.folder, "its manifest does not say how the weights were packed")
    shapes = {f"layers.{i}.{proj}": tuple(getattr(layer, proj).weight.shape)
              for i, layer in enumerate(model.layers) for proj in FUSED_PROJECTIONS}
    missing = [name for name in shapes if name not in forms]
    if missing:
        raise DamagedStore(store.folder, f"no form for {missing[0]}")
    shapes["lm_head"] = shapes["embed_tokens"] = (config.vocab_size, config.hidden_size)
    for name, form in forms.items():
        if name not in shapes:
            raise DamagedStore(store.folder, f"a form for {name!r}, which the model has no weight for")
        _check_form(store, name, form, shapes[name], dtype)
    quantized = meta["quantization"] != "none"
    if quantized != ("lm_head" in forms):
        raise DamagedStore(store.folder, f"quantization {meta['quantization']} with"
                                         f"{'out' if quantized else ''} a form for the LM head")
    table = {"head": "lm_head", "group": "embed_tokens"}.get(embedding)
    if table is not None and (forms.get(table, {}).get("form") != "group"
                              or (embedding == "head") != bool(config.tie_word_embeddings)):
        raise DamagedStore(store.folder, f"the input embedding is read from {embedding!r}, which holds no such table")
    for name, p in model.named_parameters():
        if name in store.tensors:  # (the packer writes every parameter in the model's dtype)
            _tensor(store, name, dtype, tuple(p.shape))


def build_model(store: WeightStore, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                int4_activations: str = "int16") -> Any:
    """The model over ``store``'s weights (module docstring), in eval mode, quantization and LM head
    as packed; CPU weights stay the store's mapped tensors.

    Raises:
        DamagedStore: (a ModelLoadError) the store does not hold what this model takes
            (:func:`check_store`), or lacks a weight it needs: a stale or damaged store.
    """
    from sgrt.models.layers import CausalLM
    from sgrt.models.quant import GROUP_HEAD_MAX_ROWS, INT8_HEAD_MAX_ROWS, GroupLinear, Int8Linear
    from sgrt.models.quant_native import GroupEmbedding

    model = CausalLM(config, dtype=dtype, device=device, materialize=False)
    check_store(store, model, dtype)
    forms: dict[str, dict[str, Any]] = store.meta["forms"]
    for name, form in forms.items():  # (dense ones are parameters, set below)
        if form["form"] != "dense" and name not in ("lm_head", "embed_tokens"):
            layer_name, proj = name.rsplit(".", 1)
            setattr(model.get_submodule(layer_name), proj, quantized_layer(store, name, form, int4_activations, device))
    for pname, _ in list(model.named_parameters()):
        if pname in store.tensors:
            module_name, attr = pname.rsplit(".", 1) if "." in pname else ("", pname)
            setattr(model.get_submodule(module_name), attr, _parameter(store[pname]))
    head = forms.get("lm_head")
    if head is not None and head["form"] != "dense":  # (a dense one is lm_head's weight, or tied)
        model.logits_head = quantized_layer(store, "lm_head", head, "int16", device)
        model.lm_head = None  # (no float copy of an untied head is kept)
    embedding = store.meta["embedding"]
    if embedding == "head":
        model.embed_tokens = GroupEmbedding(model.logits_head, dtype)
    elif embedding == "group":
        model.embed_tokens = GroupEmbedding(quantized_layer(store, "embed_tokens", forms["embed_tokens"],
                                                            "int16", device), dtype)
    if config.tie_word_embeddings and embedding == "dense" and isinstance(model.logits_head, nn.Module):
        # a tied model keeps its float table: past these rows it is the better head (quant.py)
        model.logits_head_max_rows = (INT8_HEAD_MAX_ROWS if isinstance(model.logits_head, Int8Linear)
                                      else GROUP_HEAD_MAX_ROWS if isinstance(model.logits_head, GroupLinear)
                                      else model.logits_head_max_rows)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise DamagedStore(store.folder, f"no tensor for {missing[0]}")
    model.quantization = store.meta["quantization"]
    if device.type != "cpu":
        model.to(device)
    return model
