"""``sglang.srt.utils.hf_transformers_utils``'s :func:`get_tokenizer` (newer SGLang path)."""
from sgrt.srt.hf_transformers_utils import get_tokenizer

__all__ = ["get_tokenizer"]
