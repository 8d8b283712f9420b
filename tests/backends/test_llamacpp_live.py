"""RuntimeEndpoint against llama.cpp's own server, live: ``bench/llamacpp_server.py`` (the
``xllamacpp`` wheel, the ``bench`` extra) started as a process on the default model's GGUF.

Skipped where xllamacpp is not installed; ``test_dialects.py`` replays a recorded run of the
same server either way. The server starts in seconds (a 135M Q4_1 GGUF, one thread).
"""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("xllamacpp")

from bench.scale_out import MODEL_NAME  # noqa: E402
from sgrt.backends.http import RuntimeEndpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llamacpp_url(tmp_path_factory):
    from sgrt.models.loader import default_gguf_path

    port = _free_port()
    log = open(tmp_path_factory.mktemp("llamacpp") / "server.log", "w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "llamacpp_server.py"), "--model",
                             str(default_gguf_path()), "--alias", MODEL_NAME, "--port", str(port), "--ctx", "2048",
                             "--parallel", "2", "--threads", "1"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # NOTE: a generous bound on readiness, not a speed check
            assert proc.poll() is None, f"the server exited with {proc.returncode}"
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_detected_and_constrained(llamacpp_url):
    url, _ = llamacpp_url
    ep = RuntimeEndpoint(url, model=MODEL_NAME)
    assert ep.dialect == "llamacpp"
    out = ep.generate("Call me at 555-", {"max_tokens": 12, "regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.text), out.text
    out = ep.generate("Is water wet? Answer yes or no: ", {"max_tokens": 4, "grammar": 'start: "yes" | "no"'})
    assert out.text in ("yes", "no"), out.text
    out = ep.generate("The sky is", {"max_tokens": 3, "return_logprob": True})
    lps = out.meta_info["output_token_logprobs"]
    assert len(lps) == out.meta_info["completion_tokens"] == 3
    assert all(isinstance(t, int) and lp <= 0 for lp, t, _ in lps)
    assert "output_top_logprobs" not in out.meta_info  # none asked for
    ep.shutdown()


def test_select_scores_are_the_models_own_logprobs(llamacpp_url):
    """Each option's scores equal its tokens scored one step at a time: the prompt up to the
    token, one token out, a logit bias of +100 on it (llama.cpp reports log-probabilities
    before sampling, so the bias picks the token without changing what is reported)."""
    url, _ = llamacpp_url
    ep = RuntimeEndpoint(url, model=MODEL_NAME)
    prompt = "The best fruit is"
    scores = ep.score_choices(prompt, [" a dragonfruit smoothie", " an apple"])
    for sc in scores:
        full = _post(url, "/tokenize", {"content": prompt + sc.choice, "add_special": True})["tokens"]
        start = len(full) - len(sc.token_ids)
        assert full[start:] == sc.token_ids and start > 0
        for j, (tid, lp) in enumerate(zip(sc.token_ids, sc.token_logprobs)):
            step = _post(url, "/v1/completions", {"prompt": full[:start + j], "max_tokens": 1, "temperature": 0,
                                                  "logprobs": 1, "logit_bias": [[tid, 100.0]]})
            entry = step["choices"][0]["logprobs"]["content"][0]
            assert entry["id"] == tid
            assert lp == pytest.approx(entry["logprob"], abs=1e-4)
    assert len(scores[0].token_ids) > 1  # a multi-token option
    ep.shutdown()


def test_stops_on_sigterm(llamacpp_url):
    _, proc = llamacpp_url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
