"""Wire structs of the OpenAI-compatible HTTP API and of sgrt's native endpoints (msgspec).

Requests are decoded strictly (``forbid_unknown_fields``): a misspelled field is a 400 that names
it, as OpenAI's own API answers. Fields that OpenAI clients send but that mean nothing here
(``user``, ``store``, ``metadata``, ...) are accepted and ignored. Message objects are decoded
leniently, so that an assistant message a client got from us (with ``refusal: null`` and the
like) can be sent back as is.

Defaults follow OpenAI's documentation (``temperature=1``, ``top_p=1``, ``n=1``; completions
``max_tokens=16``), not the engine's greedy default (DESIGN.md, "Defaults").

Extra request fields (as vLLM and SGLang accept them): ``top_k``, ``min_p``, ``min_tokens``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, and the
constraints ``regex``, ``json_schema`` (an object or JSON text) and ``grammar`` (Lark text,
llguidance syntax).
"""
from __future__ import annotations

from typing import Annotated, Any

import msgspec

from sgrt.errors import InvalidRequest

#: OpenAI's ``metadata`` (Chat Completions, Responses): at most 16 pairs, keys of at most 64
#: characters, string values of at most 512 (a 400 naming ``metadata`` otherwise).
Metadata = Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
                     msgspec.Meta(max_length=16)]


def convert(value: Any, kind: Any, field: str) -> Any:
    """``value`` (decoded JSON) checked and converted to the wire type ``kind`` (a msgspec
    Struct, a typed list...), for a part of a request whose type depends on another field (a
    Responses input item's ``type``).

    Raises:
        InvalidRequest: naming ``field`` and the path inside it (``input[2].call_id``).
    """
    try:
        return msgspec.convert(value, kind, strict=True)
    except msgspec.ValidationError as e:
        text = str(e)
        path = ""
        if " - at `$" in text:
            text, _, where = text.rpartition(" - at `$")
            path = where.rstrip("`")
        raise InvalidRequest(f"{field}{path}: {text}", field=f"{field}{path}") from None


# ==== requests ====================================================================================


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices."""

    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted, ignored: a local stream needs no padding


class FunctionDef(msgspec.Struct, kw_only=True):
    """A function a tool offers: its ``parameters`` are the JSON Schema of its arguments."""

    name: str
    description: str | None = ""
    parameters: dict[str, Any] | None = msgspec.field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ToolDef(msgspec.Struct, kw_only=True):
    """One entry of ``tools``: only ``type: "function"`` is supported."""

    type: str = "function"
    function: FunctionDef


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: force that tool."""

    type: str = "function"
    function: ToolChoiceFunction


class JsonSchemaSpec(msgspec.Struct, kw_only=True):
    """``response_format.json_schema``: ``schema`` is the JSON Schema the reply must match."""

    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``response_format``: ``{"type": "text" | "json_object" | "json_schema", "json_schema": ...}``."""

    type: str
    json_schema: JsonSchemaSpec | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    """A part of a message's content; only ``type: "text"`` parts are supported."""

    type: str
    text: str | None = None


class ToolCallFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str = "{}"


class ToolCall(msgspec.Struct, kw_only=True):
    """A call an assistant message made (as a client sends it back in the history)."""

    id: str | None = None
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(msgspec.Struct, kw_only=True):
    """One message of ``messages``: ``role`` is system, developer, user, assistant or tool."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields shared by chat and text completions: OpenAI's sampling fields and our extras."""

    model: str | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # Accepted and ignored (they mean nothing for a local server).
    user: str | None = None
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Extras, as vLLM and SGLang accept them.
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    regex: str | None = None
    json_schema: Any = None
    grammar: str | None = None
    # SGLang's extras (an SGLang router adds them; see sgrt.server.sglang.fields).
    no_stop_trim: bool | None = None
    ebnf: str | None = None
    return_hidden_states: bool | None = None
    rid: str | list[str] | None = None

    def __post_init__(self) -> None:
        # NOTE: some clients send explicit nulls for OpenAI's optional fields; null = default.
        if self.n is None:
            self.n = 1
        if self.stream is None:
            self.stream = False


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None  # mapped to the template's thinking switch, if any
    # SGLang's chat extras (an SGLang router or vllm-router adds them; see sgrt.server.sglang.fields).
    continue_final_message: bool | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    include_reasoning: bool | None = None
    # Accepted and ignored with a warning in the log (see IGNORED_CHAT_FIELDS).
    verbosity: str | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: Any = None
    prompt_cache_options: dict[str, Any] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/completions``. ``prompt`` is a string, a list of strings, a list of token ids
    or a list of lists of token ids (checked by the server, which names the bad item)."""

    prompt: Any
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_tokens is None:
            self.max_tokens = 16
        if self.echo is None:
            self.echo = False


# ==== responses ===================================================================================


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """Every error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class Usage(msgspec.Struct, kw_only=True):
    """Token counts; ``prompt_tokens_details.cached_tokens`` came from the prefix cache."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    """Chat ``choices[i].logprobs``: one entry per generated token."""

    content: list[TokenLogprob] | None = None


class FunctionCallOut(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCallOut


class ResponseMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # a thinking model's <think> block (vLLM / DeepSeek's field)
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class FunctionCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta | None = None


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed delta. Unset fields are left out; ``content=None`` is sent as ``null``
    (beside tool calls, as OpenAI does)."""

    role: str | None = None
    content: str | None | msgspec.UnsetType = msgspec.UNSET
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """Text-completion ``choices[i].logprobs`` (the legacy format)."""

    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    """One entry of ``GET /v1/models``. ``owned_by == "sgrt"`` and the ``sgrt`` object tell a
    client (such as :class:`sgrt.backends.http.RuntimeEndpoint`) that the native endpoints
    exist."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "sgrt"
    max_model_len: int | None = None
    sgrt: dict[str, Any] | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard] = msgspec.field(default_factory=list)
