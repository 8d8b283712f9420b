"""SGLang's ``sglang.srt`` helper paths that frontend programs import, mirrored under ``sgrt.srt``.

Only the helpers programs use are here: ``build_regex_from_object``
(``sgrt.srt.constrained``, ``.outlines_backend``, ``.json_schema``) and ``get_tokenizer``
(``sgrt.srt.hf_transformers_utils``, ``sgrt.srt.utils.hf_transformers_utils``). sgrt's engine
itself lives in :mod:`sgrt.engine`.
"""
