"""WebSocket session load: 32 concurrent sessions x 3 turns x 32 tokens on loopback.

Each round opens 32 sessions (one connection each), runs 3 chat turns in every session at
once (32 generated tokens per turn, ``ignore_eos``), then closes them. Three rounds; the first
warms up. Reported per round: TTFT p50 / p99 (the client's, from sending ``user`` to the first
``token``; and the engine's), output throughput, errors (target 0). After the sessions close:
the KV pool's free count (plus the unlocked cache entries they left, which any new request may
evict) is back to where it started, and exactly so after a cache flush; the process's RSS after
round 3 is within 5% of its RSS after round 2 (no per-session leak). The server runs in this
process (RSS covers server and clients).

Baseline, same process: the same conversations submitted straight to the engine (no
WebSocket, no sessions), to show what the protocol layer costs.

Run: ``python bench/ws_load.py`` (``--sessions``, ``--turns``, ``--tokens``, ``--time-limit``).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit_json, percentile, print_table  # noqa: E402

TOPICS = ["rivers", "mountains", "bread", "trains", "owls", "chess", "tea", "clouds"]


def rss_mb() -> float:
    """Resident set size of this process in MiB (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def questions(run: str, i: int, turns: int) -> list[str]:
    """Distinct per run and session (so no run replays another's cached conversation); only the
    chat template's system prompt is shared."""
    topic = TOPICS[i % len(TOPICS)]
    return [f"Run {run}, session {i}, question {t + 1}: tell me something about {topic}." for t in range(turns)]


async def ws_round(url: str, run: str, n: int, turns: int, tokens: int, deadline: float) -> dict:
    from sgrt.client import AgentSession

    client_ttft: list[float] = []
    engine_ttft: list[float] = []
    cached: list[int] = []
    errors: list[str] = []
    completion = 0

    async def one(i: int) -> None:
        nonlocal completion
        s = await AgentSession.connect(url, sampling={"max_tokens": tokens, "ignore_eos": True})
        try:
            for q in questions(run, i, turns):
                reply = await s.send(q)
                if reply.reason != "turn":
                    errors.append(f"session {i}: done reason {reply.reason}")
                client_ttft.append(reply.client_ttft or 0.0)
                engine_ttft.append(reply.ttft or 0.0)
                cached.append(reply.cached_tokens)
                completion += reply.completion_tokens
        finally:
            await s.close()

    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    done, pending = await asyncio.wait(tasks, timeout=max(1.0, deadline - time.monotonic()))
    for t in pending:
        t.cancel()
        errors.append("timed out")
    for t in done:
        if t.exception() is not None:
            errors.append(f"{type(t.exception()).__name__}: {t.exception()}")
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "client_ttft": client_ttft, "engine_ttft": engine_ttft, "cached": cached,
            "completion_tokens": completion, "errors": errors}


async def engine_round(engine, n: int, turns: int, tokens: int) -> dict:
    """The baseline: the same conversations, straight to the engine."""
    from sgrt.engine import SamplingParams

    tok = engine.tokenizer
    ttfts: list[float] = []
    completion = 0

    async def one(i: int) -> None:
        nonlocal completion
        messages: list[dict] = []
        for q in questions("direct", i, turns):
            messages.append({"role": "user", "content": q})
            t0 = time.perf_counter()
            h = engine.submit(tok.apply_chat_template(messages), SamplingParams(max_tokens=tokens, ignore_eos=True))
            first = None
            async for chunk in h.astream():
                if first is None and chunk.token_ids:
                    first = time.perf_counter() - t0
                if chunk.finished:
                    completion += chunk.result.completion_tokens
                    messages.append({"role": "assistant", "content": chunk.result.text})
            ttfts.append(first or 0.0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return {"wall_s": time.perf_counter() - t0, "ttft": ttfts, "completion_tokens": completion}


async def wait_idle(engine, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = engine.stats()
        if st["running"] == 0 and st["waiting"] == 0:
            return
        await asyncio.sleep(0.05)


async def main_async(args: argparse.Namespace) -> None:
    from sgrt.engine import Engine
    from sgrt.server import serve_ws

    deadline = time.monotonic() + args.time_limit
    engine = Engine(max_total_tokens=args.max_total_tokens, max_running_requests=max(64, args.sessions))
    server = await serve_ws(engine, host="127.0.0.1", port=0)
    rows, figures = [], {}
    rss: list[float] = []
    pool_ok: list[bool] = []
    all_errors: list[str] = []
    try:
        engine.flush_cache()
        free0 = engine.pool.num_free
        for r in range(1, args.rounds + 1):
            if time.monotonic() > deadline:
                all_errors.append(f"round {r} skipped: time limit")
                break
            res = await ws_round(server.url, f"ws{r}", args.sessions, args.turns, args.tokens, deadline)
            await wait_idle(engine)
            stats = engine.stats()
            reclaimable = engine.pool.num_free + stats["cache_tokens"]
            leftover_sessions = server.num_sessions
            gc.collect()
            rss.append(rss_mb())
            pool_ok.append(reclaimable == free0 and leftover_sessions == 0)
            all_errors += res["errors"]
            tput = res["completion_tokens"] / res["wall_s"]
            rows.append([f"ws round {r}", args.sessions, res["wall_s"], 1000 * percentile(res["client_ttft"], 50),
                         1000 * percentile(res["client_ttft"], 99), 1000 * percentile(res["engine_ttft"], 50),
                         tput, len(res["errors"]), f"{engine.pool.num_free}+{stats['cache_tokens']}/{free0}",
                         rss[-1]])
            figures[f"round{r}"] = {
                "wall_s": round(res["wall_s"], 3),
                "ttft_p50_ms": round(1000 * percentile(res["client_ttft"], 50), 1),
                "ttft_p99_ms": round(1000 * percentile(res["client_ttft"], 99), 1),
                "engine_ttft_p50_ms": round(1000 * percentile(res["engine_ttft"], 50), 1),
                "engine_ttft_p99_ms": round(1000 * percentile(res["engine_ttft"], 99), 1),
                "tok_per_s": round(tput, 1),
                "turns": len(res["client_ttft"]),
                "cached_tokens_mean": round(sum(res["cached"]) / max(1, len(res["cached"])), 1),
                "errors": len(res["errors"]),
                "rss_mb": round(rss[-1], 1),
            }
        base = None
        if time.monotonic() < deadline:
            engine.flush_cache()
            base = await engine_round(engine, args.sessions, args.turns, args.tokens)
            await wait_idle(engine)
            btput = base["completion_tokens"] / base["wall_s"]
            rows.append(["engine direct", args.sessions, base["wall_s"], 1000 * percentile(base["ttft"], 50),
                         1000 * percentile(base["ttft"], 99), "-", btput, 0, "-", rss_mb()])
        engine.flush_cache()
        flushed_ok = engine.pool.num_free == free0
        engine.check_integrity()
    finally:
        await server.close()
        engine.shutdown()

    print(f"ws_load: {args.sessions} sessions x {args.turns} turns x {args.tokens} tokens, loopback, "
          f"{args.rounds} rounds (round 1 warms up)")
    print_table(["run", "sessions", "wall s", "ttft p50 ms", "ttft p99 ms", "engine ttft p50 ms",
                 "tok/s", "errors", "pool free+cache/start", "rss MiB"], rows)
    last = figures.get(f"round{args.rounds}", {})
    rss_growth = (rss[2] - rss[1]) / rss[1] if len(rss) >= 3 else None
    out = {
        "sessions": args.sessions, "turns": args.turns, "tokens": args.tokens, "rounds": len(rss),
        "ttft_p50_ms": last.get("ttft_p50_ms"), "ttft_p99_ms": last.get("ttft_p99_ms"),
        "tok_per_s": last.get("tok_per_s"), "errors": len(all_errors),
        "pool_back_after_close": all(pool_ok) and bool(pool_ok), "pool_back_after_flush": flushed_ok,
        "rss_mb_round2": round(rss[1], 1) if len(rss) > 1 else None,
        "rss_mb_round3": round(rss[2], 1) if len(rss) > 2 else None,
        "rss_growth_round3_vs_round2": None if rss_growth is None else round(rss_growth, 4),
        "rss_within_5pct": None if rss_growth is None else abs(rss_growth) <= 0.05,
        "per_round": figures,
    }
    if base is not None:
        out["baseline_engine_direct"] = {
            "ttft_p50_ms": round(1000 * percentile(base["ttft"], 50), 1),
            "ttft_p99_ms": round(1000 * percentile(base["ttft"], 99), 1),
            "tok_per_s": round(base["completion_tokens"] / base["wall_s"], 1),
        }
        if last.get("tok_per_s"):
            out["throughput_ratio_ws_vs_direct"] = round(last["tok_per_s"] / out["baseline_engine_direct"]["tok_per_s"], 3)
    if all_errors:
        print("errors:", *all_errors[:10], sep="\n  ")
    emit_json("ws_load", **out)


def main() -> None:
    ap = argparse.ArgumentParser(description="WebSocket session load benchmark (loopback only)")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--time-limit", type=float, default=600.0, help="seconds for the whole run")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
