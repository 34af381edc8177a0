"""The proxy's backends (`vlserve proxy`): health-checked round-robin over one list of server URLs.

Each call goes to the next backend in turn, skipping those whose last call failed less than `backoff_s` ago (when
every one is backing off they are all tried anyway, oldest failure first: a lone backend after a blip is not
refused). A call fails over to the next backend when it could not reach one (connection refused or reset, the
server gone mid-answer) or the backend answered 502 / 503 / 504, before any of its answer went to the client; a
backend that is slow past the timeout is not retried elsewhere (the work may be running there) but is a 504.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger(__name__)

_RETRY_STATUSES = (502, 503, 504)


class NoBackendError(Exception):
    """No backend of a pool could take the call; `status` is the HTTP status for the client (503, or 504)."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(message)
        self.status = status


@dataclass
class BackendPool:
    """Round-robin over `urls` (base URLs) that skips a backend for `backoff_s` after a failed call."""

    role: str  # "prefill" / "decode": named in errors
    urls: list[str]
    backoff_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    failed_at: dict[str, float] = field(default_factory=dict)  # url -> when its last call failed

    def __post_init__(self):
        self._turn = itertools.cycle(range(len(self.urls)))

    def candidates(self) -> list[str]:
        """The backends to try for one call, in order: the healthy ones from the next in turn, then (only when no
        backend is healthy) the backing-off ones, oldest failure first."""
        start = next(self._turn)
        ordered = self.urls[start:] + self.urls[:start]
        now = self.clock()
        healthy = [u for u in ordered if now - self.failed_at.get(u, -float("inf")) >= self.backoff_s]
        return healthy or sorted(ordered, key=lambda u: self.failed_at[u])

    def mark_failed(self, url: str) -> None:
        """`url`'s call failed: skip it for `backoff_s`."""
        self.failed_at[url] = self.clock()

    def mark_ok(self, url: str) -> None:
        """`url` answered: it is healthy again."""
        self.failed_at.pop(url, None)

    def down(self) -> list[str]:
        """The backends backing off now."""
        now = self.clock()
        return [u for u in self.urls if now - self.failed_at.get(u, -float("inf")) < self.backoff_s]

    async def send(
        self, client: httpx.AsyncClient, method: str, path: str, stream: bool = False, **kwargs
    ) -> tuple[str, httpx.Response]:
        """Send the call to the first backend that takes it: (its url, its response, opened but unread when
        `stream`). NoBackendError (503) when none could, naming each backend's failure; (504) on a timeout."""
        errors = []
        for url in self.candidates():
            try:
                resp = await client.send(client.build_request(method, url + path, **kwargs), stream=stream)
            except httpx.TimeoutException as e:
                self.mark_failed(url)
                if not isinstance(e, httpx.ConnectTimeout):
                    raise NoBackendError(f"{self.role} server {url} timed out: {type(e).__name__}", 504) from None
                errors.append(f"{url}: {type(e).__name__}")
                continue
            except httpx.TransportError as e:  # refused, reset, gone mid-answer: the next one
                self.mark_failed(url)
                errors.append(f"{url}: {type(e).__name__}: {e}")
                continue
            if resp.status_code in _RETRY_STATUSES:
                await resp.aread()
                await resp.aclose()
                self.mark_failed(url)
                errors.append(f"{url}: HTTP {resp.status_code}")
                continue
            self.mark_ok(url)
            return url, resp
        logger.warning("no %s server took the call: %s", self.role, "; ".join(errors))
        raise NoBackendError(f"no {self.role} server available ({'; '.join(errors)})")
