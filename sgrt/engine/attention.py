"""Attention over a ragged batch whose K/V live in the KV pool (gather + SDPA).

Each row of a forward is a request feeding ``q_len`` new tokens after ``kv_len - q_len`` tokens
whose K/V are already in the pool. Rows are grouped by ``q_len``: all decode rows (``q_len=1``)
form one group, an extend (prefill) chunk or a verify row usually forms its own. Within a group,
keys are gathered by slot index and padded to the group's longest context, and one
``scaled_dot_product_attention`` call serves the group. Grouping keeps a 512-token prefill chunk
from padding every decode row in the same batch to 512 queries. A faster kernel may replace this
on CUDA behind the same ``forward`` contract.
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


@dataclass
class _Group:
    """Rows with the same ``q_len``, attended in one SDPA call."""

    size: int  # rows in the group
    q_len: int
    max_kv: int
    kv_index: torch.Tensor  # [size * max_kv] slot ids, padded with slot 0
    token_index: torch.Tensor | None  # [size * q_len] positions in the flat batch; None = all, in order
    mask: torch.Tensor | None  # [size, 1, q_len, max_kv] bool (True = attend); None = no mask
    causal: bool  # use SDPA's own causal mask (one row, no cached prefix)


class PagedAttention:
    """Attention metadata for one forward, and the per-layer attention call.

    Args:
        pool: the KV pool to write new K/V into and to read context from.
        rows: one :class:`RowSpec` per batch row, in the order the tokens are laid out.
    """

    def __init__(self, pool: KVPool, rows: list[RowSpec]):
        self.pool = pool
        device = pool.k.device
        offsets, new_slots = [], []
        total = 0
        for r in rows:
            offsets.append(total)
            total += r.q_len
            new_slots.extend(r.slots[len(r.slots) - r.q_len:])
        self.num_tokens = total
        self.out_slots = torch.tensor(new_slots, dtype=torch.long, device=device)
        by_q: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            by_q.setdefault(r.q_len, []).append(i)
        self.groups = [
            self._group([rows[i] for i in members], [offsets[i] for i in members], total, device)
            for members in by_q.values()
        ]

    @staticmethod
    def _group(rows: list[RowSpec], offsets: list[int], total: int, device: torch.device) -> _Group:
        q_len = rows[0].q_len
        kv_lens = [len(r.slots) for r in rows]
        max_kv = max(kv_lens)
        padded = torch.zeros(len(rows), max_kv, dtype=torch.long)
        for i, r in enumerate(rows):
            padded[i, : len(r.slots)] = torch.tensor(r.slots, dtype=torch.long)
        tokens = [o + j for o in offsets for j in range(q_len)]
        in_order = tokens == list(range(total))
        token_index = None if in_order else torch.tensor(tokens, dtype=torch.long, device=device)
        causal = len(rows) == 1 and q_len > 1 and kv_lens[0] == q_len
        mask = None
        if not causal and (q_len > 1 or min(kv_lens) != max_kv):
            kv_len_t = torch.tensor(kv_lens).view(-1, 1, 1)
            q_pos = torch.arange(q_len).view(1, -1, 1)
            k_pos = torch.arange(max_kv).view(1, 1, -1)
            start = kv_len_t - q_len  # absolute position of the row's first new token
            allowed = (k_pos <= start + q_pos) & (k_pos < kv_len_t)
            mask = allowed.unsqueeze(1).to(device)
        return _Group(len(rows), q_len, max_kv, padded.view(-1).to(device), token_index, mask, causal)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[T, H, D]``, k/v ``[T, Hkv, D]`` (possibly strided views) -> ``[T, H*D]``; stores
        k/v in the pool first."""
        pool = self.pool
        pool.write(layer_id, self.out_slots, k, v)
        t, n_heads, head_dim = q.shape
        n_kv = k.shape[1]
        k_layer, v_layer = pool.k[layer_id], pool.v[layer_id]
        out = None
        for g in self.groups:
            keys = k_layer.index_select(0, g.kv_index).view(g.size, g.max_kv, n_kv, head_dim)
            values = v_layer.index_select(0, g.kv_index).view(g.size, g.max_kv, n_kv, head_dim)
            qg = q if g.token_index is None else q.index_select(0, g.token_index)
            if g.q_len == 1:
                o = decode_attention(qg, keys, values, g.mask)
            else:
                o = F.scaled_dot_product_attention(
                    qg.reshape(g.size, g.q_len, n_heads, head_dim).transpose(1, 2),
                    keys.transpose(1, 2),
                    values.transpose(1, 2),
                    attn_mask=g.mask,
                    is_causal=g.causal,
                    enable_gqa=True,
                )  # [size, H, q_len, D]
                o = o.transpose(1, 2).reshape(g.size * g.q_len, n_heads * head_dim)
            if g.token_index is None:
                return o  # the only group
            if out is None:
                out = q.new_empty(t, n_heads * head_dim)
            out.index_copy_(0, g.token_index, o)
        return out


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of rows with one query each.

    q ``[B, H, D]``; keys / values ``[B, max_kv, Hkv, D]`` (padded); mask ``[B, 1, 1, max_kv]``
    bool or None -> ``[B, H*D]``.
    """
    b, n_heads, head_dim = q.shape
    n_kv = keys.shape[2]
    if q.dtype != torch.float32:
        # NOTE: one query per row: the n_heads / n_kv query heads sharing a kv head become that
        # head's query positions, and SDPA needs no GQA expansion. 2-8x faster than enable_gqa in
        # bfloat16 on CPU (64-1000 keys) and bit-identical there; float32 keeps the general call,
        # where this would move logits by ~1e-7.
        o = F.scaled_dot_product_attention(
            q.reshape(b, n_kv, n_heads // n_kv, head_dim), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask,
        )  # [B, Hkv, H / Hkv, D]
        return o.reshape(b, n_heads * head_dim)
    o = F.scaled_dot_product_attention(
        q.reshape(b, 1, n_heads, head_dim).transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask, enable_gqa=True,
    )  # [B, H, 1, D]
    return o.transpose(1, 2).reshape(b, n_heads * head_dim)
