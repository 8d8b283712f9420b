"""OpenAI's HTTP APIs, one module each: chat completions (:mod:`~sgrt.server.openai.chat`), text
completions (:mod:`~sgrt.server.openai.completions`) and Responses
(:mod:`~sgrt.server.openai.responses`), with their wire structs (:mod:`~sgrt.server.openai.protocol`),
the translator to ``SamplingParams`` (:mod:`~sgrt.server.openai.sampling`), tokens and results
(:mod:`~sgrt.server.openai.adapter`), and the one chat turn over the engine that chat, Responses
and Anthropic's Messages share (:mod:`~sgrt.server.openai.chat_turns`).
"""
