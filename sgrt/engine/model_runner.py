"""Run one ragged forward over the scheduled rows and return the logits that are needed."""
from __future__ import annotations

import logging
from array import array

import torch

from sgrt.engine.attention import PagedAttention, RowSpec
from sgrt.engine.kv_pool import KVPool
from sgrt.engine.scheduler import Row

logger = logging.getLogger("sgrt.engine")


class ModelRunner:
    """Runs the model over the KV pool's tensors (the scheduler owns the slots); stateless
    between steps.

    Args:
        model: a :class:`sgrt.models.layers.CausalLM` (any family).
        pool: the KV pool the attention reads and writes.
        compile: run decode batches (every row one token) through ``torch.compile``
            (:mod:`sgrt.engine.compiled_decode`; off by default: no gain measured at batch 1).
            Models with sliding-window layers run eagerly (the compiled graph has no window).
    """

    def __init__(self, model, pool: KVPool, compile: bool = False):
        self.model = model
        self.pool = pool
        self.device = model.device
        self.compiled = None
        if compile and any(w is not None for w in getattr(model, "layer_windows", ())):
            logger.warning("compile=True ignored: the compiled decode graph has no sliding-window attention")
            compile = False
        if compile:
            from sgrt.engine.compiled_decode import CompiledDecode

            self.compiled = CompiledDecode(model, pool)

    @torch.inference_mode()
    def forward(self, rows: list[Row], logit_offsets: list[list[int]]) -> list[torch.Tensor]:
        """Feed each row's tokens; return, per row, logits ``[len(offsets), V]`` float32 at the
        requested offsets within the row (0 = the row's first fed token).

        Only the requested positions go through the LM head: a 1,000-token prefill that needs
        one next-token distribution costs one LM-head row, not 1,000.
        """
        ids: list[int] = []
        positions: list[int] = []
        specs: list[RowSpec] = []
        picks: list[int] = []
        base = 0
        for row, offsets in zip(rows, logit_offsets):
            ids.extend(row.input_ids())
            positions.extend(range(row.start, row.start + row.n))
            specs.append(RowSpec(row.req.slots[: row.start + row.n], row.n))
            picks.extend(base + o for o in offsets)
            base += row.n
        dev = self.device
        reach = max(row.start + row.n for row in rows)
        if reach > self.model.rotary.rows:  # (the rotary tables start short and grow)
            self.model.cover_positions(reach)
        # The compiled graph has neither cascade nor the native operators' attention.
        attn = PagedAttention(self.pool, specs, cascade=self.compiled is None,
                              native=self.compiled is None and self.model.native_ops)
        # (ids and positions in one tensor: one build, not two, a step)
        fed = torch.frombuffer(array("q", ids + positions), dtype=torch.long).to(dev)
        ids_t, positions_t = fed[:base], fed[base:]
        if self.compiled is not None and base == len(rows) and all(o == [0] for o in logit_offsets):
            logits = self.compiled(ids_t, positions_t, attn)
            return [logits[i: i + 1] for i in range(len(rows))]
        hidden = self.model(ids_t, positions_t, attn)
        if not picks:
            return [hidden.new_zeros(0, 0) for _ in rows]
        if len(picks) != base or picks != list(range(base)):  # (decode batches pick every row)
            hidden = hidden[torch.tensor(picks, dtype=torch.long, device=dev)]
        logits = self.model.compute_logits(hidden)
        if len(logit_offsets) == 1:
            return [logits]
        # (one split: views of consecutive rows, which the sampler batches back without a copy)
        return list(logits.split([len(offsets) for offsets in logit_offsets]))
