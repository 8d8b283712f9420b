"""``sgrt.Runtime``: an engine this process loads and owns, as a DSL backend, with an HTTP server
over the same engine on demand (``runtime.url``).

It sits above both :mod:`sgrt.backends` and :mod:`sgrt.server` (it starts a server), so neither
of those imports the other for it.
"""
from __future__ import annotations

from typing import Any

from sgrt.backends.local import LocalBackend
from sgrt.errors import InvalidRequest


class Runtime(LocalBackend):
    """An engine this process loads and owns, as a DSL backend.

    ``sgrt.set_default_backend(sgrt.Runtime(model="smollm2-135m-instruct", dtype="float32"))``.
    ``**engine_options`` are :class:`sgrt.engine.EngineConfig` fields (``enable_radix_cache``,
    ``max_total_tokens``, ...). Use as a context manager or call :meth:`shutdown`.

    SGLang's ``Runtime(model_path=...)`` is accepted (``model_path`` is ``model``), and so are its
    ``log_level`` / ``launch_timeout``, which have no effect: SGLang's ``Runtime`` launches a
    server subprocess, sgrt's runs the engine in this process. ``runtime.endpoint`` is the
    runtime itself; ``runtime.url`` starts an HTTP server over the same engine on first use.

    Raises:
        ModelLoadError: the model could not be loaded.
        TypeError: an unknown engine option.
    """

    def __init__(self, model: Any = None, dtype: str = "float32",
                 device: str = "cpu", chat_template: Any = None, *, model_path: Any = None,
                 log_level: str | None = None, launch_timeout: float | None = None,
                 **engine_options: Any):
        from sgrt.engine import Engine

        if model is not None and model_path is not None and model != model_path:
            raise InvalidRequest("Runtime got both model and model_path (SGLang's name for it); "
                                 "pass one", field="model_path")
        model = model if model is not None else model_path
        # NOTE: log_level / launch_timeout are SGLang's Runtime arguments for its server
        # subprocess; sgrt's engine runs in this process, so there is nothing to launch or log.
        self._http: Any = None
        super().__init__(Engine(model=model if model is not None else "smollm2-135m-instruct",
                                dtype=dtype, device=device, **engine_options),
                         chat_template=chat_template)

    @property
    def url(self) -> str:
        """The URL of an HTTP server over this runtime's engine (SGLang's ``Runtime.url``),
        started on a free loopback port the first time it is read and stopped by
        :meth:`shutdown`: ``/generate``, ``/v1/completions``, ``/v1/chat/completions``..."""
        if self._http is None:
            from sgrt.server.http.server import HttpServerThread  # loads starlette: on first use only

            self._http = HttpServerThread(self.engine, "127.0.0.1", 0).start()
        return self._http.url

    @property
    def generate_url(self) -> str:
        """``url + "/generate"`` (SGLang's ``Runtime.generate_url``)."""
        return self.url + "/generate"

    def shutdown(self) -> None:
        if self._http is not None:
            self._http.stop()
            self._http = None
        self.engine.shutdown()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
