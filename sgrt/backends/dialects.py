"""Per-engine request dialects for :class:`sgrt.backends.http.RuntimeEndpoint`.

Each OpenAI-compatible engine accepts the OpenAI ``/v1/completions`` body plus its own extra
fields. A :class:`Dialect` maps one DSL ``gen`` (sampling fields named as
``sgrt.engine.SamplingParams`` names them) onto one engine's request body, and says how that
engine can score a ``select``. What an engine cannot do raises :class:`InvalidRequest` naming the
engine and the primitive before anything is sent: a program never silently gets something other
than what it asked for.

========  =========================================  ===========================  ===============
dialect   constraints                                sampling extras              select
========  =========================================  ===========================  ===============
sgrt      native ``/generate`` (regex, JSON Schema,  all                          prompt logprobs
          Lark)                                                                   (``/generate``)
vllm      ``structured_outputs`` {regex, json,       top_k, min_p, min_tokens,    ``prompt_logprobs``
          grammar}                                   repetition_penalty,
                                                     stop_token_ids, ignore_eos
sglang    ``regex`` / ``json_schema`` extra fields   as vLLM                      echo + logprobs
llamacpp  ``response_format`` json_schema; no regex  top_k, min_p,                echo + logprobs
          nor Lark (the server takes GBNF)           repetition_penalty (as
                                                     ``repeat_penalty``)
llama-    none: its ``/v1/completions`` has only a   as llamacpp, and min_tokens  echo + logprobs
cpp-      GBNF ``grammar`` (no response_format)                                   (needs the server's
python                                                                            ``logits_all``)
openai    ``response_format`` json_schema            none                         echo + logprobs
========  =========================================  ===========================  ===============

Sources: vLLM's OpenAI-compatible server docs (extra parameters, ``structured_outputs``,
``prompt_logprobs``), SGLang's sampling parameters, llama-cpp-python's server
(``CreateCompletionRequest``), llama.cpp's server README (``cache_prompt``), OpenAI's API
reference.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sgrt.errors import InvalidRequest
from sgrt.sampling_params import SamplingParams
from sgrt.schema_value import schema_value

#: Sampling fields that are engine extras, with the value that means "off".
EXTRA_DEFAULTS: dict[str, Any] = {"top_k": -1, "min_p": 0.0, "min_tokens": 0, "repetition_penalty": 1.0,
                                  "stop_token_ids": [], "ignore_eos": False}
#: Engine-side hints that only change speed, never the output: dropped for other engines.
HINTS = ("jump_forward", "speculative", "num_draft_tokens", "grammar_backend")

#: How each primitive is named in refusals (the DSL call a user wrote).
PRIMITIVES = {"regex": "gen(regex=...)", "json_schema": "gen(json_schema=...)", "grammar": "gen(grammar=...)",
              "select": "select", "logprob_start_len": "gen(logprob_start_len=...)",
              "truncate": "gen(truncate=...)", "chat_template": "roles (system/user/assistant)"}


@dataclass(frozen=True)
class Dialect:
    """How one engine's OpenAI-compatible server takes each primitive.

    Attributes:
        name: the dialect key (``"vllm"``, ``"llamacpp"``...).
        engine: the engine's name as refusals print it.
        extras: sampling extras the server takes, mapped to its field name.
        select: ``"native"`` (sgrt ``/generate``), ``"prompt_logprobs"`` (vLLM), ``"echo"``
            (``echo`` + ``logprobs`` on ``/v1/completions``).
        echo_max_tokens: the ``max_tokens`` an echo request sends (0 where the server takes it
            as "prefill only"; 1 where 0 means something else, e.g. llama-cpp-python's "until
            the context is full").
        native_cache: the server has ``/flush_cache`` and ``/abort_request`` (sgrt, SGLang).
    """

    name: str
    engine: str
    extras: dict[str, str] = field(default_factory=dict)
    select: str = "echo"
    echo_max_tokens: int = 0
    native_cache: bool = False

    def refuse(self, key: str, base_url: str, why: str = "") -> InvalidRequest:
        """The :class:`InvalidRequest` for a primitive this engine cannot do (``field`` = ``key``)."""
        what = PRIMITIVES.get(key, f"gen({key}=...)")
        tail = f": {why}" if why else ""
        return InvalidRequest(f"{what} is not supported by {self.engine} (dialect {self.name!r}) at {base_url}{tail}",
                              field=key)

    # ---- request body -------------------------------------------------------------------------
    def completion_body(self, model: str, prompt: str | list[str], params: SamplingParams | dict[str, Any],
                        request_id: str | None, base_url: str) -> dict[str, Any]:
        """The ``/v1/completions`` body for one ``gen`` (this dialect's translator from
        :class:`SamplingParams`; a dict of its fields is also taken).

        Raises:
            InvalidRequest: a field this engine cannot honour (``field`` names it).
        """
        if not isinstance(params, SamplingParams):
            params = SamplingParams.from_dict(params)  # checked once, here
        p = params.to_wire_dict()
        body: dict[str, Any] = {"model": model, "prompt": prompt, "n": 1,
                                "max_tokens": p.pop("max_tokens", 128),
                                "temperature": p.pop("temperature", 0.0)}
        for key in ("top_p", "seed", "frequency_penalty", "presence_penalty"):
            if p.get(key) is not None:
                body[key] = p[key]
            p.pop(key, None)
        stop = p.pop("stop", None) or []
        if stop:
            body["stop"] = [stop] if isinstance(stop, str) else list(stop)
        if p.pop("return_logprob", False):
            body["logprobs"] = int(p.get("top_logprobs_num") or 0)
            self.add_logprob_fields(body)
        p.pop("top_logprobs_num", None)
        if p.pop("logprob_start_len", -1) not in (-1, None):
            raise self.refuse("logprob_start_len", base_url, "prompt log-probabilities of a gen are sgrt-only")
        if p.pop("truncate", None) is not None:
            raise self.refuse("truncate", base_url)
        skip = p.pop("skip_special_tokens", True)
        for key in HINTS:
            p.pop(key, None)
        for key, default in EXTRA_DEFAULTS.items():
            value = p.pop(key, default)
            if value is None or value == default:
                continue
            if key not in self.extras:
                raise self.refuse(key, base_url, "the server has no such sampling field")
            body[self.extras[key]] = value
        if not skip:
            if "skip_special_tokens" not in self.extras.values():
                raise self.refuse("skip_special_tokens", base_url, "the server has no such sampling field")
            body["skip_special_tokens"] = False
        schema = p.pop("json_schema", None)
        self.add_constraints(body, p.pop("regex", None), None if schema is None else schema_dict(schema),
                             p.pop("grammar", None), base_url)
        self.add_request_fields(body, request_id)
        unknown = sorted(k for k, v in p.items() if v is not None)
        if unknown:
            raise self.refuse(unknown[0], base_url, "unknown sampling field")
        return body

    def add_logprob_fields(self, body: dict[str, Any]) -> None:
        """Fields that make the server say which token ids the logprobs are of."""

    def add_request_fields(self, body: dict[str, Any], request_id: str | None) -> None:
        """Per-request fields besides sampling (request ids, cache hints)."""

    def add_constraints(self, body: dict[str, Any], regex: str | None, schema: Any, grammar: str | None,
                        base_url: str) -> None:
        """OpenAI's API: a JSON Schema as ``response_format``; nothing else."""
        if regex is not None:
            raise self.refuse("regex", base_url, "the OpenAI API has no regex constraint")
        if grammar is not None:
            raise self.refuse("grammar", base_url, "the OpenAI API has no grammar constraint")
        if schema is not None:
            body["response_format"] = json_schema_format(schema)


def json_schema_format(schema: Any) -> dict[str, Any]:
    """OpenAI's ``response_format`` for a JSON Schema."""
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": True}}


_VLLM_EXTRAS = {k: k for k in EXTRA_DEFAULTS} | {"skip_special_tokens": "skip_special_tokens"}


@dataclass(frozen=True)
class VllmDialect(Dialect):
    """vLLM: ``structured_outputs`` (the successor of the removed ``guided_*`` fields), token ids
    in logprobs via ``return_tokens_as_token_ids``, ``select`` by ``prompt_logprobs``."""

    def add_logprob_fields(self, body: dict[str, Any]) -> None:
        body["return_tokens_as_token_ids"] = True

    def add_constraints(self, body: dict[str, Any], regex: str | None, schema: Any, grammar: str | None,
                        base_url: str) -> None:
        # NOTE: at most one is set (SamplingParams' own check), as structured_outputs wants.
        so = {k: v for k, v in (("regex", regex), ("json", schema), ("grammar", grammar)) if v is not None}
        if so:
            body["structured_outputs"] = so


@dataclass(frozen=True)
class SglangDialect(Dialect):
    """SGLang: ``regex`` / ``json_schema`` (as JSON text) / ``ebnf`` extra fields, ``rid``."""

    def add_request_fields(self, body: dict[str, Any], request_id: str | None) -> None:
        if request_id is not None:
            body["rid"] = request_id

    def add_constraints(self, body: dict[str, Any], regex: str | None, schema: Any, grammar: str | None,
                        base_url: str) -> None:
        if grammar is not None:
            raise self.refuse("grammar", base_url, "SGLang takes EBNF grammars, not Lark")
        if regex is not None:
            body["regex"] = regex
        if schema is not None:
            body["json_schema"] = json.dumps(schema)


def _refuse_lark_and_regex(dialect: Dialect, regex: str | None, grammar: str | None, base_url: str) -> None:
    """llama.cpp's servers (both): their ``grammar`` field takes GBNF and they have no regex."""
    if regex is not None:
        raise dialect.refuse("regex", base_url, "its grammar field takes GBNF, and it has no regex constraint")
    if grammar is not None:
        raise dialect.refuse("grammar", base_url, "its grammar field takes GBNF, not Lark")


@dataclass(frozen=True)
class LlamaCppDialect(Dialect):
    """llama.cpp's ``llama-server``: a JSON Schema as ``response_format`` (which the server
    compiles to a GBNF grammar), ``cache_prompt`` so the slot keeps the prompt's KV cache for the
    next request. Its ``grammar`` field takes GBNF, not the Lark that ``gen(grammar=...)`` holds,
    and it has no regex constraint: both refused."""

    def add_request_fields(self, body: dict[str, Any], request_id: str | None) -> None:
        body["cache_prompt"] = True

    def add_constraints(self, body: dict[str, Any], regex: str | None, schema: Any, grammar: str | None,
                        base_url: str) -> None:
        _refuse_lark_and_regex(self, regex, grammar, base_url)
        if schema is not None:
            body["response_format"] = json_schema_format(schema)


@dataclass(frozen=True)
class LlamaCppPythonDialect(Dialect):
    """llama-cpp-python's server: its ``/v1/completions`` (``CreateCompletionRequest``) takes a
    GBNF ``grammar`` and no ``response_format`` (an unknown field would be ignored, so a JSON
    Schema sent that way would silently not constrain): regex, Lark and JSON Schema are refused.
    Its prompt cache is a server option (``--cache``), not a request field."""

    def add_constraints(self, body: dict[str, Any], regex: str | None, schema: Any, grammar: str | None,
                        base_url: str) -> None:
        _refuse_lark_and_regex(self, regex, grammar, base_url)
        if schema is not None:
            raise self.refuse("json_schema", base_url, "its /v1/completions has no response_format, only a GBNF "
                              "grammar field")


DIALECTS: dict[str, Dialect] = {
    "sgrt": Dialect("sgrt", "sgrt", extras=dict(_VLLM_EXTRAS), select="native", native_cache=True),
    "vllm": VllmDialect("vllm", "vLLM", extras=dict(_VLLM_EXTRAS), select="prompt_logprobs", echo_max_tokens=1),
    "sglang": SglangDialect("sglang", "SGLang", extras=dict(_VLLM_EXTRAS), native_cache=True),
    "llamacpp": LlamaCppDialect("llamacpp", "llama.cpp", select="echo", echo_max_tokens=1,
                                extras={"top_k": "top_k", "min_p": "min_p",
                                        "repetition_penalty": "repeat_penalty"}),
    "llama-cpp-python": LlamaCppPythonDialect("llama-cpp-python", "llama-cpp-python", select="echo",
                                              echo_max_tokens=1,
                                              extras={"top_k": "top_k", "min_p": "min_p", "min_tokens": "min_tokens",
                                                      "repetition_penalty": "repeat_penalty"}),
    "openai": Dialect("openai", "an OpenAI-compatible server"),
}


def detect_dialect(owned_by: str | None, headers: dict[str, str], probe: Any) -> str:
    """The dialect a server speaks, from what it says about itself.

    In order: ``owned_by`` naming ``vllm`` / ``sglang`` / ``llamacpp``; then ``probe(path)`` (a
    GET returning the JSON answer or None): a router's ``/workers`` list (sglang-router,
    vllm-router: ``sglang``, the dialect that passes through them, also in front of sgrt
    workers); the ``x-sgrt-version`` header or ``owned_by == "sgrt"``; the title of
    ``/openapi.json`` (llama-cpp-python's is "llama.cpp Python API"), vLLM's ``/version`` (``{"version": ...}``), llama-server's ``/props``; else ``"openai"``.

    Args:
        owned_by: the first model card's ``owned_by`` from ``GET /v1/models``.
        headers: that answer's headers, lower-cased names.
        probe: ``probe(path) -> dict | None``, a GET that returns None on any error.
    """
    owner = str(owned_by or "").lower().replace(".", "").replace("-", "").replace("_", "")
    for name in ("vllm", "sglang", "llamacpp"):
        if owner == name:
            return name
    # NOTE: a router (sglang-router / smg, vllm-router) re-serialises /generate as SGLang's
    # GenerateReqInput, dropping the keys it does not know (max_tokens, grammar...), and passes
    # /v1/completions' extra fields on: SGLang's dialect is the one that survives it, in front of
    # sgrt workers too (vllm-router forwards /v1/models, so it says "sgrt" there).
    workers = probe("/workers")
    if isinstance(workers, dict) and isinstance(workers.get("workers"), list):
        return "sglang"
    if owner == "sgrt" or "x-sgrt-version" in headers:
        return "sgrt"
    info = probe("/openapi.json") or {}
    title = str((info.get("info") or {}).get("title", "")).lower()
    if "llama.cpp python" in title:
        return "llama-cpp-python"
    if "llama.cpp" in title:
        return "llamacpp"
    if "vllm" in title:
        return "vllm"
    if "sglang" in title:
        return "sglang"
    version = probe("/version")
    if isinstance(version, dict) and "version" in version:
        return "vllm"  # NOTE: vLLM's API server answers GET /version; the OpenAI API has none
    props = probe("/props")
    if isinstance(props, dict) and ("default_generation_settings" in props or "n_ctx" in props):
        return "llamacpp"
    return "openai"


# NOTE: the one reading of a json_schema value (also the grammar compiler's); raises GrammarError,
# an InvalidRequest.
schema_dict = schema_value
