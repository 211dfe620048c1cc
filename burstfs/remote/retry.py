"""Retry with full-jitter exponential backoff around one remote call.

The remotes never retry on their own (botocore's retries are switched off), so
this is the one place that decides how long a flaky remote is waited for, and
the one place that logs it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import RemoteError

if TYPE_CHECKING:
    from .base import Remote

log = logging.getLogger("burstfs.remote")

T = TypeVar("T")


def describe_error(exc: BaseException) -> str:
    """A one-line description of ``exc`` for a log field (type and message, bounded)."""
    text = " ".join(str(exc).split())
    name = type(exc).__name__
    return f"{name}: {text[:300]}" if text else name


async def retrying(
    remote: Remote,
    fn: Callable[..., Awaitable[T]],
    *args: Any,
    what: str,
    attempts: int = 8,
    base_delay: float = 0.1,
    max_delay: float = 10.0,
    **kw: Any,
) -> T:
    """``await fn(*args, **kw)``, retrying temporary failures of ``remote``.

    Permanent errors propagate at once.  After ``attempts`` temporary failures a
    ``RemoteError(kind='unavailable')`` chained to the last one is raised.  The
    delay before retry n is uniform in [0, min(max_delay, base_delay * 2**(n-1))]
    ("full jitter"), which spreads out many clients hitting one throttled prefix.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, not {attempts}")
    attempt = 0
    while True:
        attempt += 1
        try:
            return await fn(*args, **kw)
        except Exception as exc:
            if not remote.is_temp_failure(exc):
                raise
            if attempt >= attempts:
                raise RemoteError(
                    f"{what}: remote {remote.url} unavailable after {attempts} attempts: {describe_error(exc)}",
                    kind="unavailable",
                ) from exc
            delay = backoff(attempt, base_delay, max_delay)
            log.warning(
                "remote retry what=%r attempt=%d delay=%.2f error=%r", what, attempt, delay, describe_error(exc)
            )
            await asyncio.sleep(delay)


def backoff(attempt: int, base_delay: float, max_delay: float) -> float:
    """The full-jitter delay before retry ``attempt`` (1-based)."""
    return random.uniform(0.0, min(max_delay, base_delay * 2 ** (attempt - 1)))


@dataclass(frozen=True)
class RetryPolicy:
    """How persistently a component retries (the defaults back off for up to ~13 s in all).

    Components that make remote calls on their own (ObjectStore, the pages of
    S3Remote.list_all) take one of these so tests and tools can shorten it.
    """

    attempts: int = 8
    base_delay: float = 0.1
    max_delay: float = 10.0

    def backoff(self, attempt: int) -> float:
        """The delay before retry ``attempt`` (1-based) of a caller that retries on its own."""
        return backoff(attempt, self.base_delay, self.max_delay)

    async def call(self, remote: Remote, fn: Callable[..., Awaitable[T]], *args: Any, what: str, **kw: Any) -> T:
        """:func:`retrying` with this policy."""
        return await retrying(
            remote,
            fn,
            *args,
            what=what,
            attempts=self.attempts,
            base_delay=self.base_delay,
            max_delay=self.max_delay,
            **kw,
        )
