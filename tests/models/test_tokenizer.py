"""Tests of sgrt/models/tokenizer.py on the default model's tokenizer (SmolLM2, byte-level BPE)."""
from __future__ import annotations

import pytest

from sgrt.errors import InvalidRequest
from sgrt.models.tokenizer import Tokenizer, bytes_to_unicode

TEXTS = [
    "Hello world",
    "  leading spaces,\ttabs\n\nand newlines\r\n",
    "人工智能 is AI; 日本語のテキスト",
    "emoji: 😀🎉 family 👨‍👩‍👧‍👦 flags 🇫🇷",
    "accents: café naïve Ærø ß",
    'code: def f(x): return {"a": [1, 2.5e-3]}',
    "digits 12345 and 2024-11-30",
]


def test_bytes_to_unicode_table():
    table = bytes_to_unicode()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert table[0x20] == "Ġ" and table[0x0A] == "Ċ" and table[ord("a")] == "a"


def test_space_token_is_a_space_byte(tokenizer: Tokenizer):
    vocab = tokenizer.hf.get_vocab()
    assert tokenizer.token_bytes(vocab["Ġ"]) == b" "
    assert tokenizer.token_bytes(vocab["Ġthe"]) == b" the"
    assert tokenizer.token_bytes(vocab["Ċ"]) == b"\n"


def test_partial_utf8_token_stays_raw_bytes(tokenizer: Tokenizer):
    # SmolLM2 splits 工 (e5 b7 a5) into 'å·' + '¥': the first token is an incomplete character.
    ids = tokenizer.encode("人工智能")
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == "人工智能".encode()
    partial = [p for p in pieces if not _is_utf8(p)]
    assert partial, "expected at least one token holding part of a character"
    vocab = tokenizer.hf.get_vocab()
    assert tokenizer.token_bytes(vocab["å·"]) == b"\xe5\xb7"


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_text(tokenizer: Tokenizer, text: str):
    ids = tokenizer.encode(text)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert tokenizer.decode(ids) == text


def test_all_token_bytes_cached_and_consistent(tokenizer: Tokenizer):
    table = tokenizer.all_token_bytes()
    assert table is tokenizer.all_token_bytes()
    assert len(table) == tokenizer.vocab_size == 49152
    for i in (0, 1, 2, 100, 216, 905, 19556, 49151):
        assert table[i] == tokenizer.token_bytes(i)
    assert all(table[i] for i in range(len(table)))  # no empty token in this vocabulary


def test_special_tokens(tokenizer: Tokenizer):
    im_start, im_end = tokenizer.encode("<|im_start|><|im_end|>")
    assert (im_start, im_end) == (1, 2)
    assert {0, 1, 2} <= tokenizer.special_token_ids
    assert tokenizer.token_bytes(im_start) == b"<|im_start|>"
    assert tokenizer.eos_token_ids == {0, 2}  # <|endoftext|> and <|im_end|>
    assert tokenizer.bos_token_id == 1
    assert tokenizer.decode([im_start, 19556], skip_special_tokens=True) == "Hello"
    assert tokenizer.decode([im_start, 19556], skip_special_tokens=False) == "<|im_start|>Hello"


def test_no_bos_is_added(tokenizer: Tokenizer):
    # Like the original HF SmolLM2 tokenizer: the chat template writes <|im_start|> itself.
    assert tokenizer.encode("Hello world") == [19556, 905]
    assert tokenizer.encode("Hello world", add_special_tokens=True) == [19556, 905]


def test_digits_split_one_by_one(tokenizer: Tokenizer):
    # The original tokenizer.json pre-splits digits (llama.cpp's "smollm" pre-tokenizer).
    ids = tokenizer.encode("x 12345")
    assert tokenizer.hf.convert_ids_to_tokens(ids) == ["x", "Ġ", "1", "2", "3", "4", "5"]


def test_chat_template_renders_chatml(tokenizer: Tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n")  # SmolLM2 adds a default system prompt
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n")
    ids = tokenizer.encode(text)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 3


def test_no_chat_template_is_an_invalid_request(tokenizer: Tokenizer):
    bare = Tokenizer(tokenizer.hf)
    bare.hf = type("NoTemplate", (), {"chat_template": None})()
    with pytest.raises(InvalidRequest, match="chat template"):
        bare.apply_chat_template([{"role": "user", "content": "Hi"}])


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
