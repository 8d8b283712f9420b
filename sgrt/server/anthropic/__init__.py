"""Anthropic's Messages API (:mod:`~sgrt.server.anthropic.messages`): ``POST /v1/messages``,
translated onto the OpenAI chat turn (:mod:`sgrt.server.openai.chat_turns`) and answered in
Anthropic's own shapes, errors and stream events included.
"""
