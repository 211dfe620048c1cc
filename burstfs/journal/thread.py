"""The journal thread: an event loop's journal calls run here, in order, never on the loop.

SQLite calls block (a commit waits for the WAL write, a busy writer for
``busy_timeout``); on the mover's asyncio loop they would stall every upload,
fetch and listing in flight.  One thread per loop keeps the calls in the order
the loop issued them, and since the connection is used only from this thread
while the loop runs, a call never waits for another of the same loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class JournalCall(Protocol):
    """What runs a journal call off the loop: :meth:`JournalThread.call` (or a method that uses it)."""

    async def __call__(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T: ...


class JournalThread:
    """One worker thread that runs blocking journal calls for an asyncio loop."""

    def __init__(self, name: str = "burstfs-journal") -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on the journal thread; the awaiting task waits, the loop does not.

        A call whose task is cancelled while it waits for the thread is dropped
        from the queue (on the loop's next turn); one already running completes
        (each journal method is one transaction) and its result is dropped.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Wait for the call in progress (if any) and end the thread."""
        self._executor.shutdown(wait=True, cancel_futures=True)
