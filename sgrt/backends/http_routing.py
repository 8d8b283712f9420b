"""Prefix-affinity routing of one program's requests across several servers of one model.

A prompt that extends one sent before (a program's next ``gen`` after a ``select``, a fork's
branches, a chat's next turn) goes to the server that had that earlier prompt, whose radix cache
holds it; a prompt that extends none goes to the server with the fewest requests in flight.
Ties go to the server of a prefix cached ahead of use (a hint), then by a hash of the prompt's
first :attr:`ServerRouter.AFFINITY_CHARS` characters, so that independent sessions and
``run_batch`` items spread out even when they share a system prompt. The same idea as
sglang-router's cache-aware policy, kept client-side in the program's process.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import threading
from collections.abc import Iterator

from sgrt.backends.http_client import HttpClient


class ServerRouter:
    """Owns the choice of server for each prompt: the remembered prompts, the per-server count
    of requests in flight, and each thread's current server. Thread-safe.

    Args:
        clients: one :class:`HttpClient` per server (at least one); the first is the default.
    """

    #: Leading characters hashed to break ties between equally loaded servers.
    AFFINITY_CHARS = 64
    #: How many routed prompts are remembered for prefix affinity.
    AFFINITY_ENTRIES = 4096

    def __init__(self, clients: list[HttpClient]):
        self.clients = clients
        self._routed = threading.local()
        self._affinity: collections.OrderedDict[str, tuple[HttpClient, bool]] = collections.OrderedDict()
        self._in_flight = {id(c): 0 for c in clients}
        self._lock = threading.Lock()

    def active(self) -> HttpClient | None:
        """The server of this thread's current :meth:`route` block; None outside one."""
        return getattr(self._routed, "client", None)

    def current(self) -> HttpClient:
        """The server this thread's current :meth:`route` block goes to (the first one outside)."""
        return self.active() or self.clients[0]

    def client_for(self, prompt: str, remember: bool = True, hint: bool = False) -> HttpClient:
        """The server for ``prompt``. ``remember`` records the choice so that prompts extending
        this one follow it; a ``hint`` (a prefix cached ahead of use, e.g. ``run_batch``'s shared
        prefix) is followed only while its server is no busier than the others, so the items of
        a batch still spread out."""
        if len(self.clients) == 1:
            return self.clients[0]
        with self._lock:
            hard = soft = None
            for earlier, (client, is_hint) in self._affinity.items():
                if prompt.startswith(earlier):
                    if not is_hint and (hard is None or len(earlier) > len(hard[0])):
                        hard = (earlier, client)
                    if is_hint and (soft is None or len(earlier) > len(soft[0])):
                        soft = (earlier, client)
            if hard is not None:
                chosen = hard[1]
                self._affinity.move_to_end(hard[0])
            else:
                key = prompt[:self.AFFINITY_CHARS].encode("utf-8", "surrogatepass")
                chosen = min(self.clients, key=lambda c: (
                    self._in_flight[id(c)], soft is None or c is not soft[1],
                    hashlib.blake2b(c.base_url.encode() + b"\0" + key, digest_size=8).digest()))
            if remember and prompt:
                self._affinity[prompt] = (chosen, hint)
                self._affinity.move_to_end(prompt)
                while len(self._affinity) > self.AFFINITY_ENTRIES:
                    self._affinity.popitem(last=False)
            return chosen

    @contextlib.contextmanager
    def route(self, prompt: str) -> Iterator[HttpClient]:
        """Send this thread's requests to ``prompt``'s server until the block ends (nested blocks
        keep the outer choice, so a select's tokenize, prefill and scoring share one server);
        the server counts as busy meanwhile."""
        outer = getattr(self._routed, "client", None)
        client = outer or self.client_for(prompt)
        self._routed.client = client
        with self._lock:
            self._in_flight[id(client)] += 1
        try:
            yield client
        finally:
            self._routed.client = outer
            with self._lock:
                self._in_flight[id(client)] -= 1
