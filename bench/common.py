"""Helpers shared by the benchmark scripts: timing, medians, tables, the final JSON line."""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def median_of(n: int, fn: Callable[[], float]) -> float:
    """Run ``fn`` ``n`` times and return the median of what it returns."""
    return statistics.median(fn() for _ in range(n))


def interleaved_medians(items: dict[str, Any], runs: int, measure: Callable[[Any], float]) -> dict[str, float]:
    """``measure(item)`` for every item in turn, ``runs`` rounds, the median per item. Rounds
    alternate the items, so that a drift of the shared machine (load, clock, other tenants'
    memory traffic) lands on all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in items}
    for _ in range(runs):
        for name, item in items.items():
            samples[name].append(measure(item))
    return {name: statistics.median(values) for name, values in samples.items()}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; 0.0 for an empty list."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def cpu_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` ("" where unreadable): figures taken on
    different machines (an AMD EPYC and an Intel Xeon of 2 cores each, so far) do not compare."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def emit_json(bench: str, **figures: Any) -> None:
    """The last line of every benchmark: one JSON object with every figure and ratio, and the
    CPU it ran on."""
    print(json.dumps({"bench": bench, "cpu": cpu_name(), **figures}, sort_keys=True))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def hf_folder(loaded: Any):
    """An HF folder of a loaded model for tools that load one (transformers, outlines, vLLM): the
    folder itself for an HF checkpoint; for a GGUF, its float32 export
    (``sgrt.models.loader.export_hf_folder``), written once under ``<cache root>/bench/``."""
    from pathlib import Path

    from sgrt.models.loader import export_hf_folder, gguf_cache_key
    from sgrt.paths import cache_root

    kind, src = loaded.source.split(":", 1)
    if kind != "gguf":
        return Path(src)
    gguf = Path(src)
    folder = cache_root() / "bench" / f"hf-{gguf.stem}-{gguf_cache_key(gguf)}"
    if not (folder / "model.safetensors").is_file():
        export_hf_folder(gguf, folder)
    return folder
