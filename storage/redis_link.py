"""One connection to the cluster's Redis, which may be down at any moment.

Every Redis call of the store goes through ``RedisLink.run``: an unreachable or
failing Redis returns None instead of raising, and for ``retry_s`` afterwards calls
fail fast instead of each waiting for a connect timeout, so a request never waits on
a dead Redis for longer than one timeout. The URL is handed to redis-py as is:
``redis://:PASSWORD@host:port/db`` or ``rediss://`` for TLS. (:func:`url_has_password`
and :func:`url_with_password` are how ``v41 serve`` keeps an external Redis's password
off its own command line, where any local user could read it.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import parse_qs, parse_qsl, quote, unquote, urlencode, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

T = TypeVar("T")


class RedisLink:
    """A redis-py client with a circuit breaker and key naming under one namespace."""

    def __init__(self, url: str, *, namespace: str, timeout_s: float, retry_s: float) -> None:
        # One immediate retry: after a Redis restart the first use of a pooled
        # connection fails on the dead socket, and a fresh connection then succeeds.
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 1))
        self.namespace = namespace
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._down_until = 0.0  # time.monotonic(); the breaker uses real time, not the store's clock
        self._errors = 0

    def run(self, call: Callable[[redis.Redis], T]) -> T | None:
        """``call(client)``, or None when Redis is unreachable or answers with an error."""
        if time.monotonic() < self._down_until:
            return None
        try:
            return call(self.client)
        except (redis.RedisError, OSError):
            with self._lock:
                self._errors += 1
                self._down_until = time.monotonic() + self._retry_s
            return None

    @property
    def up(self) -> bool:
        """False while the breaker is open after a failure."""
        return time.monotonic() >= self._down_until

    @property
    def errors(self) -> int:
        """Failed calls so far."""
        return self._errors

    def key(self, *parts: str) -> str:
        return ":".join((self.namespace, *parts))

    def close(self) -> None:
        self.client.close()


def url_has_password(url: str) -> bool:
    """Whether a Redis URL carries a password (``:PW@`` or redis-py's ``?password=``);
    ValueError for what is no URL."""
    parts = urlsplit(url)
    return parts.password is not None or "password" in parse_qs(parts.query)


def url_with_password(url: str, password: str) -> str:
    """``url`` with ``password`` (percent-encoded, as redis-py decodes it) in place of
    any it had: in the user part (its user name kept), or for a ``unix://`` socket
    path, which has none, in the query. ValueError for what is no URL."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        query = [(name, value) for name, value in parse_qsl(parts.query) if name != "password"]
        return f"{url.partition('?')[0]}?{urlencode([*query, ('password', password)])}"  # (geturl drops "//")
    user = quote(unquote(parts.username or ""), safe="")
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}").geturl()
