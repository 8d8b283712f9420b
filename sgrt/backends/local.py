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

from sgrt.backends.base import (
    BaseBackend,
    ChoiceScore,
    GenChunk,
    GenOutput,
    ParamsLike,
    as_sampling_params,
    next_token_request,
    split_stop_regex,
    stop_stream_at_regex,
    strip_next_token,
)
from sgrt.engine import EngineClient, Result, SamplingParams, StreamChunk
from sgrt.errors import InvalidRequest, RequestAborted
from sgrt.models.tokenizer import encode_prompt_text, plain_text_bos_id
from sgrt.token_ids import common_prefix_len


class LocalBackend(BaseBackend):
    """A backend over an in-process engine (an :class:`~sgrt.engine.client.EngineClient`).

    Args:
        engine: the engine (``submit``, ``abort``, ``flush_cache``, ``stats``, ``info``).
        chat_template: an explicit ``sgrt.lang.ChatTemplate``; by default it is derived from the
            tokenizer's chat template.
    """

    def __init__(self, engine: EngineClient, chat_template: Any = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        if chat_template is not None:
            self.chat_template = chat_template
        self._bos_id = plain_text_bos_id(self.tokenizer)

    # ---- tokens ---------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Prompt ids of ``text``: special-token text becomes its id; BOS where the model's
        tokenizer adds one."""
        return encode_prompt_text(self.tokenizer, text, self._bos_id)

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

    def _meta(self, result: Result, start: float) -> dict[str, Any]:
        meta = result.meta_info(time.perf_counter() - start)
        if result.output_logprobs is not None:
            meta["output_token_logprobs"] = [
                (lp, t, self._token_text(t))
                for lp, t in zip(result.output_logprobs, result.token_ids)]
            if result.prompt_logprobs is not None:
                # The prompt's entries from logprob_start_len on (its last len(...) tokens).
                n = len(result.prompt_logprobs)
                ids = result.prompt_token_ids[len(result.prompt_token_ids) - n:]
                meta["input_token_logprobs"] = [
                    (lp, t, self._token_text(t)) for lp, t in zip(result.prompt_logprobs, ids)]
                if result.prompt_top_logprobs is not None:
                    meta["input_top_logprobs"] = [
                        [(lp, t, self._token_text(t)) for t, lp in top]
                        for top in result.prompt_top_logprobs]
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

    def generate(self, prompt: str, params: ParamsLike,
                 request_id: str | None = None) -> GenOutput:
        """Complete ``prompt``; ``params`` may hold SGLang's ``stop_regex`` (applied while the
        tokens stream in; the request is aborted at the match) and its ``max_tokens=0`` next-token
        idiom (see ``sgrt.backends.base.next_token_request``)."""
        params, patterns = split_stop_regex(params)
        params, next_only = next_token_request(params)
        if patterns and not next_only:
            chunks = list(self._stream(prompt, params, request_id, patterns))
            return GenOutput("".join(c.text for c in chunks), chunks[-1].meta_info or {})
        start = time.perf_counter()
        handle = self.engine.submit(self.encode(prompt), params, request_id=request_id)
        result = self._check(handle.result())
        if next_only:
            return GenOutput("", strip_next_token(self._meta(result, start)))
        return GenOutput(result.text, self._meta(result, start))

    def generate_batch(self, prompts: Sequence[str],
                       params: Sequence[ParamsLike]) -> list[GenOutput]:
        params = [as_sampling_params(p) for p in params]
        if any(p.stop_regex or next_token_request(p)[1] for p in params):
            # NOTE: these need their own stream each; run them from threads so they still batch.
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max(1, len(prompts))) as pool:
                return list(pool.map(self.generate, prompts, params))
        start = time.perf_counter()
        handles = [self.engine.submit(self.encode(p), sp) for p, sp in zip(prompts, params)]
        outs = []
        for h in handles:
            result = self._check(h.result())
            outs.append(GenOutput(result.text, self._meta(result, start)))
        return outs

    def generate_stream(self, prompt: str, params: ParamsLike,
                        request_id: str | None = None) -> Iterator[GenChunk]:
        params, patterns = split_stop_regex(params)
        params, next_only = next_token_request(params)
        if next_only:
            return self.next_token_stream(prompt, params, request_id)
        return self._stream(prompt, params, request_id, patterns)

    def _stream(self, prompt: str, params: SamplingParams, request_id: str | None,
                patterns: list) -> Iterator[GenChunk]:
        start = time.perf_counter()
        handle = self.engine.submit(self.encode(prompt), params, request_id=request_id)
        chunks = self._chunks(handle, start)
        if not patterns:
            return chunks

        def stopped_meta(text: str, n_tokens: int, pattern: str) -> dict[str, Any]:
            handle.abort()
            result = handle.result()
            meta = self._meta(result, start)
            ids = list(result.token_ids)[:n_tokens]
            meta.update(completion_tokens=len(ids), output_token_ids=ids, finish_reason="stop",
                        matched=pattern)
            for key in ("output_token_logprobs", "output_top_logprobs"):
                if key in meta:
                    meta[key] = meta[key][:n_tokens]
            return meta

        return stop_stream_at_regex(chunks, patterns, stopped_meta)

    def _chunks(self, handle: Any, start: float) -> Iterator[GenChunk]:
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
        with the option's start is scored too, and the same way for every option). With
        ``unconditional``, those same token ids are scored alone in the same batch (SGLang's
        rule), so both lists have one entry per token.
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
                self.engine.submit(ids[start:], SamplingParams(
                    max_tokens=0, return_logprob=True, logprob_start_len=0))
                for ids, start in zip(full, starts)]
        scores, kept = [], []
        for choice, ids, start, h in zip(choices, full, starts, handles):
            result = self._check(h.result())
            lps = list(result.prompt_logprobs or [])[-(len(ids) - start):]
            tok = ids[start:]
            # NOTE: only an option at the very start of an empty prompt has a None (position 0).
            keep = [j for j, lp in enumerate(lps) if lp is not None]
            kept.append(keep)
            scores.append(ChoiceScore(
                choice=choice,
                token_ids=[tok[j] for j in keep],
                token_logprobs=[lps[j] for j in keep],
                token_texts=[self._token_text(tok[j]) for j in keep],
                prompt_tokens=result.prompt_tokens,
                cached_tokens=result.cached_tokens,
            ))
        for sc, keep, h in zip(scores, kept, uncond_handles):
            alone = list(self._check(h.result()).prompt_logprobs or [])
            sc.unconditional_logprobs = [alone[j] if j < len(alone) else None for j in keep]
        return scores

    # ---- prefix cache ---------------------------------------------------------------------

    def _prefill(self, ids: list[int]) -> Result:
        return self._check(self.engine.submit(ids, SamplingParams(max_tokens=0)).result())

    def cache_prefix(self, prompt: str) -> dict[str, Any]:
        if not prompt:
            return {}
        result = self._prefill(self.encode(prompt))
        return {"prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens}

    def flush_cache(self, empty_cache: bool = True) -> None:
        """Empty the radix cache; with ``empty_cache`` on a CUDA engine also hand torch's cached
        blocks back to the driver (SGLang's flag; nothing to do on the CPU)."""
        self.engine.flush_cache()
        if empty_cache and self._device().startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    # ---- control --------------------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def _device(self) -> str:
        return self.engine.info.device

    @property
    def model_info(self) -> dict[str, Any]:
        """SGLang's ``/get_model_info`` answer for this model: ``model_path``, ``tokenizer_path``,
        ``is_generation``, ``has_image_understanding``, ``has_audio_understanding``,
        ``model_type``, ``architectures`` (from the engine's :class:`~sgrt.engine.EngineInfo`)."""
        info = self.engine.info
        return {
            "model_path": info.model_path,  # (the GGUF file or HF folder loaded)
            "tokenizer_path": info.tokenizer_path or info.model_path,
            "is_generation": True,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": info.model_type,
            "architectures": list(info.architectures),
            "source": info.source,
        }

    def get_server_info(self) -> dict[str, Any]:
        """Engine facts under the keys SGLang's ``/get_server_info`` uses (``model_path``,
        ``tokenizer_path``, ``context_length``, ``max_total_num_tokens``, ``dtype``, ``device``,
        ``version``...), plus ``backend``, ``model_source`` and the engine's ``stats``."""
        import sgrt

        engine_info = self.engine.info
        info = dict(self.model_info)
        info["backend"] = type(self).__name__
        info["model_source"] = info.pop("source")
        info["context_length"] = engine_info.context_length
        info["max_total_num_tokens"] = engine_info.max_total_tokens
        info["dtype"] = engine_info.dtype
        info["device"] = engine_info.device
        info["served_model_name"] = info["model_path"].rstrip("/").rsplit("/", 1)[-1] or None
        info["skip_tokenizer_init"] = False
        info["version"] = sgrt.__version__
        try:
            info["stats"] = self.engine.stats()
        except Exception:  # noqa: BLE001 - info is best effort
            pass
        return info

    def get_tokenizer(self) -> Any:
        """The model's transformers tokenizer, as SGLang's ``Runtime.get_tokenizer()`` returns
        it (``encode``, ``decode``, ``apply_chat_template``)."""
        return getattr(self.tokenizer, "hf", self.tokenizer)

    async def async_generate(self, prompt: str, sampling_params: dict[str, Any] | None = None):
        """Stream a plain completion of ``prompt``, yielding new text pieces (SGLang's
        ``Runtime.async_generate`` / ``add_request``).

        ``sampling_params`` uses SGLang's server names (``max_new_tokens``, ``min_new_tokens``,
        ``temperature``, ``stop``...); unlike the DSL, an unset temperature means SGLang's 1.0.

        Raises:
            InvalidRequest: an unknown or bad sampling field.
        """
        params = SamplingParams.from_dict(srt_sampling_params(sampling_params))
        handle = self.engine.submit(self.encode(prompt), params)
        finished = False
        try:
            async for chunk in handle.astream():
                if chunk.finished:
                    finished = True
                    self._check(chunk.result)
                if chunk.text:
                    yield chunk.text
        finally:
            if not finished:
                handle.abort()

    add_request = async_generate


#: SGLang's ``/generate`` sampling field names that sgrt spells differently.
SRT_FIELD_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
#: SGLang server fields with no sgrt meaning that change nothing in the output, dropped.
SRT_IGNORED_FIELDS = ("spaces_between_special_tokens",)


def srt_sampling_params(sampling_params: dict[str, Any] | None) -> dict[str, Any]:
    """SGLang server sampling parameters as sgrt ``SamplingParams`` fields (SGLang's defaults:
    ``max_new_tokens=128``, ``temperature=1.0``).

    Raises:
        InvalidRequest: (field ``sampling_params``) not a dict.
    """
    if sampling_params is None:
        sampling_params = {}
    if not isinstance(sampling_params, dict):
        raise InvalidRequest(f"sampling_params must be a dict, got {type(sampling_params).__name__}",
                             field="sampling_params")
    out: dict[str, Any] = {"temperature": 1.0}
    for key, value in sampling_params.items():
        if key in SRT_IGNORED_FIELDS:
            continue
        out[SRT_FIELD_NAMES.get(key, key)] = value
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    return out
