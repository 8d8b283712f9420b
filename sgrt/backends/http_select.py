"""``select`` for :class:`sgrt.backends.http.RuntimeEndpoint`: each option scored by its tokens'
log-probabilities after the prompt, by the means the server has: sgrt's prefill-only
``/generate`` with prompt log-probabilities, vLLM's ``prompt_logprobs``, else ``echo`` +
``logprobs`` on ``/v1/completions``."""
from __future__ import annotations

import time
from collections.abc import Sequence

from sgrt.backends.base import ChoiceScore
from sgrt.errors import InvalidRequest
from sgrt.token_ids import common_prefix_len


class SelectMixin:
    """The ``select`` scoring methods of :class:`~sgrt.backends.http.RuntimeEndpoint`."""

    # ---- select -------------------------------------------------------------------------------
    def score_choices(self, prompt: str, choices: Sequence[str], unconditional: bool = False) -> list[ChoiceScore]:
        """sgrt: prefill ``prompt`` once, then score every option (and, with ``unconditional``,
        every option alone) in one batch of prefill-only ``/generate`` requests, aligned as
        :meth:`sgrt.backends.local.LocalBackend.score_choices` aligns them. vLLM:
        ``prompt_logprobs``; other servers: ``echo`` + ``logprobs`` on ``/v1/completions``."""
        with self._route(prompt):
            return self._score_choices(prompt, choices, unconditional)

    def _score_choices(self, prompt: str, choices: Sequence[str], unconditional: bool) -> list[ChoiceScore]:
        if self.adapter.select == "prompt_logprobs":
            return self._score_by_prompt_logprobs(prompt, choices, unconditional)
        if self.adapter.select == "forced_tokens":
            return self._score_by_forced_tokens(prompt, choices, unconditional)
        if not self.is_sgrt:
            return self._score_by_echo(prompt, choices, unconditional)
        ids = self.encode([prompt] + [prompt + c for c in choices])
        prefix_ids, full = ids[0], ids[1:]
        self._prefill_ids(prefix_ids)
        starts = [min(common_prefix_len(prefix_ids, f), len(f) - 1) for f in full]
        # NOTE: with unconditional, each option's own scored ids go alone too (SGLang's rule).
        alone = [f[s:] for f, s in zip(full, starts)] if unconditional else []
        body = {"input_ids": full + alone, "sampling_params": {"max_tokens": 0}, "return_logprob": True,
                "logprob_start_len": starts + [0] * len(alone), "return_text_in_logprobs": True}
        outs = self.client.request("POST", "/generate", body)
        scores, kept = [], []
        for choice, out in zip(choices, outs[:len(choices)]):
            meta = out["meta_info"]
            self._native_meta(meta, time.perf_counter())  # raises for an abort
            entries = meta.get("input_token_logprobs") or []
            keep = [j for j, (lp, _, _) in enumerate(entries) if lp is not None]
            kept.append(keep)
            scores.append(ChoiceScore(choice=choice, token_ids=[entries[j][1] for j in keep],
                                      token_logprobs=[entries[j][0] for j in keep],
                                      token_texts=[entries[j][2] for j in keep],
                                      prompt_tokens=meta["prompt_tokens"], cached_tokens=meta["cached_tokens"]))
        for sc, keep, out in zip(scores, kept, outs[len(choices):]):
            lps = [lp for lp, _, _ in out["meta_info"].get("input_token_logprobs") or []]
            sc.unconditional_logprobs = [lps[j] if j < len(lps) else None for j in keep]
        return scores

    def _score_by_echo(self, prompt: str, choices: Sequence[str], unconditional: bool) -> list[ChoiceScore]:
        full = self._echo_logprobs([prompt + c for c in choices], "select")
        scores = []
        for choice, (tokens, lps, offsets, n_prompt) in zip(choices, full):
            k = next((i for i, (off, tok) in enumerate(zip(offsets, tokens)) if off + len(tok) > len(prompt)),
                     len(tokens))
            k = max(min(k, len(tokens) - 1), 1 if len(tokens) > 1 else 0)
            pairs = [(lp, tok) for lp, tok in zip(lps[k:], tokens[k:]) if lp is not None]
            scores.append(ChoiceScore(choice=choice, token_ids=[self._token_id(t) for _, t in pairs],
                                      token_logprobs=[lp for lp, _ in pairs], token_texts=[t for _, t in pairs],
                                      prompt_tokens=n_prompt, cached_tokens=0))
        if unconditional:
            for sc, (_, lps, _, _) in zip(scores, self._echo_logprobs(list(choices), "select")):
                n = len(sc.token_logprobs)
                sc.unconditional_logprobs = list(lps[:n]) + [None] * max(0, n - len(lps))
        return scores

    def _echo_logprobs(self, texts: list[str], what: str) -> list[tuple[list[str], list, list[int], int]]:
        """Per text: (tokens, logprobs, text offsets, prompt token count) of the prompt itself."""
        generated = self.adapter.echo_max_tokens
        body = {"model": self.model, "prompt": texts, "max_tokens": generated, "echo": True, "logprobs": 0,
                "temperature": 0.0}
        try:
            try:
                out = self.client.request("POST", "/v1/completions", body)
            except InvalidRequest as e:
                if generated or (e.field != "max_tokens" and "max_tokens" not in str(e)):
                    raise
                out = self.client.request("POST", "/v1/completions", {**body, "max_tokens": 1})
                generated = 1
        except InvalidRequest as e:
            raise self.adapter.refuse("select", self.base_url, "it needs prompt log-probabilities (echo + logprobs "
                                      f"on /v1/completions), which the server refused: {e}") from None
        results = sorted(out.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(results) != len(texts):
            raise InvalidRequest(f"{what}: {self.engine} at {self.base_url} answered {len(results)} choices for "
                                 f"{len(texts)} prompts", field="select")
        rows = []
        for choice in results:
            lp = choice.get("logprobs") or {}
            tokens = list(lp.get("tokens") or [])
            values = list(lp.get("token_logprobs") or [])
            offsets = list(lp.get("text_offset") or [])
            if generated:
                tokens, values, offsets = tokens[:-1], values[:-1], offsets[:-1]
            if not tokens or len(offsets) != len(tokens) or all(v is None for v in values):
                raise self.adapter.refuse("select", self.base_url, "it needs prompt log-probabilities, and the "
                                          "server returned none for echo + logprobs")
            rows.append((tokens, values, offsets, len(tokens)))
        return rows

    def _score_by_forced_tokens(self, prompt: str, choices: Sequence[str],
                                unconditional: bool) -> list[ChoiceScore]:
        """llama.cpp: for each option, the ids of ``prompt + option`` (the server's ``/tokenize``)
        split where they stop matching the prompt's; the head goes as the prompt (token ids) and
        the tail is forced by a ``<[id]>`` grammar, each forced token coming back with its
        log-probability under the model alone (pre-sampling). The same tokens and alignment as
        the echo and ``/generate`` paths score, with nothing approximated.

        Raises:
            InvalidRequest: (``field`` ``select``) no llguidance on the server, an option with no
                prompt token before it, or an answer that did not follow the forced tokens.
        """
        self._require_llguidance("select")
        prefix_ids = self._server_tokenize(prompt)
        scores = []
        for choice in choices:
            ids = self._server_tokenize(prompt + choice)
            k = max(min(common_prefix_len(prefix_ids, ids), len(ids) - 1), 1 if len(ids) > 1 else 0)
            lps, texts, cached = self._forced_logprobs(ids[:k], ids[k:])
            scores.append(ChoiceScore(choice=choice, token_ids=list(ids[k:]), token_logprobs=lps, token_texts=texts,
                                      prompt_tokens=len(ids), cached_tokens=cached))
        if unconditional:
            for sc in scores:
                alone = self._server_tokenize(sc.choice)
                # NOTE: scored from position 1 (position 0 has no context), as the other paths.
                lps = [None] + (self._forced_logprobs(alone[:1], alone[1:])[0] if len(alone) > 1 else [])
                n = len(sc.token_logprobs)
                sc.unconditional_logprobs = lps[:n] + [None] * max(0, n - len(lps))
        return scores

    def _server_tokenize(self, text: str) -> list[int]:
        """The ids llama.cpp's ``/tokenize`` gives ``text``, special tokens (BOS) added as its
        completions add them to a text prompt."""
        out = self.client.request("POST", "/tokenize", {"content": text, "add_special": True})
        return [int(t["id"]) if isinstance(t, dict) else int(t) for t in out["tokens"]]

    def _forced_logprobs(self, prompt_ids: list[int], forced: list[int]) -> tuple[list[float], list[str], int]:
        """(log-probabilities, texts) of ``forced`` after ``prompt_ids``, and the cached prompt tokens."""
        if not prompt_ids:
            raise self.adapter.refuse("select", self.base_url, "an option must follow at least one prompt token")
        body = self.adapter.forced_tokens_body(self.model, prompt_ids, forced)
        out = self.client.request("POST", "/v1/completions", body)
        choice = (out.get("choices") or [{}])[0]
        entries = (choice.get("logprobs") or {}).get("content") or []
        got = [e.get("id") for e in entries]
        if got != list(forced) or any(e.get("logprob") is None for e in entries):
            raise self.adapter.refuse("select", self.base_url, f"the server did not follow the forced tokens "
                                      f"{list(forced)} (it returned {got})")
        cached = ((out.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return [float(e["logprob"]) for e in entries], [str(e.get("token", "")) for e in entries], int(cached)

    def _score_by_prompt_logprobs(self, prompt: str, choices: Sequence[str],
                                  unconditional: bool) -> list[ChoiceScore]:
        """vLLM: one ``/v1/completions`` request with ``prompt_logprobs=0`` for every
        ``prompt + choice`` (the shared prefix is computed once by the server's prefix cache);
        the option's tokens start where its ids stop matching the prompt's (``/tokenize``)."""
        texts = [prompt + c for c in choices]
        prefix_ids = self.encode(prompt)
        rows = self._prompt_logprobs(texts)
        scores = []
        for choice, (ids, lps, texts_, n_cached) in zip(choices, rows):
            k = max(min(common_prefix_len(prefix_ids, ids), len(ids) - 1), 1 if len(ids) > 1 else 0)
            pairs = [(lp, t, txt) for lp, t, txt in zip(lps[k:], ids[k:], texts_[k:]) if lp is not None]
            scores.append(ChoiceScore(choice=choice, token_ids=[t for _, t, _ in pairs],
                                      token_logprobs=[lp for lp, _, _ in pairs], token_texts=[x for _, _, x in pairs],
                                      prompt_tokens=len(ids), cached_tokens=n_cached))
        if unconditional:
            for sc, (_, lps, _, _) in zip(scores, self._prompt_logprobs(list(choices))):
                n = len(sc.token_logprobs)
                sc.unconditional_logprobs = list(lps[:n]) + [None] * max(0, n - len(lps))
        return scores

    def _prompt_logprobs(self, texts: list[str]) -> list[tuple[list[int], list, list[str], int]]:
        """Per text: (prompt token ids, their logprobs (first None), token texts, cached tokens)."""
        ids_per_text = self.encode(texts)
        body = {"model": self.model, "prompt": texts, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        try:
            out = self.client.request("POST", "/v1/completions", body)
        except InvalidRequest as e:
            raise self.adapter.refuse("select", self.base_url, f"the server refused prompt_logprobs: {e}") from None
        results = sorted(out.get("choices") or [], key=lambda c: c.get("index", 0))
        cached = ((out.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        rows = []
        for ids, choice in zip(ids_per_text, results):
            entries = choice.get("prompt_logprobs")
            if not entries or len(entries) != len(ids):
                raise self.adapter.refuse("select", self.base_url, "the server returned no prompt_logprobs "
                                          f"aligned with the prompt's {len(ids)} tokens")
            lps: list[float | None] = []
            toks: list[str] = []
            for tid, entry in zip(ids, entries):
                hit = (entry or {}).get(str(tid))
                lps.append(None if hit is None else hit.get("logprob"))
                toks.append("" if hit is None else str(hit.get("decoded_token", "")))
            rows.append((list(ids), lps, toks, cached // max(len(texts), 1)))
        if len(rows) != len(texts):
            raise InvalidRequest(f"select: {self.engine} at {self.base_url} answered {len(rows)} choices for "
                                 f"{len(texts)} prompts", field="select")
        return rows
