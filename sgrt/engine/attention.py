"""Attention over a ragged batch whose K/V live in the KV pool (gather + SDPA).

Each row of a forward is a request feeding ``q_len`` new tokens after ``kv_len - q_len`` tokens
whose K/V are already in the pool. Rows are padded to ``[B, max_q]`` queries and
``[B, max_kv]`` keys gathered by slot index; one ``scaled_dot_product_attention`` call per layer
serves extend (prefill) and decode rows alike. A faster kernel may replace this on CUDA behind the
same ``forward`` contract.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgrt.engine.kv_pool import KVPool


@dataclass
class RowSpec:
    """One row of a ragged forward: its full context's slots and how many of them are new."""

    slots: list[int]  # KV slots of every context token, old then new (len = kv_len)
    q_len: int  # new tokens fed in this forward (the last q_len of ``slots``)


class PagedAttention:
    """Attention metadata for one forward, and the per-layer attention call.

    Args:
        pool: the KV pool to write new K/V into and to read context from.
        rows: one :class:`RowSpec` per batch row, in the order the tokens are laid out.
    """

    def __init__(self, pool: KVPool, rows: list[RowSpec]):
        self.pool = pool
        device = pool.k.device
        self.batch = len(rows)
        q_lens = [r.q_len for r in rows]
        kv_lens = [len(r.slots) for r in rows]
        self.max_q = max(q_lens)
        self.max_kv = max(kv_lens)
        self.num_tokens = sum(q_lens)
        new_slots: list[int] = []
        for r in rows:
            new_slots.extend(r.slots[len(r.slots) - r.q_len:])
        self.out_slots = torch.tensor(new_slots, dtype=torch.long, device=device)
        # One row of length 1 with no padding (batch-1 decode) needs neither mask nor scatter.
        self.simple = self.batch == 1 and self.max_q == 1
        padded = torch.zeros(self.batch, self.max_kv, dtype=torch.long)
        for i, r in enumerate(rows):
            padded[i, : len(r.slots)] = torch.tensor(r.slots, dtype=torch.long)
        self.kv_index = padded.view(-1).to(device)
        if self.simple:
            self.mask = None
            self.token_index = None
            return
        # token_index maps each flattened new token to its place in the [B * max_q] grid.
        token_index = []
        for i, q in enumerate(q_lens):
            token_index.extend(range(i * self.max_q, i * self.max_q + q))
        self.token_index = torch.tensor(token_index, dtype=torch.long, device=device)
        q_pos = torch.arange(self.max_q).view(1, -1, 1)  # [1, max_q, 1]
        k_pos = torch.arange(self.max_kv).view(1, 1, -1)  # [1, 1, max_kv]
        kv_len_t = torch.tensor(kv_lens).view(-1, 1, 1)
        start_t = (kv_len_t - torch.tensor(q_lens).view(-1, 1, 1))
        # A query at q (absolute position start+q) sees keys 0..start+q; padded queries see key 0
        # only so that their softmax stays finite.
        allowed = k_pos <= (start_t + q_pos)
        allowed = allowed & (k_pos < kv_len_t)
        pad_q = q_pos >= torch.tensor(q_lens).view(-1, 1, 1)
        allowed = allowed | (pad_q & (k_pos == 0))
        self.mask = allowed.unsqueeze(1).to(device)  # [B, 1, max_q, max_kv]

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[T, H, D]``, k/v ``[T, Hkv, D]`` -> ``[T, H*D]``; stores k/v in the pool first."""
        pool = self.pool
        pool.write(layer_id, self.out_slots, k, v)
        t, n_heads, head_dim = q.shape
        n_kv = k.shape[1]
        keys = pool.k[layer_id].index_select(0, self.kv_index).view(self.batch, self.max_kv, n_kv, head_dim)
        values = pool.v[layer_id].index_select(0, self.kv_index).view(self.batch, self.max_kv, n_kv, head_dim)
        if self.simple:
            qp = q.view(1, 1, n_heads, head_dim)
        else:
            qp = q.new_zeros(self.batch * self.max_q, n_heads, head_dim)
            qp.index_copy_(0, self.token_index, q)
            qp = qp.view(self.batch, self.max_q, n_heads, head_dim)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=self.mask,
            enable_gqa=True,
        )  # [B, H, max_q, D]
        out = out.transpose(1, 2).reshape(self.batch * self.max_q, n_heads * head_dim)
        if self.simple:
            return out
        return out.index_select(0, self.token_index)
