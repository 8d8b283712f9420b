"""``bench/llamacpp_process.py``, live: llama.cpp in a child process of its own (no torch, so no
shared libgomp with the benchmark's sgrt), asked for decode and prefill tok/s over its pipe.

Skipped where xllamacpp is not installed (the ``bench`` extra). One thread, the default model's
135M Q4_1 GGUF: a few seconds.
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("xllamacpp")

from bench.llamacpp_process import LlamaCppProcess  # noqa: E402


def _mapped_libraries(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {os.path.basename(line.split()[-1]) for line in f if "/" in line}


def test_child_answers_and_exits_cleanly():
    from sgrt.models.loader import default_gguf_path

    ids = list(range(1000, 1032))
    llama = LlamaCppProcess(str(default_gguf_path()), threads=1, n_ctx=128, n_batch=64)
    try:
        assert llama.pid != os.getpid()
        assert llama.version.startswith("xllamacpp ")
        libs = _mapped_libraries(llama.pid)
        assert not any(name.startswith("libtorch") for name in libs), "the child must not load torch"
        assert llama.decode_tps(ids, 8) > 0
        assert llama.prefill_tps(ids) > 0
        with pytest.raises(RuntimeError, match="unknown op 'train'"):
            llama._ask({"op": "train"})
        assert llama.decode_tps(ids, 4) > 0  # still serving after a refused request
    finally:
        status = llama.close()
    assert status == 0
