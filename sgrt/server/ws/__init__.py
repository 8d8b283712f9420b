"""WebSocket agent sessions: the server and its connections (:mod:`~sgrt.server.ws.server`), the
wire protocol (:mod:`~sgrt.server.ws.protocol`), the base every session shares
(:mod:`~sgrt.server.ws.session`), chat sessions with tools (:mod:`~sgrt.server.ws.chat_session`,
whose turns are :mod:`sgrt.server.turns`'), and runs of registered programs
(:mod:`~sgrt.server.ws.program_session` over :mod:`~sgrt.server.ws.programs`).
"""
