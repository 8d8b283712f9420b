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
llamacpp  ``json_schema`` field; regex and Lark      top_k, min_p, ignore_eos,    forced tokens
          as an llguidance ``grammar``               repetition_penalty (as       (``<[id]>``
          (``%llguidance``; only on a server built   ``repeat_penalty``)          grammar) +
          with it, which is asked first)                                          ``logprobs``
llama-    none: its ``/v1/completions`` has only a   as llamacpp, and min_tokens  echo + logprobs
cpp-      GBNF ``grammar`` (no response_format)                                   (needs the server's
python                                                                            ``logits_all``)
openai    ``response_format`` json_schema            none                         echo + logprobs
========  =========================================  ===========================  ===============

Sources: vLLM's OpenAI-compatible server docs (extra parameters, ``structured_outputs``,
``prompt_logprobs``), SGLang's sampling parameters, llama-cpp-python's server
(``CreateCompletionRequest``), llama.cpp's server README (``cache_prompt``, ``grammar``,
``n_probs``, ``post_sampling_probs``) and ``common/sampling.cpp`` (a grammar that starts with
``%llguidance`` goes to llguidance as Lark), llguidance's Lark syntax (``<[id]>`` tokens),
OpenAI's API reference.
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
            (``echo`` + ``logprobs`` on ``/v1/completions``), ``"forced_tokens"`` (llama.cpp:
            :meth:`LlamaCppDialect.forced_tokens_body`).
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
    #: Primitives that only a server built with llguidance can do (asked once per server).
    needs_llguidance: tuple[str, ...] = ()

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
    """llama-cpp-python: its ``grammar`` field takes GBNF and it has no regex."""
    if regex is not None:
        raise dialect.refuse("regex", base_url, "its grammar field takes GBNF, and it has no regex constraint")
    if grammar is not None:
        raise dialect.refuse("grammar", base_url, "its grammar field takes GBNF, not Lark")


#: The first line of a llama.cpp ``grammar`` that its sampler hands to llguidance (as Lark)
#: instead of its own GBNF parser (llama.cpp's ``common/sampling.cpp``).
LLGUIDANCE_HEADER = "%llguidance {}\n"


def llguidance_grammar(regex: str | None = None, lark: str | None = None) -> str:
    """The llama.cpp ``grammar`` value for a full-match ``regex`` or a ``lark`` grammar
    (llguidance's Lark dialect, the one ``gen(grammar=...)`` takes; a name of a file under
    ``grammars/`` is read as sgrt reads it).

    The regex becomes Lark by llguidance's own translation (``LLMatcher.grammar_from_regex``,
    the path sgrt's default backend compiles), so the server's llguidance constrains exactly what
    sgrt's would. Both go through sgrt's grammar limits and llguidance's validator here: llama.cpp
    answers an invalid llguidance grammar with an unconstrained 200, never an error.

    Raises:
        GrammarError: the regex / grammar is over a limit or llguidance rejects it (``field``
            ``regex`` / ``grammar``).
    """
    import llguidance

    from sgrt.constrained import limits as _limits
    from sgrt.constrained.compiler import load_grammar_text
    from sgrt.errors import GrammarError

    limits = _limits.GrammarLimits()
    if regex is not None:
        key = "regex"
        if not isinstance(regex, str):
            raise GrammarError("regex must be a str", field="regex")
        _limits.check_regex(regex, limits)
        try:
            text = json.loads(llguidance.LLMatcher.grammar_from_regex(regex))["grammars"][0]["lark_grammar"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise GrammarError(f"regex: llguidance gave no Lark form of {regex!r} ({e})", field="regex") from None
    else:
        key = "grammar"
        if not isinstance(lark, str):
            raise GrammarError("grammar must be a str", field="grammar")
        text = load_grammar_text(lark)
        _limits.check_lark(text, limits)
    if not text.lstrip().startswith("%llguidance"):
        text = LLGUIDANCE_HEADER + text
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(llguidance.grammar_from("lark", text))
    if is_error:
        raise GrammarError(f"{key}: {'; '.join(messages)}", field=key)
    return text


def forced_tokens_grammar(token_ids: list[int]) -> str:
    """An llguidance grammar (llama.cpp ``grammar`` value) that admits exactly ``token_ids``,
    token by token (llguidance's ``<[id]>`` terminals), not merely their text."""
    return LLGUIDANCE_HEADER + "start: " + " ".join(f"<[{int(t)}]>" for t in token_ids)


@dataclass(frozen=True)
class LlamaCppDialect(Dialect):
    """llama.cpp's ``llama-server``: a JSON Schema as its ``json_schema`` field (the server
    compiles it itself; its ``/v1/completions`` ignores ``response_format``), a regex or a Lark grammar as an llguidance ``grammar`` (:func:`llguidance_grammar`),
    ``cache_prompt`` so the slot keeps the prompt's KV cache for the next request.

    A grammar starting with ``%llguidance`` needs a server built with ``LLAMA_LLGUIDANCE=ON``
    (xllamacpp's wheels are; a build without it aborts the whole process on one), so
    ``RuntimeEndpoint`` first asks the server (:attr:`needs_llguidance`) and refuses regex, Lark
    and ``select`` by name where it is not. ``select`` is exact: each option's tokens are forced
    by a ``<[id]>`` grammar after the prompt's ids, and ``logprobs`` (``n_probs``, pre-sampling,
    ``post_sampling_probs`` off) gives each forced token's log-probability under the model alone.
    llama.cpp returns no prompt log-probabilities (``echo`` is ignored), so there is no other way.
    """

    #: Primitives that need the server's llguidance.
    needs_llguidance: tuple[str, ...] = ("regex", "grammar", "select")

    def add_request_fields(self, body: dict[str, Any], request_id: str | None) -> None:
        body["cache_prompt"] = True

    def add_logprob_fields(self, body: dict[str, Any]) -> None:
        # NOTE: llama.cpp returns no logprobs at all for logprobs=0 (its n_probs); one top entry
        # is the least that brings the sampled token's own.
        body["logprobs"] = max(1, int(body.get("logprobs") or 0))

    def add_constraints(self, body: dict[str, Any], regex: str | None, schema: Any, grammar: str | None,
                        base_url: str) -> None:
        # NOTE: at most one is set: SamplingParams checks that when it is built.
        if regex is not None:
            body["grammar"] = llguidance_grammar(regex=regex)
        elif grammar is not None:
            body["grammar"] = llguidance_grammar(lark=grammar)
        elif schema is not None:
            # NOTE: llama.cpp's own field: its /v1/completions ignores response_format (only its
            # chat completions read it), which would run the gen unconstrained.
            body["json_schema"] = schema

    def forced_tokens_body(self, model: str, prompt_ids: list[int], forced_ids: list[int]) -> dict[str, Any]:
        """The ``/v1/completions`` body that scores ``forced_ids`` after ``prompt_ids``."""
        return {"model": model, "prompt": list(prompt_ids), "max_tokens": len(forced_ids), "temperature": 0.0,
                "logprobs": 1, "post_sampling_probs": False, "cache_prompt": True,
                "grammar": forced_tokens_grammar(forced_ids)}


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
    "llamacpp": LlamaCppDialect("llamacpp", "llama.cpp", select="forced_tokens", echo_max_tokens=1,
                                extras={"top_k": "top_k", "min_p": "min_p", "ignore_eos": "ignore_eos",
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
    workers); the ``x-sgrt-version`` header or ``owned_by == "sgrt"``; llama-server's
    ``Server: llama.cpp`` header; the title of
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
    if headers.get("server", "").lower().startswith("llama.cpp"):
        return "llamacpp"  # NOTE: llama-server's cpp-httplib answers "Server: llama.cpp"
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
