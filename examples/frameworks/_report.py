"""Shared by the framework examples: where the server is, and one result line per feature
(``RESULT {"feature": ..., "ok": ..., "error": ...}``, read by ``bench/frameworks.py``)."""
from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from typing import Any

BASE_URL = os.environ.get("SGRT_BASE_URL", "http://127.0.0.1:8000/v1")  # the OpenAI-style /v1 root
MODEL = os.environ.get("SGRT_MODEL", "smollm2-135m-instruct")


def check(feature: str, fn: Callable[[], Any]) -> bool:
    """Run one feature; print its result line (and what it returned, or the error)."""
    try:
        value = fn()
        print(f"{feature}: {value!r}")
        ok, error = True, ""
    except Exception as exc:  # noqa: BLE001 - reported, the next feature still runs
        traceback.print_exc()
        ok, error = False, f"{type(exc).__name__}: {exc}"[:300]
    print("RESULT " + json.dumps({"feature": feature, "ok": ok, "error": error}), flush=True)
    return ok
