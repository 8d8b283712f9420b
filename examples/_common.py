"""Shared by the example scripts: make the default backend, print timings and engine figures.

Every example runs on the embedded default model (SmolLM2-135M-Instruct) unless given
``--model`` (a local HF folder or a GGUF file). Not an example itself.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# NOTE: the repository root, so that ``from programs.x import x`` works from any directory.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sgrt  # noqa: E402


def parse_args(description: str, **extra: Any) -> argparse.Namespace:
    """``--model`` and ``--dtype``, plus ``extra`` options as ``name=(type, default, help)``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="default model name, a GGUF file or a local HF folder (default: %(default)s)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    for name, (kind, default, help_text) in extra.items():
        ap.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=help_text)
    return ap.parse_args()


def start(args: argparse.Namespace, **engine_options: Any) -> Any:
    """Load the model into a ``sgrt.Runtime``, make it the default backend, say how long it took."""
    t0 = time.perf_counter()
    rt = sgrt.Runtime(model=args.model, dtype=args.dtype, **engine_options)
    sgrt.set_default_backend(rt)
    print(f"[loaded {args.model} ({args.dtype}) in {time.perf_counter() - t0:.1f} s]")
    return rt


def describe(meta: dict[str, Any] | None) -> str:
    """One line from a gen's meta info: tokens, cache, TTFT, decode speed, forced tokens."""
    if not meta:
        return ""
    ttft, e2e, n = meta.get("ttft"), meta.get("e2e_latency"), meta.get("completion_tokens", 0)
    speed = f", {(n - 1) / (e2e - ttft):.1f} tok/s" if ttft is not None and e2e and n > 1 and e2e > ttft else ""
    forced = f", {meta['forced_tokens']} forced" if meta.get("forced_tokens") else ""
    reason = (meta.get("finish_reason") or {}).get("type")
    return (f"{n} tokens ({reason}), {meta.get('cached_tokens', 0)}/{meta.get('prompt_tokens', 0)} "
            f"prompt tokens cached, TTFT {1000 * (ttft or 0):.0f} ms{speed}{forced}")


def finish(rt: Any, t0: float) -> None:
    """Print the run's wall time and the engine's totals, then shut the engine down."""
    st = rt.engine.stats()
    print(f"\n[{time.perf_counter() - t0:.1f} s of work; engine: {st['finished']} requests, "
          f"cache hit rate {st['cache_hit_rate']:.0%}, {st['forced_tokens']} forced tokens, "
          f"{st['generated_tokens']} generated]")
    rt.shutdown()
