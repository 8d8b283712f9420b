"""The in-process backend: programs call an :class:`sgrt.engine.Engine` directly.

``LocalBackend(engine)`` wraps an engine someone else owns; ``Runtime(model=..., **options)``
creates one and owns it (``sgrt.set_default_backend(sgrt.Runtime())``).

Prompts are tokenized here (not by the engine), so that ``select`` can align each option's
tokens with the prompt's. Prefix sharing is implicit: the engine's radix cache matches token
prefixes, and :meth:`LocalBackend.cache_prefix` (a prefill-only request, ``max_tokens=0``)
puts a prefix in before the requests that share it are submitted.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from sgrt.backends.base import BaseBackend, ChoiceScore, GenChunk, GenOutput, common_prefix_len
from sgrt.engine import Result, SamplingParams, StreamChunk
from sgrt.errors import RequestAborted


class LocalBackend(BaseBackend):
    """A backend over an in-process engine (anything with the ``Engine`` request API).

    Args:
        engine: the engine (``submit``, ``abort``, ``flush_cache``, ``stats``, ``tokenizer``).
        chat_template: an explicit ``sgrt.lang.ChatTemplate``; by default it is derived from the
            tokenizer's chat template.
    """

    def __init__(self, engine: Any, chat_template: Any = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        if chat_template is not None:
            self.chat_template = chat_template
        self._bos_id = self._find_bos_id()

    def _find_bos_id(self) -> int | None:
        """The BOS id the tokenizer adds to a plain text (None for SmolLM2, which adds none)."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is None:
            return None
        try:
            ids = self.tokenizer.encode("a", add_special_tokens=True)
        except TypeError:
            return None
        return bos if ids and ids[0] == bos else None

    # ---- tokens ---------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Prompt ids of ``text``: special-token text becomes its id; BOS where the model's
        tokenizer adds one."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if self._bos_id is not None and (not ids or ids[0] != self._bos_id):
            ids = [self._bos_id] + ids
        return ids

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ---- chat template --------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages,
                                                  add_generation_prompt=add_generation_prompt)

    def bos_token(self) -> str | None:
        """The BOS text, only if :meth:`encode` adds BOS itself (so templates must not)."""
        if self._bos_id is None:
            return None
        return self.tokenizer.decode([self._bos_id], skip_special_tokens=False)

    # ---- generation -----------------------------------------------------------------------

    def _params(self, params: dict[str, Any]) -> SamplingParams:
        return SamplingParams.from_dict(params)

    def _meta(self, result: Result, start: float) -> dict[str, Any]:
        meta = result.meta_info(time.perf_counter() - start)
        if result.output_logprobs is not None:
            meta["output_token_logprobs"] = [
                (lp, t, self._token_text(t))
                for lp, t in zip(result.output_logprobs, result.token_ids)]
        if result.output_top_logprobs:
            meta["output_top_logprobs"] = [
                [(lp, t, self._token_text(t)) for t, lp in top]
                for top in result.output_top_logprobs]
        return meta

    @staticmethod
    def _check(result: Result) -> Result:
        if result.finish_reason == "abort":
            raise RequestAborted(
                f"request {result.request_id} aborted: {result.error or 'no reason given'}")
        return result

    def generate(self, prompt: str, params: dict[str, Any],
                 request_id: str | None = None) -> GenOutput:
        start = time.perf_counter()
        handle = self.engine.submit(self.encode(prompt), self._params(params),
                                    request_id=request_id)
        result = self._check(handle.result())
        return GenOutput(result.text, self._meta(result, start))

    def generate_batch(self, prompts: Sequence[str],
                       params: Sequence[dict[str, Any]]) -> list[GenOutput]:
        start = time.perf_counter()
        handles = [self.engine.submit(self.encode(p), self._params(sp))
                   for p, sp in zip(prompts, params)]
        outs = []
        for h in handles:
            result = self._check(h.result())
            outs.append(GenOutput(result.text, self._meta(result, start)))
        return outs

    def generate_stream(self, prompt: str, params: dict[str, Any],
                        request_id: str | None = None) -> Iterator[GenChunk]:
        start = time.perf_counter()
        handle = self.engine.submit(self.encode(prompt), self._params(params),
                                    request_id=request_id)
        finished = False
        try:
            for chunk in handle:
                chunk: StreamChunk
                logprobs = None
                if chunk.logprobs is not None:
                    logprobs = [(lp, t, self._token_text(t))
                                for lp, t in zip(chunk.logprobs, chunk.token_ids)]
                top = None
                if chunk.top_logprobs:
                    top = [[(lp, t, self._token_text(t)) for t, lp in row]
                           for row in chunk.top_logprobs]
                meta = None
                if chunk.finished:
                    finished = True
                    self._check(chunk.result)
                    meta = self._meta(chunk.result, start)
                yield GenChunk(chunk.text, list(chunk.token_ids), logprobs, top,
                               chunk.finished, meta)
                if chunk.finished:
                    return
        finally:
            if not finished:  # the reader stopped early (or failed): free the request
                handle.abort()

    # ---- select ---------------------------------------------------------------------------

    def score_choices(self, prompt: str, choices: Sequence[str],
                      unconditional: bool = False) -> list[ChoiceScore]:
        """Prefill ``prompt`` once, then score every option in one batch of prefill-only requests.

        Each option's tokens are those of ``prompt + option`` from the first position where they
        differ from ``prompt``'s own tokens (token healing: a token that merges the prompt's end
        with the option's start is scored too, and the same way for every option).
        """
        prefix_ids = self.encode(prompt)
        self._prefill(prefix_ids)
        full = [self.encode(prompt + c) for c in choices]
        starts = [min(common_prefix_len(prefix_ids, ids), len(ids) - 1) for ids in full]
        handles = [
            self.engine.submit(ids, SamplingParams(max_tokens=0, return_logprob=True,
                                                   logprob_start_len=start))
            for ids, start in zip(full, starts)]
        uncond_handles = []
        if unconditional:
            uncond_handles = [
                self.engine.submit(self.encode(c), SamplingParams(
                    max_tokens=0, return_logprob=True, logprob_start_len=0))
                for c in choices]
        scores = []
        for choice, ids, start, h in zip(choices, full, starts, handles):
            result = self._check(h.result())
            lps = list(result.prompt_logprobs or [])[-(len(ids) - start):]
            tok = ids[start:]
            pairs = [(lp, t) for lp, t in zip(lps, tok) if lp is not None]
            scores.append(ChoiceScore(
                choice=choice,
                token_ids=[t for _, t in pairs],
                token_logprobs=[lp for lp, _ in pairs],
                token_texts=[self._token_text(t) for _, t in pairs],
                prompt_tokens=result.prompt_tokens,
                cached_tokens=result.cached_tokens,
            ))
        for sc, h in zip(scores, uncond_handles):
            result = self._check(h.result())
            lps = list(result.prompt_logprobs or [])
            # NOTE: aligned to the option's own tokenization, which may differ from how it
            # tokenizes after the prompt; the method averages over positions, so keep the
            # shorter alignment.
            sc.unconditional_logprobs = lps[: len(sc.token_logprobs)] + [None] * max(
                0, len(sc.token_logprobs) - len(lps))
        return scores

    # ---- prefix cache ---------------------------------------------------------------------

    def _prefill(self, ids: list[int]) -> Result:
        return self._check(self.engine.submit(ids, SamplingParams(max_tokens=0)).result())

    def cache_prefix(self, prompt: str) -> dict[str, Any]:
        if not prompt:
            return {}
        result = self._prefill(self.encode(prompt))
        return {"prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens}

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    # ---- control --------------------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def get_server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"backend": type(self).__name__}
        loaded = getattr(self.engine, "loaded", None)
        for attr in ("path", "source"):
            if loaded is not None and getattr(loaded, attr, None) is not None:
                info[f"model_{attr}"] = str(getattr(loaded, attr))
        try:
            info["stats"] = self.engine.stats()
        except Exception:  # noqa: BLE001 - info is best effort
            pass
        return info


class Runtime(LocalBackend):
    """An engine this process loads and owns, as a DSL backend.

    ``sgrt.set_default_backend(sgrt.Runtime(model="smollm2-135m-instruct", dtype="float32"))``.
    ``**engine_options`` are :class:`sgrt.engine.EngineConfig` fields (``enable_radix_cache``,
    ``max_total_tokens``, ...). Use as a context manager or call :meth:`shutdown`.

    Raises:
        ModelLoadError: the model could not be loaded.
        TypeError: an unknown engine option.
    """

    def __init__(self, model: Any = "smollm2-135m-instruct", dtype: str = "float32",
                 device: str = "cpu", chat_template: Any = None, **engine_options: Any):
        from sgrt.engine import Engine

        super().__init__(Engine(model=model, dtype=dtype, device=device, **engine_options),
                         chat_template=chat_template)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
