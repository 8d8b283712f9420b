"""``sglang.srt.hf_transformers_utils``'s helper for programs: :func:`get_tokenizer`."""
from __future__ import annotations

from typing import Any


def get_tokenizer(tokenizer_name: str, *args: Any, **kwargs: Any) -> Any:
    """The transformers tokenizer of ``tokenizer_name`` (a model name sgrt knows, a ``.gguf``
    file, a model folder, or a folder of tokenizer files alone, e.g.
    ``sgrt.get_server_info()["tokenizer_path"]``), as SGLang's ``get_tokenizer`` returns it. Read
    locally; nothing is downloaded. SGLang's other arguments (``tokenizer_mode``,
    ``trust_remote_code``, ``tokenizer_revision``) are accepted and unused: sgrt always loads the
    fast tokenizer from local files.

    Raises:
        ModelLoadError: no such model / folder.
    """
    from pathlib import Path

    from sgrt.models import load_tokenizer

    folder = Path(str(tokenizer_name)).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return load_tokenizer(str(tokenizer_name)).hf


__all__ = ["get_tokenizer"]
