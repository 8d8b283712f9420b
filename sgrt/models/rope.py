"""Rotary position embedding variants: inverse frequencies and the cos/sin tables.

Rotary embedding is Su et al., "RoFormer" (arXiv:2104.09864), in HF's "rotate half" layout. The
variants follow the formulas of their papers as HF ``transformers.modeling_rope_utils`` writes
them, so that a checkpoint's ``rope_scaling`` / ``rope_parameters`` mean the same here:

- ``default``: ``inv_freq[i] = theta ** (-2i / dim)``;
- ``linear``: positions divided by ``factor`` (Chen et al., arXiv:2306.15595);
- ``dynamic``: NTK-aware base ``theta * (factor * L / max_pos - (factor - 1)) ** (dim / (dim - 2))``
  once the context length ``L`` passes ``max_position_embeddings``. A paged KV cache keeps the
  keys rotated as they were written, so here the table is fixed at build time for
  ``L = max_position_embeddings`` (no change from ``default`` inside the trained length), as vLLM
  does;
- ``yarn``: per-frequency blend of interpolation and extrapolation with an attention factor
  (Peng et al., arXiv:2309.00071);
- ``llama3``: Llama 3.1's wavelength-banded scaling;
- ``longrope``: per-frequency ``short_factor`` / ``long_factor`` (Ding et al., arXiv:2402.13753,
  Phi-3); positions past ``original_max_position_embeddings`` use the long factors, per
  position, as vLLM does (HF switches the whole sequence);
- partial rotary (``partial_rotary_factor`` < 1): only the first ``dim = head_dim * factor``
  channels of each head rotate.
"""
from __future__ import annotations

import math

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def rope_parameters_from_hf(cfg: dict, layer_type: str | None = None) -> dict:
    """One rotary dict (``rope_type``, ``rope_theta``, ``factor``, ...) from an HF config, read
    from ``rope_parameters`` (transformers >= 5, possibly nested per layer type) or the older
    ``rope_scaling`` + ``rope_theta`` + ``partial_rotary_factor`` spelling.

    Raises:
        ValueError: an unknown ``rope_type`` (the message names it and the known ones).
    """
    params = cfg.get("rope_parameters") or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    elif any(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention") or next(v for v in params.values() if isinstance(v, dict))
    out = dict(params)
    scaling = cfg.get("rope_scaling") or {}
    out.update({k: v for k, v in scaling.items() if v is not None})
    rope_type = out.pop("type", None)
    out["rope_type"] = out.get("rope_type") or rope_type or "default"
    if out["rope_type"] == "su":  # early Phi-3 spelling of longrope
        out["rope_type"] = "longrope"
    if "rope_theta" not in out:
        out["rope_theta"] = float(cfg.get("rope_theta") or 10000.0)
    if "partial_rotary_factor" not in out and cfg.get("partial_rotary_factor") is not None:
        out["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    if "original_max_position_embeddings" not in out and cfg.get("original_max_position_embeddings"):
        out["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    if out["rope_type"] not in ROPE_TYPES:
        raise ValueError(f"rope_type {out['rope_type']!r} is not supported (supported: {ROPE_TYPES})")
    return out


def rotary_dim(params: dict, head_dim: int) -> int:
    """Channels of each head that rotate."""
    return int(head_dim * float(params.get("partial_rotary_factor") or 1.0))


def inv_freq_and_scale(params: dict, head_dim: int, max_positions: int, long: bool = False
                       ) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim // 2] float32, attention_factor)`` of one rotary variant.

    ``long``: longrope's long factors (positions past the original length); other variants
    ignore it. ``attention_factor`` multiplies cos and sin (yarn, longrope; 1 otherwise).
    """
    rope_type = params.get("rope_type", "default")
    base = float(params["rope_theta"])
    dim = rotary_dim(params, head_dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base ** exponents)
    if params.get("freq_factors") is not None:  # llama.cpp's rope_freqs (Llama 3.1 in a GGUF)
        inv_freq = inv_freq / torch.tensor(params["freq_factors"], dtype=torch.float32)
    factor = params.get("factor")
    if rope_type == "linear":
        return inv_freq / float(factor), 1.0
    if rope_type == "dynamic":
        seq_len = max_positions
        base = base * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** exponents), 1.0
    if rope_type == "llama3":
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        original = float(params.get("original_max_position_embeddings") or max_positions)
        if factor is None:
            factor = max_positions / original
        attention = params.get("attention_factor")
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attention is None:
            attention = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
                         if mscale and mscale_all else get_mscale(factor))
        beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
        extrapolation = 1 - ramp
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv, float(attention)
    if rope_type == "longrope":
        original = float(params["original_max_position_embeddings"])
        if factor is None:
            factor = max_positions / original
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        ext = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * base ** exponents), float(attention)
    return inv_freq, 1.0


# Rows a rotary table starts with; it doubles when a forward needs later positions (grow).
INITIAL_TABLE_ROWS = 4096


class RotaryEmbedding(nn.Module):
    """cos/sin tables ``[rows, rotary_dim]`` of one rotary variant (module docstring), for
    positions ``0 .. rows - 1``: :data:`INITIAL_TABLE_ROWS` at first, grown (:meth:`grow`) as
    longer sequences arrive, up to ``max_positions`` (a 128k-context model's full tables are
    134 MB at head_dim 128; most runs never need them).

    Args:
        params: the rotary dict (:func:`rope_parameters_from_hf`).
        head_dim: channels per head (``rotary_dim`` of them rotate).
        max_positions: the model's ``max_position_embeddings`` (scaled variants derive their
            frequencies from it; the tables never grow past it).
    """

    def __init__(self, params: dict, head_dim: int, max_positions: int, device: torch.device):
        super().__init__()
        self.params, self.head_dim, self.max_positions = params, head_dim, max_positions
        self.rotary_dim = rotary_dim(params, head_dim)
        self._fill(min(max_positions, INITIAL_TABLE_ROWS), device)

    def _fill(self, rows: int, device: torch.device) -> None:
        """(Re)compute the tables for ``rows`` positions: every row as a full table computes it."""
        params, max_positions = self.params, self.max_positions
        t = torch.arange(rows, dtype=torch.float32)
        inv, scale = inv_freq_and_scale(params, self.head_dim, max_positions)
        freqs = torch.outer(t, inv)
        if params.get("rope_type") == "longrope":
            original = int(params["original_max_position_embeddings"])
            if max_positions > original:
                inv_long, scale = inv_freq_and_scale(params, self.head_dim, max_positions, long=True)
                freqs[original:] = torch.outer(t[original:], inv_long)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scale).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(device), persistent=False)

    @property
    def rows(self) -> int:
        return self.cos.shape[0]

    def grow(self, positions: int) -> bool:
        """Cover positions ``0 .. positions - 1`` (at least doubling, at most ``max_positions``);
        True if the tables were replaced (their holders, the decode plan, must take the new ones).
        Positions past ``max_positions`` stay uncovered (the engine refuses such requests)."""
        if positions <= self.rows or self.rows >= self.max_positions:
            return False
        self._fill(min(self.max_positions, max(positions, 2 * self.rows)), self.cos.device)
        return True

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]`` int64 -> cos, sin ``[T, rotary_dim]`` in ``dtype``."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)
