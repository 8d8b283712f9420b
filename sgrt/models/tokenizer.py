"""A thin wrapper over a transformers fast tokenizer: text <-> ids, chat template, token bytes.

A load reads it, where it can, from a snapshot in sgrt's cache (:mod:`sgrt.models.
tokenizer_snapshot`: the ``tokenizers`` pipeline transformers built, and the facts it gave), and
imports transformers only when something needs it (``hf``, a chat template rendered).

The constrained-decoding layer needs the exact bytes each token stands for (``token_bytes``); the
engine needs the set of ids that end a turn (``eos_token_ids``). Both are computed here from the
vocabulary itself, never by decoding, because decoding a lone token loses partial UTF-8 bytes.
"""
from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from sgrt.errors import InvalidRequest, ModelLoadError

# Tokens that end a turn or a document in common chat vocabularies. Each that exists in the
# vocabulary joins ``eos_token_ids``, as llama.cpp's end-of-generation set does.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
)

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character table used by byte-level BPE vocabularies.

    Bytes that are printable Latin-1 map to themselves; the other 68 map, in order, to U+0100 and
    up (so 0x20, the space, becomes ``Ġ`` U+0120 and 0x0A becomes ``Ċ``).
    """
    keep = list(range(ord("!"), ord("~") + 1))
    keep += list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """The inverse of :func:`bytes_to_unicode`: printable character -> byte value."""
    return {c: b for b, c in bytes_to_unicode().items()}


def _decoder_kinds(backend: Any) -> set[str]:
    """Names of the decoder steps of a ``tokenizers.Tokenizer`` (``{"ByteLevel"}``, ...)."""
    decoder = backend.decoder
    spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
    kinds: set[str] = set()
    stack = [spec]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if node.get("type"):
            kinds.add(node["type"])
        stack.extend(node.get("decoders") or [])
        if node.get("type") == "Replace" and node.get("content") == " ":
            kinds.add("SpaceReplace")
    return kinds


def _decodes_with_backend(cls: type) -> bool:
    """Whether ``cls(...).decode(ids, skip_special_tokens=s, clean_up_tokenization_spaces=False)``
    is exactly ``backend_tokenizer.decode(ids, skip_special_tokens=s)``: transformers' own
    ``TokenizersBackend._decode`` (5.x) or ``PreTrainedTokenizerFast._decode`` (4.x), not one a
    model's tokenizer class replaces."""
    try:
        import transformers
    except ImportError:
        return False
    base = getattr(transformers, "TokenizersBackend", None) or getattr(transformers, "PreTrainedTokenizerFast", None)
    if base is None or not issubclass(cls, base):
        return False
    base_decode = transformers.PreTrainedTokenizerBase.decode
    return cls._decode is base._decode and cls.decode is base_decode


# Inputs past these sizes go through the ``tokenizers`` backend's batch calls, which release the
# GIL while Rust works (its single-text calls do not), so a long prompt does not stall the
# server's event loop and engine thread; shorter ones keep the cheaper single calls.
LONG_TEXT_CHARS = 16_384
LONG_IDS = 4_096

# (first loads of transformers' tokenizers; rare, so one lock for all of them)
_HF_LOAD_LOCK = threading.Lock()


def load_hf_tokenizer(folder: str | Path) -> Any:
    """transformers' tokenizer of a local folder (``AutoTokenizer``, never the network): what
    :meth:`Tokenizer.from_folder` wraps, :attr:`Tokenizer.hf` loads on first use, and the snapshot
    child keeps (:func:`sgrt.models.tokenizer_snapshot.main`).

    Raises:
        ModelLoadError: the folder has no tokenizer transformers loads (names the folder).
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises OSError / ValueError / KeyError here
        raise ModelLoadError(f"no loadable tokenizer in {folder}: {e}") from e


class Tokenizer:
    """Text <-> token ids for one model, plus the facts the engine and grammars need.

    Wraps a transformers fast tokenizer (``hf``), which other layers may use directly.
    Construct with :meth:`from_folder` or from an already loaded tokenizer, or with
    :meth:`from_pipeline` over its bare ``tokenizers`` pipeline (``hf`` then loaded on first use).

    Attributes:
        hf: the underlying ``transformers`` fast tokenizer.
        bos_token_id: id of the BOS token, or ``None``. Note that ``encode`` never adds it unless
            asked (``add_special_tokens=True``) and the tokenizer's own post-processor does so.
        eos_token_ids: ids that end generation: the tokenizer's EOS, the model config's
            ``eos_token_id`` (passed as ``extra_eos_token_ids``), and every end-of-turn token from
            :data:`END_OF_TURN_TOKENS` present in the vocabulary.
        special_token_ids: ids of tokens marked special (control tokens such as ``<|im_start|>``).
        vocab_size: ``len(hf)``, the number of ids the tokenizer can produce (base vocabulary plus
            added tokens). The model's embedding may have more rows (padding); those ids have no
            text and ``token_bytes`` returns ``b""`` for them.
    """

    def __init__(self, hf: Any, extra_eos_token_ids: Iterable[int] = ()):
        """Wrap ``hf`` (a ``PreTrainedTokenizerFast``-like object with ``backend_tokenizer``).

        Raises:
            ModelLoadError: if ``hf`` is not a fast (Rust ``tokenizers``) tokenizer.
        """
        if getattr(hf, "backend_tokenizer", None) is None:
            raise ModelLoadError(f"tokenizer {type(hf).__name__} is not a fast tokenizer; sgrt needs one")
        self._hf = hf
        self._hf_folder: Path | None = None
        self._pipeline: Any = None  # (from_pipeline's: encode without transformers)
        self._id_pipeline: Any = None  # (from_pipeline's: ids <-> vocabulary strings)
        self._chat_template: Any = None
        self.vocab_size: int = len(hf)
        self.bos_token_id: int | None = hf.bos_token_id
        self._eos_token_id: int | None = hf.eos_token_id
        added = hf.added_tokens_decoder  # {id: AddedToken}
        self._added: dict[int, str] = {i: t.content for i, t in added.items()}
        self.special_token_ids: set[int] = {i for i, t in added.items() if t.special}
        self.special_token_ids |= {i for i in hf.all_special_ids if i is not None}
        eos = {i for i in extra_eos_token_ids if i is not None}
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        vocab = hf.get_vocab()
        eos |= {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
        self.eos_token_ids: set[int] = eos
        # Whether the post-processor puts BOS in front (encode_prompt).
        self.adds_bos: bool = self.bos_token_id is not None and \
            hf.encode("a", add_special_tokens=True)[:1] == [self.bos_token_id] and \
            hf.encode("a", add_special_tokens=False)[:1] != [self.bos_token_id]
        self._set_decoder_kinds(hf.backend_tokenizer)
        # transformers' fast-tokenizer decode, without clean-up, is the Rust backend's decode
        # behind a few layers of Python argument handling; call the backend directly (the
        # streaming detokenizer decodes once per generated token) unless the class overrides it.
        self._decoder: Any = hf.backend_tokenizer if _decodes_with_backend(type(hf)) else None

    def _set_decoder_kinds(self, backend: Any) -> None:
        kinds = _decoder_kinds(backend)
        self._byte_level = "ByteLevel" in kinds
        self._metaspace = "Metaspace" in kinds or "SpaceReplace" in kinds
        self._all_bytes: list[bytes] | None = None

    @classmethod
    def from_pipeline(cls, pipeline: Any, facts: dict[str, Any], folder: str | Path,
                      extra_eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
        """A tokenizer over a bare ``tokenizers.Tokenizer`` ``pipeline`` and the facts
        transformers gave about it (:mod:`sgrt.models.tokenizer_snapshot`: ``vocab_size``,
        ``bos_token_id``, ``eos_token_id``, ``all_special_ids``, ``added`` as ``[id, content,
        special]`` rows, ``chat_template``, ``adds_bos``, and ``encode`` / ``decode``: whether the
        pipeline alone gives transformers' ids / text). transformers is imported, and ``folder``
        loaded by it, only when something needs it: :attr:`hf`, :meth:`apply_chat_template`, or
        an encode / decode the facts do not clear.

        Raises:
            KeyError, TypeError, ValueError: ``facts`` lacks a field or holds a malformed one.
        """
        self = cls.__new__(cls)
        self._hf = None
        self._hf_folder = Path(folder)
        self._pipeline = pipeline if facts["encode"] else None
        self._chat_template = facts["chat_template"]
        self.vocab_size = int(facts["vocab_size"])
        self.bos_token_id = facts["bos_token_id"]
        self._eos_token_id = facts["eos_token_id"]
        added = [(int(i), str(c), bool(sp)) for i, c, sp in facts["added"]]
        self._added = {i: c for i, c, _ in added}
        self.special_token_ids = {i for i, _, sp in added if sp} | {int(i) for i in facts["all_special_ids"]}
        eos = {i for i in extra_eos_token_ids if i is not None}
        if self._eos_token_id is not None:
            eos.add(self._eos_token_id)
        eos |= {i for i in (pipeline.token_to_id(t) for t in END_OF_TURN_TOKENS) if i is not None}
        self.eos_token_ids = eos
        self.adds_bos = bool(facts["adds_bos"])
        self._set_decoder_kinds(pipeline)
        self._id_pipeline = pipeline
        self._decoder = pipeline if facts["decode"] else None
        return self

    @property
    def hf(self) -> Any:
        """The transformers fast tokenizer (loaded from the tokenizer folder on first use where
        this one was read from a snapshot: ~1 s, transformers' imports).

        Raises:
            ModelLoadError: the folder's tokenizer does not load.
        """
        if self._hf is None:
            # NOTE: one load even when a server's warm-up thread and a request ask at once.
            with _HF_LOAD_LOCK:
                if self._hf is None:
                    hf = load_hf_tokenizer(self._hf_folder)
                    if self._chat_template is not None:
                        hf.chat_template = self._chat_template
                    self._hf = hf
        return self._hf

    @hf.setter
    def hf(self, value: Any) -> None:
        self._hf = value

    @property
    def chat_template(self) -> Any:
        """The model's chat template (a Jinja string, a dict of named ones, or None), without
        loading transformers; set it to replace the model's (``--chat-template``)."""
        if self._hf is not None:
            return getattr(self._hf, "chat_template", None)
        return self._chat_template

    @chat_template.setter
    def chat_template(self, value: Any) -> None:
        self._chat_template = value
        if self._hf is not None:
            self._hf.chat_template = value

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own EOS id (one of :attr:`eos_token_ids`), or None."""
        return self._eos_token_id

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary string ``token`` (``"Ġthe"``, ``"<|im_end|>"``), None if absent."""
        pipeline = self._id_pipeline if self._id_pipeline is not None else self.hf.backend_tokenizer
        return pipeline.token_to_id(token)

    @classmethod
    def from_folder(cls, folder: str | Path, extra_eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
        """Load the tokenizer files (``tokenizer.json`` etc.) of a local folder through transformers;
        never the network.

        Raises:
            ModelLoadError: the folder has no loadable fast tokenizer.
        """
        return cls(load_hf_tokenizer(folder), extra_eos_token_ids)

    # ---- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token text such as ``<|im_start|>`` becomes its one id.

        ``add_special_tokens=True`` lets the tokenizer's post-processor add BOS/EOS where it is
        configured to (SmolLM2's adds nothing).

        Raises:
            InvalidRequest: (field ``prompt``) ``text`` holds a lone surrogate (not UTF-8
                encodable), which the tokenizer's native code refuses with a bare TypeError.
        """
        try:
            if self._pipeline is not None:
                if len(text) < LONG_TEXT_CHARS:
                    return self._pipeline.encode(text, add_special_tokens=add_special_tokens).ids
                # NOTE: tokenizers' encode holds the GIL (2.4 s for 3 MB: every other thread of a
                # server stalls); its batch form releases it, as transformers' encode does.
                return self._pipeline.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            return self.hf.encode(text, add_special_tokens=add_special_tokens)
        except TypeError:
            # NOTE: checked only once the tokenizer has refused the text (not on every prompt)
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidRequest(f"prompt is not valid Unicode text ({e.reason} at character {e.start})",
                                     field="prompt") from None
            raise

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt: :meth:`encode`, with BOS in front when this tokenizer's own
        post-processor adds one (Gemma, Llama 3; not SmolLM2) and the text does not already start
        with it (a chat template writes it), as llama.cpp and transformers' ``tokenizer(text)``
        do. Models trained with BOS degenerate without it (Gemma 3 repeats one word)."""
        ids = self.encode(text)
        if self.adds_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (incomplete UTF-8 at either end becomes U+FFFD).

        No tokenization-space clean-up is applied, so ``decode(encode(s)) == s``.
        """
        if self._decoder is not None:
            if len(ids) < LONG_IDS:
                return self._decoder.decode(list(ids), skip_special_tokens=skip_special_tokens)
            # (the Rust decode holds the GIL; its batch form releases it: see encode)
            return self._decoder.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **template_kwargs: Any) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the model's template.

        Returns the prompt text (not ids); encode it with ``encode(text)`` (no extra BOS: the
        template writes whatever special tokens the model expects).

        Raises:
            InvalidRequest: (field ``messages``) the tokenizer has no chat template.
        """
        if not self.chat_template:
            raise InvalidRequest("this model's tokenizer has no chat template", field="messages")
        kwargs: dict[str, Any] = dict(template_kwargs)
        if tools is not None:
            kwargs["tools"] = tools
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           tokenize=False, **kwargs)

    # ---- token bytes --------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token ``token_id`` contributes to the output text.

        Byte-level BPE: each character of the vocabulary string maps back through GPT-2's
        byte table (``Ġ`` -> ``b" "``), so a token holding part of a multi-byte character yields
        just those bytes (SmolLM2 splits ``"工"`` into ``b"\\xe5\\xb7"`` + ``b"\\xa5"``).
        SentencePiece: ``▁`` -> space, ``<0xNN>`` byte-fallback tokens -> that one byte.
        Added / special tokens: the UTF-8 of their text. Ids past the vocabulary: ``b""``.
        """
        if self._all_bytes is not None:
            return self._all_bytes[token_id] if 0 <= token_id < len(self._all_bytes) else b""
        return self._bytes_of(token_id, self._id_to_token(token_id))

    def all_token_bytes(self) -> list[bytes]:
        """``[token_bytes(i) for i in range(vocab_size)]``, computed once and cached."""
        if self._all_bytes is None:
            pipeline = self._id_pipeline
            toks = ([pipeline.id_to_token(i) for i in range(self.vocab_size)] if pipeline is not None
                    else self.hf.convert_ids_to_tokens(list(range(self.vocab_size))))
            self._all_bytes = [self._bytes_of(i, t) for i, t in enumerate(toks)]
        return self._all_bytes

    def _id_to_token(self, token_id: int) -> str | None:
        pipeline = self._id_pipeline
        if pipeline is not None:
            return pipeline.id_to_token(token_id)
        return self.hf.convert_ids_to_tokens(token_id)

    def _bytes_of(self, token_id: int, token: str | None) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        if token is None:
            return b""
        if self._byte_level:
            table = unicode_to_bytes()
            # NOTE: a character outside the byte table cannot occur in a well-formed byte-level
            # vocabulary; keep its UTF-8 rather than fail.
            return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in token)
        m = _BYTE_FALLBACK.match(token)
        if m:
            return bytes([int(m.group(1), 16)])
        if self._metaspace:
            token = token.replace("\u2581", " ")
        return token.encode("utf-8")

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        kind = type(self._hf).__name__ if self._hf is not None else "tokenizers pipeline"
        return f"Tokenizer({kind}, vocab_size={self.vocab_size}, eos={sorted(self.eos_token_ids)})"


# ---- prompt ids of plain text (one rule for the DSL's LocalBackend and the HTTP servers) --------

def plain_text_bos_id(tokenizer: Any) -> int | None:
    """The BOS id the tokenizer's post-processor puts before plain text, or None when it puts
    none (SmolLM2) or has no BOS. Probed once by encoding ``"a"`` with special tokens."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    try:
        ids = tokenizer.encode("a", add_special_tokens=True)
    except TypeError:
        return None
    return bos if ids and ids[0] == bos else None


def encode_prompt_text(tokenizer: Any, text: str, bos: int | None) -> list[int]:
    """Prompt ids of ``text``: special-token text becomes its id, and ``bos`` (from
    :func:`plain_text_bos_id`) is put first unless the text already starts with it. Used by
    ``LocalBackend.encode``, ``/v1/completions`` and ``/generate`` alike."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids

