"""Run one ragged forward over the scheduled rows and return the logits that are needed."""
from __future__ import annotations

import torch

from sgrt.engine.attention import PagedAttention, RowSpec
from sgrt.engine.kv_pool import KVPool
from sgrt.engine.scheduler import Row


class ModelRunner:
    """Owns the model and the KV pool tensors; stateless between steps.

    Args:
        model: a :class:`sgrt.models.llama.LlamaForCausalLM`.
        pool: the KV pool the attention reads and writes.
    """

    def __init__(self, model, pool: KVPool):
        self.model = model
        self.pool = pool
        self.device = model.device

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
            fill = row.req.fill_ids
            ids.extend(fill[row.start: row.start + row.n])
            positions.extend(range(row.start, row.start + row.n))
            specs.append(RowSpec(row.req.slots[: row.start + row.n], row.n))
            picks.extend(base + o for o in offsets)
            base += row.n
        dev = self.device
        attn = PagedAttention(self.pool, specs)
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            attn,
        )
        if not picks:
            return [hidden.new_zeros(0, 0) for _ in rows]
        logits = self.model.compute_logits(hidden[torch.tensor(picks, dtype=torch.long, device=dev)])
        out = []
        i = 0
        for offsets in logit_offsets:
            out.append(logits[i: i + len(offsets)])
            i += len(offsets)
        return out
