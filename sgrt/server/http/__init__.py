"""The HTTP transport every HTTP API shares: the Starlette app and its uvicorn server
(:mod:`~sgrt.server.http.server`), the state behind the routes (:mod:`~sgrt.server.http.core`:
the engine, auth, request bodies, in-flight accounting), errors as response bodies
(:mod:`~sgrt.server.http.errors`), server-sent events (:mod:`~sgrt.server.http.streams`) and
``GET /metrics`` (:mod:`~sgrt.server.http.metrics`). The APIs themselves are beside it:
:mod:`sgrt.server.openai`, :mod:`sgrt.server.anthropic`, :mod:`sgrt.server.sglang`.
"""
