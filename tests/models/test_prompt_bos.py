"""One BOS rule for plain-text prompts (sgrt.models.tokenizer), shared by LocalBackend.encode and
the HTTP servers' /v1/completions and /generate."""
from __future__ import annotations

from sgrt.models.tokenizer import encode_prompt_text, plain_text_bos_id


class _Tok:
    """A tokenizer whose post-processor puts ``bos`` first when ``adds_bos``: one id per char."""

    def __init__(self, bos: int | None, adds_bos: bool):
        self.bos_token_id = bos
        self.adds_bos = adds_bos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [1000 + ord(c) for c in text] if text != "<s>" else [7]
        return ([self.bos_token_id] if add_special_tokens and self.adds_bos else []) + ids


def test_bos_only_where_the_tokenizer_adds_one():
    assert plain_text_bos_id(_Tok(7, adds_bos=True)) == 7
    assert plain_text_bos_id(_Tok(7, adds_bos=False)) is None  # SmolLM2: a BOS token, never added
    assert plain_text_bos_id(_Tok(None, adds_bos=True)) is None


def test_bos_put_first_once():
    tok = _Tok(7, adds_bos=True)
    assert encode_prompt_text(tok, "ab", 7) == [7, 1097, 1098]
    assert encode_prompt_text(tok, "<s>", 7) == [7]  # already starts with it: not doubled
    assert encode_prompt_text(tok, "", 7) == [7]
    assert encode_prompt_text(tok, "ab", None) == [1097, 1098]


def test_backend_and_server_share_the_rule():
    from sgrt.server.openai import adapter as oa

    assert oa.encode_text is encode_prompt_text and oa.bos_id is plain_text_bos_id
