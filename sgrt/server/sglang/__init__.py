"""SGLang's native HTTP endpoints, served beside the OpenAI API: ``/generate`` (batches, prompt
log-probabilities, prefill-only), ``/tokenize``, ``/detokenize``, ``/apply_chat_template``,
``/flush_cache``, ``/abort_request``, ``/model_info``, ``/server_info``
(:mod:`~sgrt.server.sglang.endpoints`), their wire structs (:mod:`~sgrt.server.sglang.protocol`),
and SGLang's request fields, honoured, ignored or refused by name
(:mod:`~sgrt.server.sglang.fields`, also read by ``/v1/completions``).
"""
