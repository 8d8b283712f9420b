"""The thread governor (sgrt/engine/threads.py): it runs the thread count whose forwards are
fastest, learns when the machine changes (another process takes a core, then leaves), and stays
on the best count most of the time; and through a real engine, outputs do not depend on it."""
from __future__ import annotations

import pytest

import random

from sgrt.engine.threads import (EXPLORE_MAX, EXPLORE_MIN, ThreadGovernor, decode_work, extend_work, kind_of, kv_weight,
                                pair_weight)


def _run(gov: ThreadGovernor, seconds_of, steps: int, kind=("decode", 1)) -> list[int]:
    """Feed ``steps`` forwards whose time is ``seconds_of(threads)``; the thread counts chosen."""
    chosen = []
    for _ in range(steps):
        n = gov.choose(kind)
        gov.record(kind, n, seconds_of(n))
        chosen.append(n)
    return chosen


QUIET = {2: 0.004, 1: 0.007}  # two threads ~1.75x one
BUSY = {2: 0.024, 1: 0.008}  # another process on one core: the 2-thread team waits on its slices


def test_kinds_bucket_by_rows_and_tokens():
    assert kind_of(1, 1) == ("decode", 1) and kind_of(3, 3) == ("decode", 2) and kind_of(16, 16) == ("decode", 16)
    assert kind_of(None, 600) == ("prefill", 64) and kind_of(None, 64) == ("prefill", 64)
    assert kind_of(None, 63) == ("extend", 32) and kind_of(None, 1) == ("extend", 1)


def test_work_counts_tokens_and_weighed_attention_pairs():
    w = pair_weight(576, 9, 3, 64, 1536)  # SmolLM2-135M's shape
    assert 1 / 3500 < w < 1 / 2500
    # 200 tokens after 1,000 cached: 200 * 1000 + 200 * 201 / 2 pairs
    assert extend_work([(1000, 200)], w) == pytest.approx(200 + w * (200_000 + 20_100))
    assert extend_work([(0, 1), (5, 3)], 0.5) == pytest.approx(1 + 0.5 * 1 + 3 + 0.5 * (15 + 6))


def test_prefill_steps_of_every_size_share_one_choice():
    """An agent load's prefill steps differ in size and context 10x; timed per unit of work, the
    differences are not taken for a busier machine: one thread is tried a few times, not on
    every size's first step and after every larger step (each try runs a heavy step at ~half speed)."""
    gov, rng, weight = ThreadGovernor(2), random.Random(7), 1 / 3000
    per_unit = {2: 1e-3, 1: 1.75e-3}
    ones = 0
    for _ in range(300):
        rows = [(rng.randrange(0, 3000), rng.randrange(64, 600)) for _ in range(rng.randrange(1, 5))]
        kind = kind_of(None, sum(n for _, n in rows))
        work = extend_work(rows, weight)
        n = gov.choose(kind)
        gov.record(kind, n, per_unit[n] * work, work)
        ones += n == 1
    assert ones <= 6, ones
    assert gov.summary() == {"prefill/64": 2}


def test_quiet_machine_runs_every_thread_and_explores_rarely():
    gov = ThreadGovernor(2)
    chosen = _run(gov, QUIET.__getitem__, 2000)
    assert chosen[0] == 2  # (the first forward of a kind runs on all threads)
    tail = chosen[500:]
    assert tail.count(1) <= len(tail) // EXPLORE_MAX + 2  # ~1 try in 256 once the choice holds
    assert gov.summary() == {"decode/1": 2}


def test_a_busy_core_moves_to_one_thread_and_back_when_it_frees():
    gov = ThreadGovernor(2)
    _run(gov, QUIET.__getitem__, 1000)
    busy = _run(gov, BUSY.__getitem__, 400)
    assert busy[:4].count(2) <= 3  # the first slow steps trigger a look at one thread at once
    assert busy[-300:].count(1) >= 280
    quiet_again = _run(gov, QUIET.__getitem__, 400)
    assert quiet_again[-200:].count(2) >= 190
    # time spent against always running 2 threads, over the busy phase: well under its 3x
    cost = sum(BUSY[n] for n in busy) / (BUSY[2] * len(busy))
    assert cost < 0.45, cost


def test_one_slow_forward_now_and_then_keeps_all_threads():
    """A quiet machine's occasional outlier (a 12x forward every 37th: a page fault, a collection)
    costs at most the one look at fewer threads it triggers, not a stretch on one thread."""
    gov = ThreadGovernor(2)
    count = [0]

    def seconds(n: int) -> float:
        count[0] += 1
        return 0.05 if n == 2 and count[0] % 37 == 0 else QUIET[n]

    tail = _run(gov, seconds, 3000)[500:]
    assert tail.count(1) <= len(tail) // 37 + len(tail) // EXPLORE_MIN // 8 + 2, tail.count(1)
    assert gov.summary() == {"decode/1": 2}


def test_kinds_are_learnt_apart():
    gov = ThreadGovernor(2)
    _run(gov, QUIET.__getitem__, 200, kind=("decode", 1))
    _run(gov, {2: 0.5, 1: 0.3}.__getitem__, 200, kind=("extend", 512))
    assert gov.summary() == {"decode/1": 2, "extend/512": 1}


@pytest.mark.parametrize("max_threads,adaptive", [(1, True), (4, False)])
def test_one_thread_or_off_keeps_the_count(max_threads, adaptive):
    gov = ThreadGovernor(max_threads, adaptive=adaptive)
    assert set(_run(gov, lambda n: 0.001 * n, 100)) == {max_threads}


def test_engine_outputs_do_not_depend_on_the_thread_policy(loaded_model):
    """Greedy outputs of the same requests with the governor on and off are identical (a row's
    result does not depend on the thread count: the kernels' outputs are bitwise the same)."""
    from sgrt.engine import Engine, SamplingParams

    prompts = ["The capital of France is", "1, 2, 3,", "Once upon a time"]
    outs = []
    for adaptive in (True, False):
        with Engine(model=loaded_model, max_total_tokens=2048, adaptive_threads=adaptive) as eng:
            outs.append([r.token_ids for r in eng.generate_batch(prompts, SamplingParams(max_tokens=24))])
            assert eng.threads.adaptive == (adaptive and eng.threads.max_threads > 1)
    assert outs[0] == outs[1]


def test_decode_work_weighs_context_by_kv_bytes():
    w = kv_weight(12_240, 97_000_000)  # SmolLM2-135M int4 with int8 K/V
    assert w == pytest.approx(12_240 / 97e6) and kv_weight(100, 0) == 0.0
    assert decode_work([8000], w) == pytest.approx(1 + 8000 * w)
    assert decode_work([500, 700], 1e-4) == pytest.approx(1 + 1200 * 1e-4)


def test_decode_steps_over_short_and_long_contexts_share_one_choice():
    """A batch-1 decode alternating between a 500- and an 8,000-token conversation (an agent
    switching sessions): a long step takes ~2x a short one. Timed per unit of work, the long steps
    are not taken for a busier machine: one thread is tried rarely. (Timed per step, every first
    long step after short ones looked 1.5x too slow and ran the next one on one thread.)"""
    gov, w = ThreadGovernor(2), 1.3e-4
    per_unit = {2: 4e-3, 1: 7e-3}
    ones = 0
    for i in range(400):
        context = 500 if (i // 16) % 2 == 0 else 8000  # 16 tokens of one, then 16 of the other
        work = decode_work([context], w)
        n = gov.choose(("decode", 1))
        gov.record(("decode", 1), n, per_unit[n] * work, work)
        ones += n == 1
    assert ones <= 6, ones
    assert gov.summary() == {"decode/1": 2}
    # per step, as before: the same load tries one thread after most switches
    gov, ones = ThreadGovernor(2), 0
    for i in range(400):
        context = 500 if (i // 16) % 2 == 0 else 8000
        n = gov.choose(("decode", 1))
        gov.record(("decode", 1), n, per_unit[n] * decode_work([context], w))
        ones += n == 1
    assert ones > 6
