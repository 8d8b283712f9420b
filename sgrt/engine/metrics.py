"""Engine-wide counters and the derived figures of ``Engine.stats()``."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sgrt.engine.outputs import Result


@dataclass
class EngineMetrics:
    """Counters updated by the loop thread; read (racily but harmlessly) by ``stats()``.

    Hit rate = cached prompt tokens / prompt tokens (DESIGN.md). Throughput = output tokens
    per second of wall time since the first request arrived.
    """

    started: float = field(default_factory=time.monotonic)
    first_arrival: float | None = None
    steps: int = 0
    forward_seconds: float = 0.0
    prefill_tokens: int = 0  # prompt tokens run through the model (not served from cache)
    decode_tokens: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    forced_tokens: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0

    def record_forward(self, rows: list, seconds: float) -> None:
        if self.first_arrival is None:
            self.first_arrival = time.monotonic() - seconds
        self.steps += 1
        self.forward_seconds += seconds
        for row in rows:
            if row.draft:  # a verify row: the last token and its draft
                self.decode_tokens += 1 + len(row.draft)
                self.prefill_tokens += row.n - 1 - len(row.draft)
            elif row.n == 1 and row.req.output_ids:
                self.decode_tokens += 1
            else:
                self.prefill_tokens += row.n

    def record_finish(self, result: Result) -> None:
        self.finished += 1
        self.aborted += result.finish_reason == "abort"
        self.prompt_tokens += result.prompt_tokens
        self.cached_tokens += result.cached_tokens
        self.forced_tokens += result.forced_tokens
        self.spec_drafted += result.spec_drafted
        self.spec_accepted += result.spec_accepted

    def snapshot(self, **gauges: Any) -> dict[str, Any]:
        elapsed = time.monotonic() - (self.first_arrival or self.started)
        pool_total = gauges.get("pool_total", 0)
        out = dict(
            steps=self.steps,
            finished=self.finished,
            aborted=self.aborted,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            cache_hit_rate=self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            prefill_tokens=self.prefill_tokens,
            decode_tokens=self.decode_tokens,
            generated_tokens=self.generated_tokens,
            throughput_tok_s=self.generated_tokens / elapsed if elapsed > 0 else 0.0,
            forward_seconds=self.forward_seconds,
            forced_tokens=self.forced_tokens,
            spec_drafted=self.spec_drafted,
            spec_accepted=self.spec_accepted,
            spec_acceptance_rate=self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0,
        )
        out.update(gauges)
        if pool_total:
            out["kv_pool_usage"] = 1.0 - gauges.get("pool_free", 0) / pool_total
        return out
