"""The engine step's glue around the forward (issue 21): the runner's per-row logits batched back
for the sampler without a copy where they are one tensor's consecutive rows, and the same values
(and tokens) either way."""
from __future__ import annotations

import torch

from sgrt.engine.output_processor import last_rows_batch


def test_decode_batch_views_are_batched_back_without_a_copy():
    logits = torch.randn(4, 7)
    rows = list(logits.split([1, 1, 1, 1]))
    batch = last_rows_batch(rows)
    assert batch.data_ptr() == logits.data_ptr() and batch.shape == (4, 7)
    assert torch.equal(batch, torch.cat(rows))


def test_rows_that_are_not_one_tensors_consecutive_rows_are_copied_in_order():
    logits = torch.randn(4, 7)
    views = list(logits.split([1, 1, 1, 1]))
    cases = [
        views[::-1],  # reordered
        views[:3],  # a prefix of the tensor's rows
        list(logits.split([2, 1, 1])),  # a row with several logits rows: its last one counts
        [torch.randn(1, 7), torch.randn(1, 7)],  # separate tensors
        list(logits[:, :5].split([1, 1, 1, 1])),  # column slices of a wider tensor
    ]
    for rows in cases:
        batch = last_rows_batch(rows)
        assert torch.equal(batch, torch.cat([r[-1:] for r in rows])), rows
        assert batch.data_ptr() != logits.data_ptr() or len(rows) == 1


def test_one_row_is_its_last_logits_row():
    logits = torch.randn(3, 5)
    assert torch.equal(last_rows_batch([logits]), logits[-1:])
    one = torch.randn(1, 5)
    assert last_rows_batch([one]) is one


def test_batched_greedy_decode_equals_one_by_one(engine, tokenizer):
    # The batch path (the runner's logits as one tensor) picks the tokens each request picks alone.
    from sgrt.engine import SamplingParams

    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "1, 2, 3, 4,", "Once upon a time")]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = [engine.generate(p, params).token_ids for p in prompts]
    together = [r.token_ids for r in engine.generate_batch(prompts, params)]
    assert together == alone


def test_a_window_that_hides_nothing_reuses_the_full_slot_tables():
    # Decode rows whose contexts fit in the window: the windowed layers get the full tables (not
    # a second build) and attend exactly as the PyTorch path's windowed attention.
    from sgrt.engine.attention import PagedAttention, RowSpec
    from sgrt.kernels import layer_ops
    from tests.engine.test_attention import _pool

    if not layer_ops.available():
        import pytest

        pytest.skip("the native layer operators are not built here")
    rows = [RowSpec(list(range(1, 301)), 1), RowSpec(list(range(2000, 2100)), 1)]
    q, k, v = (torch.randn(2, h, 64, generator=torch.Generator().manual_seed(h)) for h in (9, 3, 3))
    native = PagedAttention(_pool(torch.float32), rows, native=True)
    assert native._window_groups(512)[1] is native._native_decode
    assert native._window_groups(200)[1] is not native._native_decode  # row 0 is cut to 200
    for window in (512, 200):
        got = PagedAttention(_pool(torch.float32), rows, native=True).forward(0, q, k, v, window=window)
        want = PagedAttention(_pool(torch.float32), rows, native=False).forward(0, q, k, v, window=window)
        assert (got - want).abs().max().item() <= 1e-5
