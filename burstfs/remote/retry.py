"""Retry with full-jitter exponential backoff around one remote call.

The remotes never retry on their own (botocore's retries are switched off), so
this is the one place that decides how long a flaky remote is waited for, and
the one place that logs it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import THROTTLED, RemoteError

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
    attempt_timeout: float | None = None,
    budget: float | None = None,
    on_retry: Callable[[str, float, bool], None] | None = None,
    **kw: Any,
) -> T:
    """``await fn(*args, **kw)``, retrying temporary failures of ``remote``.

    Permanent errors propagate at once.  After ``attempts`` temporary failures a
    ``RemoteError(kind='unavailable')`` chained to the last one is raised.  The
    delay before retry n is uniform in [0, min(max_delay, base_delay * 2**(n-1))]
    ("full jitter"), which spreads out many clients hitting one throttled prefix.
    ``attempt_timeout``: an attempt taking longer is cancelled and counts as a
    temporary failure (for small requests: a connection that went silent is not
    waited for the whole read timeout).  ``budget``: no retry starts after this
    many seconds in all (a black-holed remote costs a read timeout per attempt).
    ``on_retry(reason, first_attempt, throttled)``: called before each retry, with the epoch
    time the first attempt started (status reports trouble before the retries are spent) and
    whether the store asked for fewer requests (it answers: not unreachable).
    """
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, not {attempts}")
    loop = asyncio.get_running_loop()
    started = loop.time()
    attempt = 0
    while True:
        attempt += 1
        try:
            if attempt_timeout is None:
                return await fn(*args, **kw)
            return await asyncio.wait_for(fn(*args, **kw), attempt_timeout)
        except Exception as exc:
            timed_out = attempt_timeout is not None and isinstance(exc, TimeoutError)
            if not timed_out and not remote.is_temp_failure(exc):
                raise
            delay = backoff(attempt, base_delay, max_delay)
            spent = budget is not None and loop.time() - started + delay >= budget
            if attempt >= attempts or spent:
                tries = f"{attempt} attempts in {loop.time() - started:.0f}s"
                if remote.is_throttling(exc):  # it answers: asks for fewer requests, not unreachable
                    raise RemoteError(
                        f"{what}: remote {remote.url} throttled the requests for {tries}: {describe_error(exc)}",
                        kind=THROTTLED,
                    ) from exc
                raise RemoteError(
                    f"{what}: remote {remote.url} unavailable after {tries}: {describe_error(exc)}",
                    kind="unavailable",
                ) from exc
            log.warning(
                "event=remote_retry what=%r attempt=%d delay=%.2f error=%r", what, attempt, delay, describe_error(exc)
            )
            if on_retry is not None:
                on_retry(
                    f"{what}: {describe_error(exc)}", time.time() - (loop.time() - started), remote.is_throttling(exc)
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
    attempt_timeout: float | None = None  # see retrying()
    budget: float | None = None  # see retrying()

    def backoff(self, attempt: int) -> float:
        """The delay before retry ``attempt`` (1-based) of a caller that retries on its own."""
        return backoff(attempt, self.base_delay, self.max_delay)

    async def call(
        self,
        remote: Remote,
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        what: str,
        on_retry: Callable[[str, float, bool], None] | None = None,
        **kw: Any,
    ) -> T:
        """:func:`retrying` with this policy."""
        return await retrying(
            remote,
            fn,
            *args,
            what=what,
            attempts=self.attempts,
            base_delay=self.base_delay,
            max_delay=self.max_delay,
            attempt_timeout=self.attempt_timeout,
            budget=self.budget,
            on_retry=on_retry,
            **kw,
        )
