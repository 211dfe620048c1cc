"""Faults and odd inputs the core must survive exactly (issue 10).

A failed journal commit must leave the namespace exactly as a restart from the
journal shows it; odd remote listings must not break a directory; the streaming
digests must never raise nor lie, whatever order writes arrive in.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from burstfs.objects import StreamingDigests, compute_digests

# -- #20: streaming digests under any write order --------------------------------------------


class SmallTailDigests(StreamingDigests):
    TAIL = 8  # small enough that short generated writes reach past it


writes_strategy = st.lists(
    st.tuples(st.integers(0, 40), st.binary(min_size=0, max_size=16)),
    min_size=1,
    max_size=20,
)


@pytest.mark.parametrize("cls", [StreamingDigests, SmallTailDigests])
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(writes=writes_strategy, chunk_size=st.integers(1, 16), max_pending=st.sampled_from([16, 64, 1 << 20]))
def test_streaming_digests_are_right_or_absent_for_any_writes(
    tmp_path: Path, cls: type[StreamingDigests], writes: list[tuple[int, bytes]], chunk_size: int, max_pending: int
) -> None:
    """Overlapping, reordered writes: result() is the file's digests or None, never an error."""
    final = bytearray()
    stream = cls(chunk_size, max_pending=max_pending)
    for offset, data in writes:
        if offset + len(data) > len(final):
            final.extend(bytes(offset + len(data) - len(final)))
        final[offset : offset + len(data)] = data
        stream.update(offset, data)  # must never raise (was KeyError: EIO on valid writes)
    path = tmp_path / f"f{os.getpid()}"
    path.write_bytes(bytes(final))
    got = stream.result(len(final))
    assert got is None or got == compute_digests(path, chunk_size)


def test_streaming_digests_overwrite_among_pending_writes_is_not_an_error() -> None:
    """The shape seen in the daemon: queued writes released together, the first an overwrite."""
    stream = StreamingDigests(16)
    stream.update(0, b"a" * 8)
    stream.update(12, b"c" * 4)  # ahead: waits
    stream.update(10, b"X" * 4)  # ahead: waits
    stream.update(8, b"b" * 6)  # releases both; the one at 10 overwrites what this wrote
    assert stream.result(16) is None
