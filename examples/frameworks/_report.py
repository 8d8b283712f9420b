"""Shared by the framework examples: where the server is, and one result line per feature
(``RESULT {"feature": ..., "ok": ..., "error": ...}``, read by ``bench/frameworks.py``)."""
from __future__ import annotations

import json
import os
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

BASE_URL = os.environ.get("SGRT_BASE_URL", "http://127.0.0.1:8000/v1")  # the OpenAI-style /v1 root
MODEL = os.environ.get("SGRT_MODEL", "smollm2-135m-instruct")


def report(feature: str, value: Any = None, exc: BaseException | None = None) -> bool:
    """Print a feature's result line (and what it returned, or the error)."""
    if exc is None:
        print(f"{feature}: {value!r}")
    else:
        traceback.print_exception(exc)
    error = "" if exc is None else f"{type(exc).__name__}: {exc}"[:300]
    print("RESULT " + json.dumps({"feature": feature, "ok": exc is None, "error": error}), flush=True)
    return exc is None


def check(feature: str, fn: Callable[[], Any]) -> bool:
    """Run one feature and report it."""
    try:
        return report(feature, fn())
    except Exception as exc:  # noqa: BLE001 - reported, the next feature still runs
        return report(feature, exc=exc)


async def acheck(feature: str, fn: Callable[[], Awaitable[Any]]) -> bool:
    """Await one feature and report it (for frameworks whose async client is bound to the
    event loop it was first used on: every feature runs on the same loop)."""
    try:
        return report(feature, await fn())
    except Exception as exc:  # noqa: BLE001 - reported, the next feature still runs
        return report(feature, exc=exc)
