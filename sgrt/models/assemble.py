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

from sgrt.errors import ModelLoadError
from sgrt.models.config import ModelConfig
from sgrt.models.weight_store import WeightStore


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


def build_model(store: WeightStore, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                int4_activations: str = "int16") -> Any:
    """The model over ``store``'s weights (module docstring), in eval mode, quantization and LM head
    as packed; CPU weights stay the store's mapped tensors.

    Raises:
        ModelLoadError: the store lacks a weight the model needs (a stale or damaged store).
    """
    from sgrt.models.layers import CausalLM
    from sgrt.models.quant import GROUP_HEAD_MAX_ROWS, INT8_HEAD_MAX_ROWS, GroupLinear, Int8Linear
    from sgrt.models.quant_native import GroupEmbedding

    forms: dict[str, dict[str, Any]] = store.meta["forms"]
    model = CausalLM(config, dtype=dtype, device=device, materialize=False)
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
        raise ModelLoadError(f"weight store {store.folder}: no tensor for {missing[0]} (stale or damaged; "
                             f"delete the folder to rebuild it)")
    model.quantization = store.meta["quantization"]
    if device.type != "cpu":
        model.to(device)
    return model
