"""Attention over a ragged batch whose K/V live in the KV pool (gather + SDPA, or CPU operators).

Each row of a forward is a request feeding ``q_len`` new tokens after ``kv_len - q_len`` tokens
whose K/V are already in the pool. Rows are grouped by ``q_len``: all decode rows (``q_len=1``)
form one group, an extend (prefill) chunk or a verify row usually forms its own. Within a group,
keys are gathered by slot index and padded to the group's longest context, and one
``scaled_dot_product_attention`` call serves the group. Grouping keeps a 512-token prefill chunk
from padding every decode row in the same batch to 512 queries. A faster kernel may replace this
on CUDA behind the same ``forward`` contract.

Decode rows that share a long context prefix (requests on one system prompt, forks of one
context, sampled siblings) attend to it as one block: its keys are gathered once and every
row's query scores them in one matmul, then each row's own suffix is attended separately and the
two partial softmaxes are merged by their log-sum-exp ("cascade" attention, as in Juravsky et al.,
"Hydragen", arXiv:2402.05099, and FlashInfer's cascade kernels). Without it, 32 rows on a
1,000-token prompt gather 32 copies of the same 1,000 keys in every layer of every step.

On a CPU where sgrt's fused operators load (:mod:`sgrt.kernels.layer_ops`; the model's
``native_ops``), K/V are stored and decode rows attended by one operator each, reading keys and
values in place from their slots (no gathered copy, no padding); rows sharing a prefix then read
it from cache, which beats cascade's PyTorch ops, so cascade is off on that path. Extend and
verify rows (``q_len > 1``) over a bfloat16 pool, on a CPU with AVX-512 BF16, attend with
``extend_attention`` (causal flash attention reading K/V in place from their slots, bfloat16
products summed in float32 as SDPA's; within bfloat16 rounding of SDPA, not bitwise;
:data:`NATIVE_EXTEND_ATTENTION` turns it off); in sliding-window layers, over float32 or int8
pools and on other CPUs they keep gather + SDPA. On a decode-only forward the layer skips
:meth:`PagedAttention.forward`: :meth:`PagedAttention.native_decode` hands it this layer's cache
and the step's slot tables, and one ``decode_attention_qkv_`` call rotates, stores K/V and attends
(``NativeLayerOps.attention``).
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sgrt.engine.kv_pool import KVPool
from sgrt.token_ids import common_prefix_len

# Decode groups use cascade attention when at least this many rows share at least this many
# leading KV slots. Below that the shared gather is cheap and one SDPA call is faster.
CASCADE_MIN_ROWS = 2
CASCADE_MIN_PREFIX = 128
# A sliding-window layer's extend row of more queries than this is attended in blocks of this
# many queries, each over only the keys its window reaches (a band), instead of one SDPA call
# whose mask hides all but a band of the whole q_len x kv_len score matrix (SDPA on the CPU
# computes masked-out scores all the same).
BAND_QUERIES = 128
# Extend rows (q_len > 1) on the native path attend with ``extend_attention`` where it can run
# (bfloat16 pool and queries, a CPU with AVX-512 BF16, no window, no int8 pool); False keeps
# gather + SDPA for them (a switch for comparisons; read when a PagedAttention is made).
NATIVE_EXTEND_ATTENTION = True


@dataclass
class RowSpec:
    """One row of a ragged forward: its full context's slots and how many of them are new."""

    # KV slots of every context token, old then new (len = kv_len): an int64 array.array (a
    # request's own, sliced: the slot tables copy it by memcpy) or a list
    slots: Sequence[int]
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
    # Cascade (decode groups only): the slots every row starts with; kv_index / mask / max_kv
    # then cover each row's remaining suffix only.
    shared_index: torch.Tensor | None = None  # [P] slot ids
    kv_lens: torch.Tensor | None = None  # [size] int64 context lengths (the native operators')
    q_lens: torch.Tensor | None = None  # [size] int64, all q_len (extend groups: extend_attention's)
    # A windowed extend row's query blocks: (first query, end query, first key, end key); None = one call.
    bands: list[tuple[int, int, int, int]] | None = None
    # mask as SDPA's additive float mask (0 / -inf) per query dtype, built on first use (banded rows)
    additive: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``mask`` as the additive mask SDPA turns a boolean mask into (0 where True, -inf where
        False, in the query's dtype): built once per forward instead of once per layer and band."""
        m = self.additive.get(dtype)
        if m is None:
            m = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(~self.mask, float("-inf"))
            self.additive[dtype] = m
        return m


class PagedAttention:
    """Attention metadata for one forward, and the per-layer attention call.

    Args:
        pool: the KV pool to write new K/V into and to read context from.
        rows: one :class:`RowSpec` per batch row, in the order the tokens are laid out.
        cascade: let decode rows that share a long prefix attend to it once (module docstring).
        native: store K/V and attend decode rows with the fused CPU operators
            ``torch.ops.sgrt_layer.store_kv_`` / ``decode_attention`` (:mod:`sgrt.kernels.layer_ops`;
            the latter reads keys and values from their pool slots without gathering a copy),
            and extend / verify rows with ``extend_attention`` where it can run (module
            docstring); the caller checks that the operators are loaded.
    """

    def __init__(self, pool: KVPool, rows: list[RowSpec], cascade: bool = True, native: bool = False):
        self.pool = pool
        self.native = native
        if native:
            from sgrt.kernels import layer_ops

            self._store_kv, self._decode_attention = layer_ops.op("store_kv_"), layer_ops.op("decode_attention")
        self._extend_attention = None
        if native and NATIVE_EXTEND_ATTENTION and pool.k.dtype == torch.bfloat16 and pool.k_scale is None:
            from sgrt.kernels import layer_ops

            if layer_ops.extend_attention_available() and pool.k.shape[-1] in layer_ops.EXTEND_HEAD_DIMS:
                self._extend_attention = layer_ops.op("extend_attention")
        self._rows = rows
        self._cascade = cascade and not native
        # Sliding-window layers' metadata, built on first use per window length (see forward).
        self._windowed: dict[int, tuple[list[_Group] | None, tuple | None]] = {}
        self._groups: list[_Group] | None = None
        self._decode_only = native and bool(rows) and all(r.q_len == 1 for r in rows)
        if self._decode_only:
            # NOTE: a decode-only forward on the native path (every decode step) needs only the
            # slot tables of native_decode: built in one buffer (one tensor), the groups only if
            # asked for. Post-forward Python runs with cold caches (the step streamed the
            # weights), where each tensor built costs ~20-30 us.
            self.num_tokens = len(rows)
            self.out_slots, table, kv_lens = _decode_tables([r.slots for r in rows])
            self._native_decode: tuple | None = (table, kv_lens)
            return
        device = pool.k.device
        offsets, new_slots = [], []
        total = 0
        for r in rows:
            offsets.append(total)
            total += r.q_len
            new_slots.extend(r.slots[len(r.slots) - r.q_len:])
        self.num_tokens = total
        self.out_slots = torch.tensor(new_slots, dtype=torch.long, device=device)
        self._groups = self._build_groups(None)
        self._native_decode = self._native_decode_args(self._groups)

    @property
    def groups(self) -> list[_Group]:
        """The rows grouped by ``q_len``, with their gather indices and masks."""
        if self._groups is None:
            self._groups = self._build_groups(None)
        return self._groups

    def _build_groups(self, window: int | None) -> list[_Group]:
        """One :class:`_Group` per ``q_len``; with a ``window``, each row's context cut to the
        slots some of its new tokens can still see (from ``kv_len - q_len + 1 - window`` on)."""
        rows, device = self._rows, self.pool.k.device
        offsets, by_q = [], {}
        total = 0
        for i, r in enumerate(rows):
            offsets.append(total)
            total += r.q_len
            by_q.setdefault(r.q_len, []).append(i)
        groups = []
        for members in by_q.values():
            group_rows = [rows[i] for i in members]
            if window is not None:
                group_rows = [RowSpec(r.slots[max(0, len(r.slots) - r.q_len + 1 - window):], r.q_len)
                              for r in group_rows]
            # NOTE: the native decode operator reads each row's keys in place, and rows sharing a
            # prefix read it from cache: faster than cascade's PyTorch ops (2 threads, bfloat16,
            # 32 rows on a 1,000-token prefix: 1.4 vs 7.6 ms a layer; 2 rows on 128: 21 vs 196 us),
            # so no cascade there (self._cascade).
            groups.append(self._group(group_rows, [offsets[i] for i in members], total, device,
                                      self._cascade and window is None, window=window))
        return groups

    def _native_decode_args(self, groups: list[_Group]) -> tuple | None:
        """A decode-only forward on the native path (every decode step): one operator call a layer."""
        g = groups[0]
        if self.native and len(groups) == 1 and g.q_len == 1 and g.token_index is None:
            return g.kv_index.view(g.size, g.max_kv), g.kv_lens
        return None

    def _window_groups(self, window: int) -> tuple[list[_Group] | None, tuple | None]:
        """Groups for layers with a sliding window of ``window`` tokens: each row's context is
        cut to the slots some of its new tokens can still see (from ``kv_len - q_len + 1 - window``
        on), and the mask also hides keys more than ``window - 1`` positions before a query. On a
        decode-only native forward only the native slot tables (groups None: not needed)."""
        cached = self._windowed.get(window)
        if cached is None:
            if self._decode_only and all(len(r.slots) <= window for r in self._rows):
                # A window that hides nothing (every context fits in it): the full tables, not a
                # second build of the same values (Gemma 3's 512-token window, short contexts).
                cached = (None, self._native_decode)
            elif self._decode_only:
                out_slots, table, kv_lens = _decode_tables([r.slots[max(0, len(r.slots) - window):] for r in self._rows])
                cached = (None, (table, kv_lens))
            else:
                groups = self._build_groups(window)
                cached = (groups, self._native_decode_args(groups))
            self._windowed[window] = cached
        return cached

    @staticmethod
    def _group(rows: list[RowSpec], offsets: list[int], total: int, device: torch.device,
               cascade: bool, window: int | None = None) -> _Group:
        q_len = rows[0].q_len
        shared = _shared_prefix_len(rows) if cascade and q_len == 1 else 0
        shared_index = None
        if shared:
            shared_index = torch.tensor(rows[0].slots[:shared], dtype=torch.long, device=device)
            rows = [RowSpec(r.slots[shared:], 1) for r in rows]
        kv_lens = [len(r.slots) for r in rows]
        max_kv = max(kv_lens)
        if len(rows) == 1:
            padded = _slot_tensor(rows[0].slots).view(1, max_kv)
        else:
            padded = torch.zeros(len(rows), max_kv, dtype=torch.long)
            for i, r in enumerate(rows):
                padded[i, : len(r.slots)] = _slot_tensor(r.slots)
        tokens = [o + j for o in offsets for j in range(q_len)]
        in_order = tokens == list(range(total))
        token_index = None if in_order else torch.tensor(tokens, dtype=torch.long, device=device)
        # A window that hides nothing (every row's context fits in it) is no window.
        if window is not None and max(kv_lens) <= window:
            window = None
        causal = len(rows) == 1 and q_len > 1 and kv_lens[0] == q_len and not shared and window is None
        mask = None
        if not causal and (q_len > 1 or min(kv_lens) != max_kv):
            kv_len_t = torch.tensor(kv_lens).view(-1, 1, 1)
            q_pos = torch.arange(q_len).view(1, -1, 1)
            k_pos = torch.arange(max_kv).view(1, 1, -1)
            start = kv_len_t - q_len  # position (within the row's slots) of the row's first new token
            allowed = (k_pos <= start + q_pos) & (k_pos < kv_len_t)
            if window is not None:
                allowed &= k_pos > start + q_pos - window
            mask = allowed.unsqueeze(1).to(device)
        kv_lens_t = torch.tensor(kv_lens, dtype=torch.long, device=device)
        q_lens_t = torch.full((len(rows),), q_len, dtype=torch.long, device=device) if q_len > 1 else None
        bands = None
        if window is not None and len(rows) == 1 and q_len > BAND_QUERIES:
            # query j (0-based among the new ones) sees keys start + j - window + 1 .. start + j
            start = kv_lens[0] - q_len
            bands = [(a, min(a + BAND_QUERIES, q_len), max(0, start + a - window + 1),
                      start + min(a + BAND_QUERIES, q_len)) for a in range(0, q_len, BAND_QUERIES)]
        return _Group(len(rows), q_len, max_kv, padded.view(-1).to(device), token_index, mask, causal, shared_index,
                      kv_lens_t, q_lens_t, bands)

    def native_decode(self, layer_id: int, window: int | None = None) -> tuple | None:
        """For a decode-only forward on the native path (every row one new token: each decode
        step), the arguments that ``decode_attention_qkv_`` takes after q_scale for this layer:
        ``(k_cache, v_cache, new_slots [B], slots [B, max_kv], kv_lens [B], k_scale, v_scale)``
        (the scales float32 ``[num_slots, Hkv]`` of an int8 pool, else None), so that the layer
        stores its K/V and attends in one call; else None (use :meth:`forward`). The slot tables
        are built once per forward (once per window length), not per layer."""
        native_decode = self._native_decode if window is None else self._window_groups(window)[1]
        if native_decode is None:
            return None
        pool = self.pool
        return ((pool.k_layers[layer_id], pool.v_layers[layer_id], self.out_slots) + native_decode
                + (pool.k_scale_layers[layer_id], pool.v_scale_layers[layer_id]))

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        """q ``[T, H, D]``, k/v ``[T, Hkv, D]`` (possibly strided views) -> ``[T, H*D]``; stores
        k/v in the pool first. ``window``: a sliding-window layer's window in tokens (each query
        sees itself and the ``window - 1`` positions before it); None = full causal attention."""
        pool = self.pool
        k_layer, v_layer = pool.k_layers[layer_id], pool.v_layers[layer_id]
        scales = (pool.k_scale_layers[layer_id], pool.v_scale_layers[layer_id])  # (None, None): not int8
        groups, native_decode = self._groups, self._native_decode
        if window is not None:
            groups, native_decode = self._window_groups(window)
        if native_decode is not None:
            self._store_kv(k_layer, v_layer, self.out_slots, k, v, *scales)
            return self._decode_attention(q, k_layer, v_layer, *native_decode, *scales)
        t, n_heads, head_dim = q.shape
        if self.native:
            self._store_kv(k_layer, v_layer, self.out_slots, k, v, *scales)
        else:
            pool.write(layer_id, self.out_slots, k, v)
        out = None
        for g in groups:
            qg = q if g.token_index is None else q.index_select(0, g.token_index)
            if self.native and g.q_len == 1:  # (no cascade groups on the native path)
                o = self._decode_attention(qg, k_layer, v_layer, g.kv_index.view(g.size, g.max_kv), g.kv_lens,
                                           *scales)
            elif self._extend_attention is not None and window is None and q.dtype == torch.bfloat16:
                # (extend groups: q_len > 1, never cascade; no window, so no bands)
                o = self._extend_attention(qg, k_layer, v_layer, g.kv_index.view(g.size, g.max_kv), g.kv_lens,
                                           g.q_lens)
            else:
                o = self._attend_gathered(g, qg, pool, layer_id)
            if g.token_index is None:
                return o  # the only group
            if out is None:
                out = q.new_empty(t, n_heads * head_dim)
            out.index_copy_(0, g.token_index, o)
        return out

    @staticmethod
    def _attend_gathered(g: _Group, q: torch.Tensor, pool: KVPool, layer_id: int) -> torch.Tensor:
        """One group in PyTorch ops: gather its keys / values by slot (an int8 pool's dequantized
        to q's dtype there: :meth:`KVPool.read`), then SDPA (or cascade)."""
        _, n_heads, head_dim = q.shape
        keys, values = pool.read(layer_id, g.kv_index)
        n_kv = keys.shape[1]
        keys = keys.view(g.size, g.max_kv, n_kv, head_dim)
        values = values.view(g.size, g.max_kv, n_kv, head_dim)
        if g.shared_index is not None:
            return cascade_decode_attention(q, *pool.read(layer_id, g.shared_index), keys, values, g.mask)
        if g.q_len == 1:
            return decode_attention(q, keys, values, g.mask)
        if g.bands is not None:
            return _banded_attention(g, q, keys, values)
        o = F.scaled_dot_product_attention(
            q.reshape(g.size, g.q_len, n_heads, head_dim).transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=g.mask,
            is_causal=g.causal,
            enable_gqa=True,
        )  # [size, H, q_len, D]
        return o.transpose(1, 2).reshape(g.size * g.q_len, n_heads * head_dim)


def _banded_attention(g: _Group, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One windowed extend row (``g.bands``) as one SDPA call per block of queries over the keys
    its window reaches, with the group's mask cut to that block: the same result as one call
    over the whole mask (masked scores get no weight either way), at ~(window + block) / kv_len
    of its cost. q ``[T, H, D]``, keys / values ``[1, kv, Hkv, D]`` -> ``[T, H * D]``."""
    t, n_heads, head_dim = q.shape
    out = q.new_empty(t, n_heads * head_dim)
    qh, kh, vh = q.transpose(0, 1).unsqueeze(0), keys.transpose(1, 2), values.transpose(1, 2)
    # (the additive form of the boolean mask, which SDPA would otherwise build per call: the same values)
    mask = g.additive_mask(q.dtype)
    for a, b, lo, hi in g.bands:
        o = F.scaled_dot_product_attention(qh[:, :, a:b], kh[:, :, lo:hi], vh[:, :, lo:hi],
                                           attn_mask=mask[:, :, a:b, lo:hi], enable_gqa=True)
        out[a:b] = o[0].transpose(0, 1).reshape(b - a, n_heads * head_dim)
    return out


def _decode_tables(slot_lists: list[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slot tables of a decode-only forward (one new token a row), as views of one int64
    CPU tensor: ``(new_slots [B], slots [B, max_kv] padded with slot 0, kv_lens [B])``, the
    same values as the groups' ``out_slots``, ``kv_index`` and ``kv_lens``.

    ``slot_lists``: each row's context slots (its new token's last), none empty: int64
    ``array.array``s (copied by memcpy) or lists.
    """
    b = len(slot_lists)
    lens = [len(s) for s in slot_lists]
    max_kv = max(lens)
    buf = array("q", lens)
    buf.extend([s[-1] for s in slot_lists])
    for s, n in zip(slot_lists, lens):
        buf.extend(s)
        if n < max_kv:
            buf.extend(array("q", bytes(8 * (max_kv - n))))
    flat = torch.frombuffer(buf, dtype=torch.long)
    return flat[b: 2 * b], flat[2 * b:].view(b, max_kv), flat[:b]


def _slot_tensor(slots: Sequence[int]) -> torch.Tensor:
    """``slots`` (an int64 ``array.array`` or a list) as an int64 tensor ``[len(slots)]``, a copy.

    NOTE: built through ``array.array``, whose C loop converts a list of ints ~4x faster than
    ``torch.tensor(list)`` (8,000 slots: ~0.4 vs ~1.5 ms on the 2-core machine); every decode
    step builds each row's table once (twice with sliding-window layers), so at long contexts
    ``torch.tensor`` alone cost a tenth of a step.
    """
    return torch.frombuffer(array("q", slots), dtype=torch.long) if slots else torch.zeros(0, dtype=torch.long)


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


def _shared_prefix_len(rows: list[RowSpec]) -> int:
    """How many leading slots all decode ``rows`` share, if enough rows share enough of them
    to use cascade attention; else 0. Every row keeps at least its newest slot as a suffix."""
    if len(rows) < CASCADE_MIN_ROWS:
        return 0
    lists = [r.slots for r in rows]
    # The lexicographically smallest and largest lists bound every other: their common prefix
    # is everyone's (the trick of os.path.commonprefix), in two C-level comparisons.
    lo, hi = min(lists), max(lists)
    shared = min(common_prefix_len(lo, hi), min(len(x) for x in lists) - 1)
    return shared if shared >= CASCADE_MIN_PREFIX else 0


def cascade_decode_attention(q: torch.Tensor, prefix_keys: torch.Tensor, prefix_values: torch.Tensor,
                             keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of one-query rows over a prefix they all share, then their own suffixes.

    Each part is an exact softmax attention over its keys; the two are merged with their
    log-sum-exp weights, so the result equals attention over prefix + suffix (up to float
    rounding). Scores and the merge are computed in float32.

    Args:
        q: ``[B, H, D]``.
        prefix_keys, prefix_values: ``[P, Hkv, D]``, the shared prefix.
        keys, values: ``[B, S, Hkv, D]``, each row's suffix, padded to the longest.
        mask: ``[B, 1, 1, S]`` bool (True = attend) or None (no padding).

    Returns:
        ``[B, H*D]`` in ``q``'s dtype.
    """
    b, n_heads, head_dim = q.shape
    n_kv = keys.shape[2]
    group = n_heads // n_kv
    scale = head_dim ** -0.5
    qf = q.float().view(b, n_kv, group, head_dim)
    # Shared prefix: every row's query heads of one kv head score the prefix in one matmul.
    q_shared = qf.permute(1, 0, 2, 3).reshape(n_kv, b * group, head_dim)
    s1 = torch.bmm(q_shared, prefix_keys.float().permute(1, 2, 0)) * scale  # [Hkv, B*g, P]
    m1 = s1.amax(-1, keepdim=True)
    e1 = torch.exp(s1 - m1)
    o1 = torch.bmm(e1, prefix_values.float().transpose(0, 1))  # [Hkv, B*g, D], unnormalised
    l1 = e1.sum(-1, keepdim=True)
    to_rows = lambda t: t.view(n_kv, b, group, -1).transpose(0, 1)  # noqa: E731 -> [B, Hkv, g, *]
    o1, m1, l1 = to_rows(o1), to_rows(m1), to_rows(l1)
    # Each row's suffix (at least its newest token, so never empty).
    s2 = torch.matmul(qf, keys.float().permute(0, 2, 3, 1)) * scale  # [B, Hkv, g, S]
    if mask is not None:
        s2 = s2.masked_fill(~mask, float("-inf"))
    m2 = s2.amax(-1, keepdim=True)
    e2 = torch.exp(s2 - m2)
    o2 = torch.matmul(e2, values.float().transpose(1, 2))  # [B, Hkv, g, D]
    l2 = e2.sum(-1, keepdim=True)
    m = torch.maximum(m1, m2)
    w1, w2 = torch.exp(m1 - m), torch.exp(m2 - m)
    o = (o1 * w1 + o2 * w2) / (l1 * w1 + l2 * w2)
    return o.reshape(b, n_heads * head_dim).to(q.dtype)
