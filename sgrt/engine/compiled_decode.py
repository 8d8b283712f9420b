"""``torch.compile`` of the decode step (opt-in: ``Engine(..., compile=True)``).

A forward whose rows all feed one token (a decode batch) runs the whole model as one compiled
graph: Inductor fuses the norms, rotary, SiLU-gating and residual adds around the matmuls. The
paged attention (KV write, gather, SDPA) enters the graph as one opaque custom op per layer,
``sgrt::paged_decode_attention``, so the graph has no data-dependent Python and the KV pool is
updated in place (Inductor re-inplaces the op's declared mutations; no pool copies). Prefill,
extend and verify rows keep the eager path.

Measured on the default model, int4, bfloat16, CPU, 1 thread (medians over 40 steps, same
process): batch 1 no faster than eager (18.1 vs 18.1 ms a step); batch 8 about 5% faster
(46.8 vs 50.1 ms). Compiling costs 40-60 s for the batch-1 graph and 70-80 s more for the
dynamic-batch one, on 2 busy cores. Hence off by default. In float32 the fused kernels round
differently from eager (greedy outputs may differ at near-ties); in bfloat16 too.
"""
from __future__ import annotations

from typing import Optional

import torch

from sgrt.engine.attention import PagedAttention, decode_attention
from sgrt.models.layers import LayerOps


@torch.library.custom_op("sgrt::paged_decode_attention", mutates_args=("k_pool", "v_pool"))
def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                           v_pool: torch.Tensor, layer_id: int, out_slots: torch.Tensor,
                           kv_index: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """One layer's decode attention: store k/v ``[B, Hkv, D]`` at ``out_slots`` ``[B]`` of
    ``k_pool[layer_id]`` / ``v_pool[layer_id]``, gather ``kv_index`` ``[B * max_kv]``, attend with
    q ``[B, H, D]`` -> ``[B, H*D]`` (:func:`sgrt.engine.attention.decode_attention`)."""
    k_layer, v_layer = k_pool[layer_id], v_pool[layer_id]
    k_layer.index_copy_(0, out_slots, k)
    v_layer.index_copy_(0, out_slots, v)
    b, n_kv, head_dim = q.shape[0], k.shape[1], k.shape[2]
    keys = k_layer.index_select(0, kv_index).view(b, -1, n_kv, head_dim)
    values = v_layer.index_select(0, kv_index).view(b, -1, n_kv, head_dim)
    return decode_attention(q, keys, values, mask)


@paged_decode_attention.register_fake
def _(q, k, v, k_pool, v_pool, layer_id, out_slots, kv_index, mask):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class _GraphAttention:
    """The model's attention backend inside the compiled graph: tensors only."""

    def __init__(self, k_pool, v_pool, out_slots, kv_index, mask):
        self.k_pool, self.v_pool = k_pool, v_pool
        self.out_slots, self.kv_index, self.mask = out_slots, kv_index, mask

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        if window is not None:  # (ModelRunner does not compile windowed models)
            raise NotImplementedError("the compiled decode graph has no sliding-window attention")
        return paged_decode_attention(q, k, v, self.k_pool, self.v_pool, layer_id,
                                      self.out_slots, self.kv_index, self.mask)


class CompiledDecode:
    """The compiled decode forward of one model and KV pool.

    Call with the decode rows' token ids and positions (``[B]`` int64) and their
    :class:`PagedAttention` metadata (one group of one-token rows); returns logits ``[B, V]``.
    Compiles lazily on the first call of each shape class (batch 1; batch > 1, with and without
    a padding mask).
    """

    def __init__(self, model, pool):
        self.model = model
        self.pool = pool
        self._fn = torch.compile(self._forward, dynamic=True)

    def _forward(self, input_ids, positions, k_pool, v_pool, out_slots, kv_index, mask):
        attn = _GraphAttention(k_pool, v_pool, out_slots, kv_index, mask)
        # The PyTorch layer ops, which Inductor fuses itself (the native operators mutate their
        # inputs in place and return aliases, which the graph cannot take).
        return self.model.compute_logits(self.model(input_ids, positions, attn, LayerOps()))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention) -> torch.Tensor:
        (group,) = attn.groups
        return self._fn(input_ids, positions, self.pool.k, self.pool.v, attn.out_slots, group.kv_index, group.mask)
