"""Scheduler unit tests (sgrt/engine/scheduler.py), without a model: rows and budgets, chunked
prefill, prefix-cache admission order, retraction under memory pressure, draft slots, and every
KV slot in exactly one place after each operation."""
from __future__ import annotations

import pytest
import torch

from sgrt.engine.kv_pool import KVPool
from sgrt.engine.prefix_cache import NoPrefixCache
from sgrt.engine.radix_cache import RadixCache
from sgrt.engine.request import Req, ReqStatus
from sgrt.engine.sampling_params import SamplingParams
from sgrt.engine.scheduler import Row, Scheduler, SchedulerConfig
from sgrt.errors import InvalidRequest


def make(slots: int = 256, cache: bool = True, **cfg) -> Scheduler:
    pool = KVPool(slots, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    prefix = RadixCache(pool) if cache else NoPrefixCache(pool)
    return Scheduler(SchedulerConfig(**cfg), pool, prefix)


def req(rid: str, prompt: list[int], max_tokens: int = 8) -> Req:
    return Req(rid, list(prompt), SamplingParams(max_tokens=max_tokens))


def run_rows(s: Scheduler, rows: list[Row], token: int = 7) -> None:
    """What the output processor does after a forward: cache prefill chunks, append a token to
    rows that complete their fill."""
    for row in rows:
        if row.completes_fill:
            if not row.req.output_ids:
                s.cache_prefix(row.req)
            row.req.output_ids.append(token)
        else:
            s.cache_prefix(row.req)


def test_prefill_is_chunked_under_the_budget_then_decodes_one_token_a_step():
    s = make(chunked_prefill_size=4, max_prefill_tokens=6, schedule_policy="lpm")
    a, b = req("a", range(1, 11)), req("b", range(20, 23))
    s.add(a)
    s.add(b)
    rows = s.schedule()
    # a takes a chunk of 4; b gets what is left of the budget of 6 (2 of its 3 tokens).
    assert [(r.req.request_id, r.start, r.n) for r in rows] == [("a", 0, 4), ("b", 0, 2)]
    assert not rows[0].completes_fill and rows[0].input_ids() == [1, 2, 3, 4]
    run_rows(s, rows)
    rows = s.schedule()
    assert [(r.req.request_id, r.start, r.n) for r in rows] == [("a", 4, 4), ("b", 2, 1)]
    assert rows[1].completes_fill
    run_rows(s, rows)
    rows = s.schedule()
    # b decodes its sampled token; a feeds its last 2 prompt tokens.
    assert [(r.req.request_id, r.start, r.n) for r in rows] == [("a", 8, 2), ("b", 3, 1)]
    assert rows[1].input_ids() == [7]
    run_rows(s, rows)
    s.check_integrity()


def test_short_policy_serves_the_shortest_next_chunk_first():
    """The default policy: prefill work in order of its next chunk (a waiting request's counts
    only its uncached tokens), running and waiting alike; the budget's rest goes to the longer."""
    s = make(chunked_prefill_size=4, max_prefill_tokens=6)
    assert s.config.schedule_policy == "short"
    a, b = req("a", range(1, 11)), req("b", range(20, 23))
    s.add(a)
    s.add(b)
    rows = s.schedule()
    assert [(r.req.request_id, r.start, r.n) for r in rows] == [("b", 0, 3), ("a", 0, 3)]
    run_rows(s, rows)
    rows = s.schedule()  # b decodes (1 token, outside the budget); a's next chunk
    assert [(r.req.request_id, r.start, r.n) for r in rows] == [("b", 3, 1), ("a", 3, 4)]
    run_rows(s, rows)
    s.check_integrity()


def test_a_cached_conversation_with_a_short_new_turn_goes_before_a_long_prefill():
    """An agent's next turn (its conversation cached, a few new tokens) is admitted ahead of
    another session's long prompt, whether that one is waiting or already prefilling."""
    s = make(slots=512, chunked_prefill_size=8, max_prefill_tokens=8)
    turn1 = req("turn1", range(1, 41))
    s.add(turn1)
    while turn1.remaining_prefill > 1 or not turn1.output_ids:
        run_rows(s, s.schedule())
    s.finish(turn1)  # the conversation is in the prefix cache
    long = req("long", range(100, 160))
    s.add(long)
    run_rows(s, s.schedule())  # long starts prefilling: 8 of 60
    turn2 = req("turn2", list(range(1, 41)) + [7, 90, 91])
    s.add(turn2)
    rows = s.schedule()
    assert [(r.req.request_id, r.n) for r in rows] == [("turn2", 3), ("long", 5)]
    assert rows[0].start == 40 and rows[0].req.cached_len == 40
    s.check_integrity()


def test_large_prefills_go_one_a_step_and_small_ones_share_a_step():
    """Turns arriving together: pieces past ``batch_prefill_tokens`` go one a step, so the first
    samples its first token after its own prefill (TTFT) rather than after everyone's; small
    pieces share a step; the order stays shortest first."""
    s = make(slots=512, chunked_prefill_size=64, max_prefill_tokens=64, batch_prefill_tokens=16)
    big = [req(f"big{i}", range(100 * i + 100, 100 * i + 110 + i)) for i in range(3)]  # 10, 11, 12 tokens
    for r in big:
        s.add(r)
    firsts = []
    for _ in range(3):
        rows = s.schedule()
        firsts.append([(r.req.request_id, r.n) for r in rows if r.n > 1])
        run_rows(s, rows)
    assert firsts == [[("big0", 10)], [("big1", 11)], [("big2", 12)]]
    small = [req(f"small{i}", [500 + 10 * i, 501 + 10 * i, 502 + 10 * i]) for i in range(5)]
    for r in small:
        s.add(r)
    rows = s.schedule()
    assert sorted(r.req.request_id for r in rows if r.n > 1) == ["small0", "small1", "small2", "small3", "small4"]
    assert sum(r.n == 1 for r in rows) == 3  # the big ones decode in the same step
    s.check_integrity()


@pytest.mark.parametrize("backlog", [1, 12])
def test_a_long_waiting_request_is_not_starved_by_a_stream_of_short_ones(backlog):
    """A waiting request whose first piece does not fit beside shorter ones (past
    ``batch_prefill_tokens``) is passed over while they keep arriving, but only twice: then the
    requests passed over that often go oldest first, whatever their size (a steady stream of short
    requests kept a 1,500-token prompt waiting for minutes; with a backlog, the shorts waiting as
    long were served first by size, and kept it waiting all the same)."""
    s = make(slots=1024, chunked_prefill_size=32, max_prefill_tokens=64, batch_prefill_tokens=16)
    long = req("long", range(1000, 1100))
    s.add(long)
    for i in range(backlog):
        s.add(req(f"backlog{i}", [700 + 3 * i, 701 + 3 * i, 702 + 3 * i]))
    admitted_at = None
    for step in range(6):
        s.add(req(f"short{step}", [10 * step + 300, 10 * step + 301, 10 * step + 302]))
        rows = s.schedule()
        if admitted_at is None and any(r.req is long for r in rows):
            admitted_at = step
        run_rows(s, rows)
        for r in list(s.running):
            if r is not long and r.output_ids:
                s.finish(r)  # (the shorts want one token)
    assert admitted_at == 2, admitted_at
    s.check_integrity()


def test_a_running_prefill_passed_over_twice_goes_first():
    s = make(slots=512, chunked_prefill_size=4, max_prefill_tokens=3)
    long = req("long", range(100, 140))
    s.add(long)
    run_rows(s, s.schedule())
    served = []
    for i in range(3):  # a short newcomer every step (3 tokens: shorter than long's chunk of 4)
        s.add(req(f"short{i}", [200 + 10 * i, 201 + 10 * i, 202 + 10 * i]))
        rows = s.schedule()
        served.append([r.req.request_id for r in rows if r.n > 1])  # (the prefill rows)
        run_rows(s, rows)
    assert served[0] == ["short0"] and served[1] == ["short1"]
    assert served[2] == ["long"]  # passed over twice: its chunk goes first, the newcomer waits
    s.check_integrity()


def test_max_running_requests_keeps_the_rest_waiting():
    s = make(max_running_requests=2)
    for i in range(3):
        s.add(req(f"r{i}", [i + 1, 50, 51]))
    rows = s.schedule()
    assert len(rows) == 2 and len(s.running) == 2 and [r.request_id for r in s.waiting] == ["r2"]
    assert s.has_work()


def test_lpm_admits_the_longest_cached_prefix_first_and_fcfs_keeps_order():
    for policy, first in (("lpm", "long"), ("fcfs", "short")):
        s = make(schedule_policy=policy, max_running_requests=1)
        warm = req("warm", [1, 2, 3, 4, 5, 6, 7, 8, 9])
        s.add(warm)
        run_rows(s, s.schedule())
        s.finish(warm)  # its prompt + output are now in the prefix cache
        s.add(req("short", [40, 41, 42]))
        s.add(req("long", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]))
        rows = s.schedule()
        assert [r.req.request_id for r in rows] == [first]
        if first == "long":
            # The cached 9 tokens are not fed again; the first row starts after them.
            assert rows[0].start == 9 and rows[0].n == 1 and rows[0].req.cached_len == 9
        s.check_integrity()


def test_finish_caches_the_prefix_and_flush_gives_every_slot_back():
    s = make(slots=64)
    r = req("r", [1, 2, 3, 4])
    s.add(r)
    run_rows(s, s.schedule())
    run_rows(s, s.schedule(), token=8)
    s.finish(r)
    assert r.status is ReqStatus.FINISHED and len(r.slots) == 0 and r.last_node is None
    assert len(s.cache.match_prefix([1, 2, 3, 4, 7, 8]).slots) == 5  # the last token has no KV
    assert s.pool.num_free == 64 - 5
    s.check_integrity()
    s.flush_cache()
    assert s.pool.num_free == 64 and s.cache.total_size == 0


def test_without_a_prefix_cache_finish_frees_everything():
    s = make(slots=32, cache=False)
    r = req("r", [1, 2, 3])
    s.add(r)
    run_rows(s, s.schedule())
    assert s.pool.num_free == 29
    s.finish(r)
    assert s.pool.num_free == 32
    s.check_integrity()


def test_memory_pressure_retracts_the_newest_request_and_keeps_its_output():
    s = make(slots=12, chunked_prefill_size=16)
    old, new = req("old", [1, 2, 3, 4, 5], max_tokens=6), req("new", [11, 12, 13, 14, 15], max_tokens=6)
    s.add(old)
    s.add(new)
    run_rows(s, s.schedule())  # 10 of 12 slots taken; both decode next
    for _ in range(2):
        rows = s.schedule()
        run_rows(s, rows)
        s.check_integrity()
    # 12 slots, two requests of 5 + 2 decoded tokens need 14: "new" was retracted.
    assert s.num_retracted >= 1 and new in s.waiting and new.status is ReqStatus.WAITING
    assert len(new.slots) == 0 and new.output_ids, "a retracted request keeps its output"
    assert old in s.running


def test_draft_slots_are_reserved_and_released_by_the_scheduler():
    s = make(slots=16)
    r = req("r", [1, 2, 3])
    s.add(r)
    run_rows(s, s.schedule())
    (row,) = s.schedule()  # decode row: feeds the sampled token
    free = s.pool.num_free
    assert s.attach_draft(row, [4, 5, 6])
    assert row.n == 4 and row.draft == [4, 5, 6] and row.input_ids() == [7, 4, 5, 6]
    assert row.completes_fill and len(r.slots) == r.num_fill + 3 and s.pool.num_free == free - 3
    s.release_draft_slots(r, 2)  # verification kept 1 of 3 drafts
    assert len(r.slots) == r.num_fill + 1 and s.pool.num_free == free - 1
    r.output_ids += [4, 9]  # the accepted draft token, then the target's token
    assert r.remaining_prefill == 1
    s.check_integrity()
    assert not s.attach_draft(row, list(range(100)))  # more than the pool: refused, row unchanged
    assert row.draft == [4, 5, 6] and len(r.slots) == r.num_fill - 1


def test_release_frees_draft_slots_of_tokens_not_in_the_output():
    s = make(slots=16)
    r = req("r", [1, 2, 3])
    s.add(r)
    run_rows(s, s.schedule())
    (row,) = s.schedule()
    assert s.attach_draft(row, [4, 5])
    s.finish(r)  # e.g. the forward failed: the drafts were never verified
    s.flush_cache()
    assert s.pool.num_free == 16
    s.check_integrity()


def test_integrity_check_catches_a_lost_slot():
    s = make(slots=16)
    r = req("r", [1, 2, 3])
    s.add(r)
    s.schedule()
    r.slots.pop()  # a slot nobody holds any more
    with pytest.raises(AssertionError, match="lost"):
        s.check_integrity()


@pytest.mark.parametrize("field,value", [("schedule_policy", "lifo"), ("max_running_requests", 0),
                                         ("chunked_prefill_size", True), ("max_prefill_tokens", 1.5),
                                         ("batch_prefill_tokens", 0)])
def test_config_is_validated(field, value):
    with pytest.raises(InvalidRequest, match=field):
        SchedulerConfig(**{field: value})


def test_row_input_ids_are_the_fed_slice_of_fill_ids_plus_the_draft():
    """Row.input_ids slices the prompt and the output without building fill_ids; every split
    (inside the prompt, across it, inside the output; with and without a draft) feeds the same
    ids as ``fill_ids[start:start + n - len(draft)] + draft``; a draft model's sequence (fill_ids
    only) too."""
    from sgrt.engine.drafters import _DraftSeq

    r = req("a", [10, 11, 12, 13, 14])
    r.output_ids = [20, 21, 22]
    fill = r.fill_ids
    for start in range(len(fill)):
        for n in range(1, len(fill) - start + 1):
            for draft in ([], [90, 91]):
                row = Row(r, start, n + len(draft), list(draft))
                assert row.input_ids() == fill[start: start + n] + draft, (start, n, draft)
    seq = _DraftSeq(fill_ids=list(fill), slots=[])
    assert Row(seq, 6, 2).input_ids() == [21, 22] and Row(seq, 2, 3, [7]).input_ids() == [12, 13, 7]
