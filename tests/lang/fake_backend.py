"""A model-free backend for the DSL's unit tests: canned completions, one token per character."""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import jinja2

from sgrt.backends.base import BaseBackend, ChoiceScore, GenChunk, GenOutput
from sgrt.errors import GrammarError
from sgrt.sampling_params import SamplingParams

# SmolLM2-Instruct's template (ChatML with a default system prompt).
CHATML_WITH_DEFAULT_SYSTEM = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def render_template(source: str, messages: list[dict], add_generation_prompt: bool,
                    bos_token: str = "") -> str:
    env = jinja2.Environment()

    def raise_exception(msg):
        raise jinja2.TemplateError(msg)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(messages=messages,
                                          add_generation_prompt=add_generation_prompt,
                                          bos_token=bos_token)


class FakeBackend(BaseBackend):
    """Answers every gen with ``responder(prompt, params)`` (default: ``"ok"``).

    Tokens are characters (id = code point); the output is cut at ``max_tokens`` characters and
    at the first stop string. Every token's log-probability is -0.5. ``choice_logprobs`` maps an
    option to its per-token log-probabilities for ``score_choices`` (default: -1.0 per char).
    ``fail_on`` makes a gen whose prompt contains that text raise ``fail_with``.
    """

    def __init__(self, responder: Callable[[str, dict], str] | None = None,
                 template: str = CHATML_WITH_DEFAULT_SYSTEM, delay: float = 0.0):
        self.responder = responder or (lambda prompt, params: "ok")
        self.template = template
        self.delay = delay
        self.calls: list[tuple[str, str, dict]] = []  # (kind, prompt, params)
        self.lock = threading.Lock()
        self.choice_logprobs: dict[str, list[float]] = {}
        self.fail_on: str | None = None
        self.fail_with: BaseException = RuntimeError("fake failure")
        self.aborted: list[str] = []
        # When set, each streamed chunk waits for one release (lets tests pace a stream).
        self.gate: threading.Semaphore | None = None

    def _log(self, kind: str, prompt: str, params: dict) -> None:
        with self.lock:
            self.calls.append((kind, prompt, dict(params)))

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return render_template(self.template, messages, add_generation_prompt)

    def _complete(self, prompt: str, params: dict) -> tuple[str, str]:
        if self.fail_on is not None and self.fail_on in prompt:
            raise self.fail_with
        if params.get("regex") == "(":
            raise GrammarError("bad regex", field="regex")
        if self.delay:
            time.sleep(self.delay)
        text = self.responder(prompt, params)
        reason = "stop"
        for s in params.get("stop") or []:
            if s in text:
                text = text[: text.index(s)]
        if len(text) > params["max_tokens"]:
            text, reason = text[: params["max_tokens"]], "length"
        return text, reason

    def _meta(self, prompt: str, text: str, reason: str, params: dict) -> dict:
        meta = {"prompt_tokens": len(prompt), "completion_tokens": len(text),
                "cached_tokens": 0, "finish_reason": reason}
        if params.get("return_logprob"):
            meta["output_token_logprobs"] = [(-0.5, ord(c), c) for c in text]
        return meta

    def generate(self, prompt, params, request_id=None):
        params = _fields(params)
        self._log("gen", prompt, params)
        text, reason = self._complete(prompt, params)
        return GenOutput(text, self._meta(prompt, text, reason, params))

    def generate_stream(self, prompt, params, request_id=None) -> Iterator[GenChunk]:
        params = _fields(params)
        self._log("stream", prompt, params)
        text, reason = self._complete(prompt, params)
        lp = bool(params.get("return_logprob"))
        # two characters per chunk, then a final empty chunk carrying the meta
        for i in range(0, len(text), 2):
            piece = text[i:i + 2]
            if self.delay:
                time.sleep(self.delay)
            if self.gate is not None:
                self.gate.acquire(timeout=10)
            yield GenChunk(piece, [ord(c) for c in piece],
                           [(-0.5, ord(c), c) for c in piece] if lp else None)
        yield GenChunk("", [], [] if lp else None, None, True,
                       self._meta(prompt, text, reason, params))

    def score_choices(self, prompt, choices, unconditional=False):
        self._log("select", prompt, {"choices": list(choices)})
        out = []
        for c in choices:
            lps = self.choice_logprobs.get(c, [-1.0] * len(c))
            chars = [c[min(j, len(c) - 1)] for j in range(len(lps))]  # one token per logprob
            out.append(ChoiceScore(c, [ord(x) for x in chars], list(lps), chars,
                                   [None] + [-2.0] * (len(lps) - 1) if unconditional else None,
                                   prompt_tokens=len(prompt) + len(c), cached_tokens=len(prompt)))
        return out

    def cache_prefix(self, prompt):
        self._log("cache", prompt, {})
        return {"prompt_tokens": len(prompt), "cached_tokens": 0}

    def commit_fork(self, prompt, num_branches):
        self._log("fork", prompt, {"n": num_branches})
        return {"prompt_tokens": len(prompt), "cached_tokens": 0}

    def abort(self, request_id):
        self.aborted.append(request_id)

    def count_tokens(self, text):
        return len(text)


def _fields(params: SamplingParams) -> dict:
    """The backend takes the DSL's typed params; the fake records them as a dict of fields."""
    assert isinstance(params, SamplingParams), type(params)
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
