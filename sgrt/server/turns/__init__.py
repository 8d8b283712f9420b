"""One assistant turn, for every transport: the WebSocket chat sessions, chat completions,
Responses and Anthropic Messages all plan, render, constrain and read back a turn here.

- :mod:`~sgrt.server.turns.tools`: checking tool specs and ``tool_choice``, describing tools
  to a template that does not render them, compile-checking a tool's schema.
- :mod:`~sgrt.server.turns.formats`: the model families' tool-call and reasoning formats
  (Hermes / Qwen, Llama 3, Mistral, generic) detected from the chat template, the Lark grammar
  of one turn (free text and/or calls, parallel calls, a ``<think>`` block, a response format),
  and parsing the output back, whole or streamed (:class:`~sgrt.server.turns.formats.TurnStreamer`).
- :mod:`~sgrt.server.turns.plan`: the turn's plan (:class:`~sgrt.server.turns.plan.ToolPlan`,
  from an OpenAI request or a WebSocket ``tool_choice``), rendering the conversation with the
  chat template (:class:`~sgrt.server.turns.plan.ChatRenderer`) and reading a finished turn.
- :mod:`~sgrt.server.turns.schema_embed`: user schemas embedded in a call's schema.
"""
