"""Async checkpointing for torch: training blocks only while the state is copied to host memory.

:func:`async_save` snapshots a state dict into a reusable host buffer (page-locked when
CUDA is available, so device-to-host copies run at full speed on a side stream), returns
as soon as the snapshot is complete, and writes it with ``torch.save`` in a background
thread, to a temporary name that is renamed over the target at the end.

torch is imported inside the functions: ``burstfs`` itself must run without torch.
See docs/PINNED.md for the guarantees and the limits.
"""

from __future__ import annotations

import copy
import errno
import logging
import os
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["PinnedPool", "SaveHandle", "async_save"]

logger = logging.getLogger("burstfs.pinned")

# Every storage starts on a 64-byte boundary of the buffer: more than any dtype needs
# (complex128: 16) and a cache line, so host copies are as fast as fresh tensors.
_ALIGN = 64
# The pool's buffer grows in 2 MiB steps, so a save whose state gained a few small tensors
# (a new step counter, a scheduler state) does not pay for a new pinned allocation.
_GROW_STEP = 2 << 20
# cudaHostRegisterPortable: the pages count as pinned for every CUDA context, not only
# the current device's (same flag as torch.cuda._pin_memory_utils).
_CUDA_HOST_REGISTER_PORTABLE = 1


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class SaveHandle:
    """The background write of one :func:`async_save`.

    ``path``: the checkpoint file; ``nbytes``: bytes snapshotted (every distinct tensor
    storage once); ``blocking_s``: how long ``async_save`` blocked the caller;
    ``total_s``: from the call until the file was in place (None while writing).
    """

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        self.nbytes = nbytes
        self.blocking_s = 0.0
        self.total_s: float | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the write finished, successfully or not."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until ``path`` holds the complete checkpoint; re-raise the write's error.

        Raises TimeoutError if the write is still running after ``timeout`` seconds
        (it keeps running; wait again).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint {self.path} still being written after {timeout} s")
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        state = "writing" if not self.done() else ("failed" if self._error else "done")
        return f"<SaveHandle {self.path} {self.nbytes} bytes {state}>"


class PinnedPool:
    """A reusable host buffer for snapshots, and the order of the saves that use it.

    Allocating, faulting in and pinning a large buffer takes longer than the copy itself,
    so the pool keeps its buffer from one save to the next and replaces it only when a
    snapshot needs more than it holds.
    Saves through one pool run one at a time: a save first waits until the previous
    one's file is written, and only then reuses the buffer. ``max_bytes`` bounds the
    buffer; a snapshot that does not fit uses ordinary (pageable) memory for that save.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.allocations = 0  # buffers allocated so far: stays at 1 while the state keeps its size
        self._buffer: torch.Tensor | None = None
        self._pinned = False
        self._lent = False
        self._lock = threading.Lock()  # guards _buffer, _pinned, _lent
        self._save_lock = threading.Lock()  # one async_save at a time takes the snapshot
        self._last: SaveHandle | None = None
        self._streams: dict[int, torch.cuda.Stream] = {}

    @property
    def nbytes(self) -> int:
        """Host bytes the pool holds."""
        with self._lock:
            return 0 if self._buffer is None else self._buffer.numel()

    @property
    def pinned(self) -> bool:
        """Whether the held buffer is page-locked (only when CUDA is available)."""
        with self._lock:
            return self._buffer is not None and self._pinned

    def clear(self) -> None:
        """Wait for the last save, then free the buffer (e.g. before a memory-hungry phase)."""
        with self._save_lock:
            if self._last is not None:
                self._last._done.wait()
            with self._lock:
                self._buffer = None  # the finalizer set in _alloc_host unpins it

    def _take(self, nbytes: int) -> tuple[torch.Tensor, bool]:
        """Lend a uint8 buffer of at least ``nbytes``; the bool says if it is the pool's."""
        import torch

        with self._lock:
            if self._lent:  # the save order makes this impossible; overwriting would corrupt a write
                raise RuntimeError("PinnedPool buffer lent twice")
            if self._buffer is not None and self._buffer.numel() >= nbytes:
                self._lent = True
                return self._buffer, True
            if self.max_bytes is not None and nbytes > self.max_bytes:
                logger.warning(
                    "snapshot of %d bytes exceeds PinnedPool max_bytes=%d: using pageable memory for this save",
                    nbytes,
                    self.max_bytes,
                )
                return torch.empty(nbytes, dtype=torch.uint8), False
            self._buffer = None  # free the old buffer before allocating its successor
            size = _round_up(nbytes, _GROW_STEP)
            if self.max_bytes is not None:
                size = min(size, self.max_bytes)
            self._buffer, self._pinned = _alloc_host(size)
            self.allocations += 1
            self._lent = True
            return self._buffer, True

    def _give(self, buffer: torch.Tensor, pooled: bool) -> None:
        """Take back a buffer lent by _take, once nothing reads it any more."""
        if pooled:
            with self._lock:
                self._lent = False

    def _stream(self, device_index: int) -> torch.cuda.Stream:
        """The side stream for copies from one device, made once: streams are a finite resource."""
        import torch

        if device_index not in self._streams:
            self._streams[device_index] = torch.cuda.Stream(device=device_index)
        return self._streams[device_index]


def _alloc_host(nbytes: int) -> tuple[torch.Tensor, bool]:
    """Allocate ``nbytes`` of host memory, page-locked if CUDA is available.

    cudaHostRegister pins exactly ``nbytes``, where PyTorch's caching host allocator
    (``pin_memory=True``) rounds up to a power of two and keeps freed blocks cached.
    """
    import torch

    buf = torch.empty(nbytes, dtype=torch.uint8)
    if not torch.cuda.is_available():
        return buf, False
    rc = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, _CUDA_HOST_REGISTER_PORTABLE))
    if rc != 0:
        logger.warning("cudaHostRegister of %d bytes failed (cudaError %d): buffer stays pageable", nbytes, rc)
        return buf, False
    unpin = weakref.finalize(buf, _unpin, buf.data_ptr())
    unpin.atexit = False  # at exit the CUDA context may be gone; the process frees the pages anyway
    return buf, True


def _unpin(data_ptr: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(data_ptr)


_default_pool: PinnedPool | None = None
_default_pool_lock = threading.Lock()


def _get_default_pool() -> PinnedPool:
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = PinnedPool()
        return _default_pool


def _poolable(t: torch.Tensor) -> bool:
    """Tensors whose bytes the snapshot copies itself; torch's deepcopy handles the rest."""
    import torch

    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and t.device.type in ("cpu", "cuda")
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
    )


def _find_tensors(state: Any) -> list[torch.Tensor]:
    """The distinct poolable tensors reachable through dicts, lists and tuples."""
    import torch

    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [state]
    while stack:  # iterative: deeply nested states must not hit the recursion limit
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if _poolable(obj):
                found.setdefault(id(obj), obj)
        elif isinstance(obj, (dict, list, tuple)) and id(obj) not in seen:
            seen.add(id(obj))
            stack.extend(obj.values() if isinstance(obj, dict) else obj)
    return list(found.values())


def _snapshot(state: Any, pool: PinnedPool) -> tuple[Any, torch.Tensor | None, bool, int]:
    """Copy ``state`` to host memory; return (host_state, buffer, pooled, nbytes).

    Each distinct storage is copied once, and every tensor is rebuilt as a view with the
    original offset, size and stride, so shared storage and strided layouts survive
    exactly as torch.save would record them. Everything else is deep-copied, so the
    caller may change the state as soon as this returns.
    """
    import torch

    tensors = _find_tensors(state)
    layout: dict[int, tuple[torch.UntypedStorage, int]] = {}  # storage id -> (storage, offset)
    nbytes = 0
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage._cdata not in layout:
            layout[storage._cdata] = (storage, total)
            nbytes += storage.nbytes()
            total = _round_up(total + storage.nbytes(), _ALIGN)
    buffer, pooled = pool._take(total) if total else (None, False)
    try:
        with torch.no_grad():
            host = _copy_storages(layout, buffer, pool)
            memo: dict[int, Any] = {}
            for t in tensors:
                memo[id(t)] = _host_tensor(t, host[t.untyped_storage()._cdata], memo)
            host_state = copy.deepcopy(state, memo)
    except BaseException:
        if buffer is not None:
            pool._give(buffer, pooled)
        raise
    return host_state, buffer, pooled, nbytes


def _copy_storages(
    layout: dict[int, tuple[torch.UntypedStorage, int]], buffer: torch.Tensor | None, pool: PinnedPool
) -> dict[int, torch.UntypedStorage]:
    """Copy every storage into its slice of ``buffer``; return when all copies are done.

    CUDA copies are issued first, non-blocking on a side stream per device that waits
    for the current stream (so they see every queued write), then CPU copies overlap them.
    """
    import torch

    whole = buffer.untyped_storage() if buffer is not None else None
    host: dict[int, torch.UntypedStorage] = {}
    by_device: dict[int, list[int]] = {}
    for key, (storage, offset) in layout.items():
        n = storage.nbytes()
        # A zero-byte slice would share its address with the next storage: torch.save
        # would then see one address under two dtypes and refuse to save.
        if n:
            assert whole is not None  # a buffer exists whenever some storage has bytes
            host[key] = whole[offset : offset + n]
        else:
            host[key] = torch.UntypedStorage(0)
        if n and storage.device.type == "cuda":
            by_device.setdefault(storage.device.index, []).append(key)
    events = []
    for index, keys in by_device.items():
        stream = pool._stream(index)
        stream.wait_stream(torch.cuda.current_stream(index))
        with torch.cuda.stream(stream):
            for key in keys:
                host[key].copy_(layout[key][0], non_blocking=True)
        events.append(stream.record_event())
    for key, (storage, _) in layout.items():
        if storage.nbytes() and storage.device.type == "cpu":
            host[key].copy_(storage)
    for event in events:
        event.synchronize()
    return host


def _host_tensor(t: torch.Tensor, storage: torch.UntypedStorage, memo: dict[int, Any]) -> torch.Tensor:
    """A CPU tensor over ``storage`` with t's dtype, layout, autograd flag, class and attributes."""
    import torch

    h = torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.size(), t.stride())
    if isinstance(t, torch.nn.Parameter):
        h = torch.nn.Parameter(h, requires_grad=t.requires_grad)
    else:
        h.requires_grad_(t.requires_grad)
    if t.__dict__:
        h.__dict__.update(copy.deepcopy(t.__dict__, memo))
    return h


def async_save(state_dict: Any, path: str | os.PathLike[str], pool: PinnedPool | None = None) -> SaveHandle:
    """Snapshot ``state_dict`` to host memory, then ``torch.save`` it to ``path`` in the background.

    Returns once the snapshot is complete: from then on the caller may modify or free
    the state. If the previous save through the same pool (default: one module-wide
    pool) is still writing, this first waits for it. ``path`` must be a file system path
    in an existing directory; the file appears complete or not at all (temporary name,
    then os.replace). Errors of the snapshot raise here; errors of the write raise from
    :meth:`SaveHandle.wait`.
    """
    import torch

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"async_save writes to a file system path (str or os.PathLike), not {type(path).__name__}")
    # Absolute now: the writer thread must not follow a chdir the caller makes after this returns.
    path = Path(os.path.abspath(os.fspath(path)))
    if not path.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "checkpoint directory does not exist", str(path.parent))
    pool = pool if pool is not None else _get_default_pool()
    start = time.perf_counter()
    with pool._save_lock:
        if pool._last is not None:
            pool._last._done.wait()  # its buffer comes back before _done is set
        waited_s = time.perf_counter() - start
        host_state, buffer, pooled, nbytes = _snapshot(state_dict, pool)
        handle = SaveHandle(path, nbytes)
        _order.begin(handle)
        # Tensors that went through deepcopy instead of the pool may be CUDA clones queued
        # on the caller's current stream: the writer uses that stream to copy them to host.
        stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None
        writer = threading.Thread(
            target=_write,
            args=(host_state, handle, pool, buffer, pooled, stream, start, waited_s),
            name=f"burstfs-save:{path.name}",
        )  # not a daemon: a save started just before exit still completes
        handle.blocking_s = time.perf_counter() - start
        try:
            writer.start()
        except BaseException:
            _order.end(handle)
            if buffer is not None:
                pool._give(buffer, pooled)
            raise
        pool._last = handle
    return handle


class _SaveOrder:
    """The last call wins, across pools: a save to a path renames over it only if no save
    called after it is in place there already (two pools' saves of one path finished out
    of order and left the older state).  Bounded by the saves in flight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls = 0
        self._ticket: dict[int, int] = {}  # id(handle) -> its call's number
        self._in_flight: dict[Path, int] = {}  # path -> saves to it not done
        self._placed: dict[Path, int] = {}  # path -> the number of the newest save renamed over it

    def begin(self, handle: SaveHandle) -> None:
        with self._lock:
            self._calls += 1
            self._ticket[id(handle)] = self._calls
            self._in_flight[handle.path] = self._in_flight.get(handle.path, 0) + 1

    def replace(self, handle: SaveHandle, tmp: Path) -> bool:
        """Rename ``tmp`` over the handle's path unless a later save is there; True if it did."""
        with self._lock:
            ticket = self._ticket[id(handle)]
            if self._placed.get(handle.path, 0) > ticket:
                return False
            os.replace(tmp, handle.path)
            self._placed[handle.path] = ticket
            return True

    def end(self, handle: SaveHandle) -> None:
        with self._lock:
            self._ticket.pop(id(handle), None)
            left = self._in_flight.get(handle.path, 1) - 1
            if left:
                self._in_flight[handle.path] = left
            else:
                self._in_flight.pop(handle.path, None)
                self._placed.pop(handle.path, None)


_order = _SaveOrder()


class _FileSink:
    """A file ``torch.save`` writes through Python, so that the OSError of a failed write
    (ENOSPC on a full tier, EIO from the mount) is what the caller gets: torch's own file
    writer reports any of them as ``RuntimeError('basic_ios::clear: iostream error')``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            self.error = exc
            raise
        return size

    def flush(self) -> None:
        """Nothing is buffered here."""


def _save(torch: Any, obj: Any, tmp: Path) -> None:
    """``torch.save(obj)`` into a new file at ``tmp``; a failed write raises its OSError."""
    sink = _FileSink(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
    try:
        torch.save(obj, sink)
    except RuntimeError as exc:
        if sink.error is not None:
            raise sink.error from exc
        raise
    finally:
        os.close(sink.fd)


def _write(
    host_state: Any,
    handle: SaveHandle,
    pool: PinnedPool,
    buffer: torch.Tensor | None,
    pooled: bool,
    stream: torch.cuda.Stream | None,
    start: float,
    waited_s: float,
) -> None:
    """Background thread: write the snapshot, rename it into place, give the buffer back."""
    import torch

    path = handle.path
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with torch.cuda.stream(stream):
            _save(torch, host_state, tmp)
        if not _order.replace(handle, tmp):
            logger.info("save path=%s superseded by a later save to it that is already in place", path)
            os.unlink(tmp)
    except BaseException as exc:  # noqa: BLE001 - handed to wait(), which re-raises it
        handle._error = exc
        try:
            os.unlink(tmp)
        except OSError:  # not there, or its file system gone too (ENOTCONN): the save's error is the news
            pass
    finally:
        _order.end(handle)
        if buffer is not None:
            pool._give(buffer, pooled)
        handle.total_s = time.perf_counter() - start
        log = logger.error if handle._error is not None else logger.info
        log(
            "save path=%s bytes=%d pooled=%s pinned=%s waited_s=%.3f blocking_s=%.3f total_s=%.3f error=%s",
            path,
            handle.nbytes,
            pooled,
            pooled and pool.pinned,
            waited_s,
            handle.blocking_s,
            handle.total_s,
            None if handle._error is None else repr(handle._error),
        )
        handle._done.set()
