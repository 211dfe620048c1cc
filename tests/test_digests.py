"""StreamingDigests against the write patterns the kernel's write-back produces.

test_core_faults.py checks soundness (any writes: the right digests or none).
These check the other half: the patterns StreamingDigests promises to tolerate
(writes delivered slightly out of order, a partial page rewritten from its
start) always give the file's digests, so such a close never needs a re-read,
and a rewrite that changes hashed bytes is always caught.
"""

from __future__ import annotations

import itertools

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from burstfs.digests import FileDigests, StreamingDigests


class SmallPageDigests(StreamingDigests):
    TAIL = 8  # a small "page", so short generated files cross many page boundaries


def digests_of(data: bytes, chunk_size: int) -> FileDigests:
    """The oracle: the digests of ``data`` computed in one pass, independently of the class."""
    chunks = tuple(xxhash.xxh3_64_hexdigest(data[i : i + chunk_size]) for i in range(0, len(data), chunk_size))
    return FileDigests(len(data), chunk_size, chunks, xxhash.xxh3_128_hexdigest(data))


@st.composite
def writeback(draw: st.DrawFn, page: int) -> tuple[bytes, int, list[tuple[int, bytes]], int]:
    """A file, a chunk size, and its bytes as write-back may deliver them, plus the pending bound they need.

    The file is cut into pieces; some pieces are rewritten from the start of the page
    their first byte lies in (the same bytes again); some disjoint pairs of neighbours
    arrive swapped.
    """
    content = draw(st.binary(min_size=1, max_size=300))
    chunk_size = draw(st.integers(1, 64))
    cuts = sorted(draw(st.sets(st.integers(1, len(content) - 1), max_size=20))) if len(content) > 1 else []
    bounds = [0, *cuts, len(content)]
    writes = []
    rewrites = set()
    for start, end in itertools.pairwise(bounds):
        if start % page and draw(st.booleans()):
            start -= start % page  # write-back resends the partial page from its start
            rewrites.add(len(writes))
        writes.append((start, content[start:end]))
    order = list(range(len(writes)))
    index = 0
    while index + 1 < len(order):
        # A page resent from its start follows the write it completes; other neighbours may swap.
        if index + 1 not in rewrites and draw(st.booleans()):
            order[index], order[index + 1] = order[index + 1], order[index]
            index += 2
        else:
            index += 1
    # A swapped write waits with at most its neighbour's rewritten copy.
    max_pending = 2 * max(len(data) for _, data in writes)
    return content, chunk_size, [writes[i] for i in order], max_pending


@pytest.mark.parametrize("cls", [StreamingDigests, SmallPageDigests])
@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_reordered_and_rewritten_writes_give_the_files_digests(
    cls: type[StreamingDigests], data: st.DataObject
) -> None:
    content, chunk_size, writes, max_pending = data.draw(writeback(cls.TAIL))
    stream = cls(chunk_size, max_pending=max_pending)
    for offset, piece in writes:
        stream.update(offset, piece)
    assert stream.result(len(content)) == digests_of(content, chunk_size)


@pytest.mark.parametrize("cls", [StreamingDigests, SmallPageDigests])
@settings(max_examples=300, deadline=None)
@given(
    content=st.binary(min_size=2, max_size=300),
    chunk_size=st.integers(1, 64),
    split=st.integers(1, 299),
    flip=st.integers(0, 299),
)
def test_a_rewrite_that_changes_hashed_bytes_leaves_no_digests(
    cls: type[StreamingDigests], content: bytes, chunk_size: int, split: int, flip: int
) -> None:
    """Bytes resent from the page start but different from what was hashed: an overwrite, never digests."""
    split = 1 + split % (len(content) - 1)
    start = split - split % cls.TAIL
    if start == split:
        start = max(0, split - 1)  # reach back at least one byte into what was hashed
    flip = start + flip % (split - start)
    stream = cls(chunk_size, max_pending=1 << 20)
    stream.update(0, content[:split])
    changed = bytearray(content[start:])
    changed[flip - start] ^= 0xFF
    stream.update(start, bytes(changed))
    assert stream.result(len(content)) is None


@settings(max_examples=200, deadline=None)
@given(content=st.binary(min_size=2, max_size=300), chunk_size=st.integers(1, 64), hole=st.integers(1, 299))
def test_a_write_past_a_hole_that_is_never_filled_leaves_no_digests(content: bytes, chunk_size: int, hole: int) -> None:
    """A write ahead of the hashed prefix waits; if the gap is never written, the close gets no digests."""
    hole = 1 + hole % (len(content) - 1)
    stream = StreamingDigests(chunk_size)
    stream.update(hole, content[hole:])
    assert stream.result(len(content)) is None
    stream.update(0, content[:hole])  # the gap arrives late: the waiting write is consumed
    assert stream.result(len(content)) == digests_of(content, chunk_size)
