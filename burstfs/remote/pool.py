"""Structured concurrency that fails fast and reports the failure itself.

asyncio.TaskGroup wraps child failures in an ExceptionGroup; callers here (and
:func:`~burstfs.remote.retry.retrying`) need the original exception to tell a
throttled remote from a missing bucket, so these helpers unwrap it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any


@contextlib.asynccontextmanager
async def fail_fast_group() -> AsyncIterator[asyncio.TaskGroup]:
    """A TaskGroup whose first failure cancels the rest and is raised as itself."""
    try:
        async with asyncio.TaskGroup() as group:
            yield group
    except BaseExceptionGroup as group_error:
        raise group_error.exceptions[0] from None


async def run_workers(worker: Callable[[], Coroutine[Any, Any, None]], count: int) -> None:
    """Run ``count`` copies of ``worker`` (typically draining a shared iterator) until all return.

    A fixed number of workers bounds the requests in flight and the memory they hold.
    """
    async with fail_fast_group() as group:
        for _ in range(count):
            group.create_task(worker())
