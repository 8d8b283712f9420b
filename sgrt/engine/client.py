"""The engine as its clients see it: :class:`EngineClient` (what a server, a DSL backend or a
program run may call) and :class:`EngineInfo` (the facts about the served model and the
engine's limits, fixed at start).

Modelled on vLLM's ``vllm/engine/protocol.py``: every server types its engine as
``EngineClient`` and reads sizes from ``engine.info``, never from the engine's attributes
(``pool``, ``intake``, ``loaded``...), so a fake engine in a test, a request tree that records a
program's requests, and the real :class:`~sgrt.engine.Engine` are interchangeable.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from sgrt.engine.handle import RequestHandle
    from sgrt.engine.metrics import EngineMetrics
    from sgrt.engine.outputs import StreamChunk
    from sgrt.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineInfo:
    """What an engine serves and within which bounds (fixed once the engine has started).

    Attributes:
        model_name: the id to report when the operator names none: the checkpoint's folder or
            file name (``"sgrt-model"`` when unknown).
        context_length: the model's context window, in tokens.
        vocab_size: rows of the LM head; token ids are in ``[0, vocab_size)``.
        max_total_tokens: KV slots in the pool (prompt + output tokens of every request at once).
        max_running_requests: requests the scheduler admits at once.
        tokenizer: the model's :class:`sgrt.models.tokenizer.Tokenizer` (chat template included).
        model_path: the weight store loaded (a GGUF file or an HF folder), ``""`` when unknown.
        tokenizer_path: the folder the tokenizer was read from, ``""`` when unknown.
        source: what the model spec resolved to (``"gguf:<file>"`` / ``"hf:<folder>"``).
        model_type: the config's ``model_type`` (``"llama"``, ``"qwen3"``...), or None.
        architectures: the config's architectures (``["LlamaForCausalLM"]``).
        dtype: the weights' dtype name (``"float32"``, ``"bfloat16"``), or None.
        device: ``"cpu"`` or ``"cuda[:n]"``.
    """

    model_name: str
    context_length: int
    vocab_size: int
    max_total_tokens: int
    tokenizer: Any
    max_running_requests: int = 0
    model_path: str = ""
    tokenizer_path: str = ""
    source: str = ""
    model_type: str | None = None
    architectures: tuple[str, ...] = field(default_factory=tuple)
    dtype: str | None = None
    device: str = "cpu"

    @property
    def context_room(self) -> int:
        """Tokens one request may hold: the smaller of the context window and the KV pool."""
        return min(self.context_length, self.max_total_tokens)


@runtime_checkable
class EngineClient(Protocol):
    """The request API of an engine (implemented by :class:`sgrt.engine.Engine`).

    ``submit`` may be called from any thread; a handle streams chunks (``astream()``,
    ``iter(handle)``) and ends with a :class:`~sgrt.engine.outputs.Result`.
    """

    @property
    def info(self) -> EngineInfo:
        """The served model and the engine's limits."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (the same object as ``info.tokenizer``)."""
        ...

    def submit(self, prompt: str | list[int], params: SamplingParams | dict | None = None,
               request_id: str | None = None) -> RequestHandle:
        """Queue a request; return its handle at once.

        Raises:
            InvalidRequest: a bad sampling field (named), an empty prompt.
            ContextLengthExceeded: the prompt does not fit the context window.
            CapacityError: prompt plus ``max_tokens`` exceeds the whole KV pool.
        """
        ...

    def stream(self, prompt: str | list[int], params: SamplingParams | dict | None = None) -> Iterator[StreamChunk]:
        """Submit and iterate over the request's chunks (blocking)."""
        ...

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown ids are ignored)."""
        ...

    def flush_cache(self) -> None:
        """Drop every unlocked prefix-cache entry (blocks until done)."""
        ...

    def is_alive(self) -> bool:
        """Whether the engine still serves requests."""
        ...

    def stats(self) -> dict[str, Any]:
        """Engine-wide figures: ``running``, ``waiting``, pool usage, cache hit rate..."""
        ...

    @property
    def metrics(self) -> EngineMetrics | None:
        """The engine's own observations (latency histograms), or None when it keeps none."""
        ...
