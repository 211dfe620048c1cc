"""An HTTP proxy on 127.0.0.1 that injects S3 faults on command.

Sits between a client and moto::

    with FaultProxy(moto_endpoint) as proxy:
        remote = S3Remote(url, S3Options(endpoint_url=proxy.endpoint))
        proxy.fail_next(3, status=503)                     # SlowDown x3
        proxy.reset_next(1, when="response", match="partNumber=")
        proxy.reset_next(1, when="body", after=3 << 20)   # the response's first 3 MiB, then a reset
        proxy.delay_next(1, seconds=2.0)
        proxy.flip_next(1, match="/a.pt ", at=100)  # one bit of the body's byte 100 flipped in transit
        proxy.stall_next(1, match="PUT ")  # read the head, then neither read the body nor answer
        proxy.blackhole()    # accept every connection, read it, never answer
        proxy.pause()        # hold every request until resume(), then forward it
        proxy.resume()       # end either mode: held requests go on, black-holed ones are reset
        proxy.resume(silently=True)  # ... black-holed ones stay silent until their client gives up

Note that aiohttp itself resends an idempotent request (GET, PUT, HEAD, DELETE)
once after a reset connection, so ``reset_next(1)`` on a PUT is absorbed below
burstfs; reset two or more to reach burstfs' own retries.

Each client connection carries one request: the proxy forwards it upstream
with ``Connection: close`` and closes the client side after the response, so it
never has to find request boundaries on a kept-alive connection.  Rules are
consumed in the order they were added, each by the next request it matches.
The proxy runs its own event loop in a thread, bounds every read with a
timeout, and stops (cancelling open connections) on close.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

_IO_TIMEOUT = 30.0
_ERROR_CODES = {500: "InternalError", 502: "BadGateway", 503: "SlowDown", 504: "GatewayTimeout"}

Match = str | Callable[[str], bool] | None


@dataclass
class _Rule:
    kind: str  # "fail" | "reset" | "delay" | "stall" | "flip"
    remaining: int
    match: Match
    status: int = 503
    when: str = "request"
    seconds: float = 0.0
    after: int = 0  # when="body": bytes of the response body sent before the reset

    def matches(self, request_line: str) -> bool:
        if self.match is None:
            return True
        if isinstance(self.match, str):
            return self.match in request_line
        return self.match(request_line)


class FaultProxy:
    """Forward HTTP to ``upstream`` (``http://host:port``), failing requests as told."""

    def __init__(self, upstream: str) -> None:
        parsed = urllib.parse.urlparse(upstream)
        if parsed.hostname is None or parsed.port is None:
            raise ValueError(f"upstream must be http://HOST:PORT, not {upstream!r}")
        self._upstream = (parsed.hostname, parsed.port)
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self.port = 0
        #: Request lines seen, in order, and how many faults were injected.
        self.requests: list[str] = []
        self.heads: list[tuple[str, dict[str, str]]] = []  # request line and headers (lower-case names)
        self.injected = 0
        #: "blackhole" | "pause" | None: what happens to every new request (see blackhole()).
        self._mode: str | None = None
        self._mode_changed = threading.Condition(self._lock)
        self._silent_heal = False  # see resume()
        #: Connections held by the current mode (black-holed or paused), for tests to wait on.
        self.held = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- commands (thread-safe) --------------------------------------------------

    def fail_next(self, n: int, status: int = 503, match: Match = None) -> None:
        """Answer the next ``n`` matching requests with ``status`` and an S3 error body (503 = SlowDown)."""
        self._add(_Rule("fail", n, match, status=status))

    def reset_next(self, n: int, when: str = "request", match: Match = None, after: int = 0) -> None:
        """Reset the connection of the next ``n`` matching requests.

        when="request": mid-request, before the server sees it.
        when="response": after the server processed it, before the client gets the answer.
        when="body": after the response head and ``after`` bytes of its body (a stream cut short).
        """
        if when not in ("request", "response", "body"):
            raise ValueError(f"when must be 'request', 'response' or 'body', not {when!r}")
        self._add(_Rule("reset", n, match, when=when, after=after))

    def flip_next(self, n: int, match: Match = None, at: int = 0) -> None:
        """Flip one bit of byte ``at`` of the body of the next ``n`` matching responses (a
        corruption in transit: the object on the server is intact)."""
        self._add(_Rule("flip", n, match, after=at))

    def delay_next(self, n: int, seconds: float, match: Match = None) -> None:
        """Hold the response to the next ``n`` matching requests for ``seconds``."""
        self._add(_Rule("delay", n, match, seconds=seconds))

    def stall_next(self, n: int, match: Match = None) -> None:
        """Read the head of the next ``n`` matching requests, then read nothing more and never
        answer until the proxy closes: the send of a body larger than the socket buffers
        stalls (a peer whose receive window stays shut, while other connections pass)."""
        self._add(_Rule("stall", n, match))

    def blackhole(self) -> None:
        """From now on, accept connections and read requests but never answer them
        (a hung server, or a firewall that drops packets after the handshake).
        ``resume()`` resets the connections held so far."""
        self._set_mode("blackhole")

    def pause(self) -> None:
        """From now on, hold every request (unanswered) until ``resume()``, then forward it
        (a server stalled by a long GC pause or a failover)."""
        self._set_mode("pause")

    def resume(self, *, silently: bool = False) -> None:
        """End ``blackhole()`` or ``pause()``.  ``silently``: connections black-holed so far stay
        silent until their client gives up (a middlebox that lost their state); new ones pass."""
        with self._lock:
            self._silent_heal = silently
        self._set_mode(None)

    def _set_mode(self, mode: str | None) -> None:
        with self._lock:
            self._mode = mode
            self._mode_changed.notify_all()

    def _held_mode(self) -> str | None:
        with self._lock:
            return self._mode

    def clear(self) -> None:
        """Drop all pending rules."""
        with self._lock:
            self._rules.clear()

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def _take(self, request_line: str) -> _Rule | None:
        with self._lock:
            self.requests.append(request_line)
            for rule in self._rules:
                if rule.matches(request_line):
                    rule.remaining -= 1
                    if rule.remaining <= 0:
                        self._rules.remove(rule)
                    self.injected += rule.kind != "delay"
                    return rule
            return None

    # -- lifecycle ------------------------------------------------------------------

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(ready),), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault proxy did not start")

    def close(self) -> None:
        if self._thread is None:
            return
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self._thread = None
        self._loop.close()

    async def _serve(self, ready: threading.Event) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        async with server:
            await self._stop.wait()
        # Every task of this loop, not only the handlers seen so far: a connection accepted
        # just before the close has a task that has not run yet, and a handler left pending
        # when the loop closes raises from its ``finally`` once garbage-collected.
        while pending := asyncio.all_tasks() - {asyncio.current_task()}:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._handle(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass  # the client or the upstream went away: nothing to report to anyone
        except asyncio.CancelledError:
            pass  # the proxy is closing; ending quietly keeps asyncio from logging the cancelled task
        finally:
            writer.close()

    # -- one request -------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        mode = self._held_mode()
        if mode is not None:  # before reading the head: a black hole does not even parse
            held_as = await self._hold(reader, mode)
            if held_as == "blackhole":
                _reset(writer)
                return
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _IO_TIMEOUT)
        request_line, headers = _parse_head(head)
        # Without a length (chunked), the body is copied until the response is done.
        body_length = None if "transfer-encoding" in headers else int(headers.get("content-length", "0"))
        expects_continue = headers.get("expect", "").lower() == "100-continue"
        with self._lock:
            self.heads.append((request_line, headers))
        rule = self._take(request_line)

        if rule is not None and rule.kind == "stall":
            await asyncio.Event().wait()  # until close() cancels it
        if rule is not None and rule.kind == "fail":
            if not expects_continue and body_length is not None:
                # Read the body so the client sees our answer, not a broken pipe.
                await _read_exactly(reader, body_length)
            writer.write(_error_response(rule.status, request_line))
            await writer.drain()
            return
        if rule is not None and rule.kind == "reset" and rule.when == "request":
            if not expects_continue and body_length:
                await _read_exactly(reader, body_length // 2)
            _reset(writer)
            return

        up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self._upstream), _IO_TIMEOUT)
        try:
            up_writer.write(_with_connection_close(head))
            body = asyncio.ensure_future(_copy(reader, up_writer, body_length))
            try:
                await self._relay_response(rule, request_line, up_reader, writer)
            finally:
                body.cancel()
                await asyncio.gather(body, return_exceptions=True)
        finally:
            up_writer.close()

    async def _hold(self, reader: asyncio.StreamReader, mode: str) -> str:
        """Keep a new connection unanswered while ``mode`` lasts; returns the mode it was held in.

        A black hole drains whatever the client sends (it never learns anything);
        a pause leaves the request unread, to be forwarded once resumed.
        """
        with self._lock:
            self.held += 1
            self.requests.append(f"({mode})")
        try:
            while self._held_mode() == mode or (mode == "blackhole" and self._silent_heal):
                if mode == "blackhole":
                    try:
                        chunk = await asyncio.wait_for(reader.read(1 << 16), 0.05)
                    except TimeoutError:
                        continue
                    if not chunk:  # the client gave up
                        return mode
                else:
                    await asyncio.sleep(0.05)
            return mode
        finally:
            with self._lock:
                self.held -= 1

    async def _relay_response(
        self, rule: _Rule | None, request_line: str, up_reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            head = await asyncio.wait_for(up_reader.readuntil(b"\r\n\r\n"), _IO_TIMEOUT)
            status_line, headers = _parse_head(head)
            if not status_line.split(" ")[1].startswith("1"):
                break
            writer.write(head)  # 100 Continue: let the client send its body
            await writer.drain()
        if rule is not None and rule.kind == "delay":
            await asyncio.sleep(rule.seconds)
        if rule is not None and rule.kind == "reset" and rule.when != "body":
            _reset(writer)
            return
        writer.write(_with_connection_close(head))
        if rule is not None and rule.kind == "reset":  # when="body": part of the body, then the reset
            length = headers.get("content-length")  # a shorter body goes whole: never wait for more
            await _copy(up_reader, writer, rule.after if length is None else min(rule.after, int(length)))
            await writer.drain()
            _reset(writer)
            return
        status = int(status_line.split(" ")[1])
        if not (request_line.startswith("HEAD ") or status in (204, 304)):
            length = None if headers.get("content-length") is None else int(headers["content-length"])
            if rule is not None and rule.kind == "flip" and (length is None or rule.after < length):
                await _copy(up_reader, writer, rule.after)
                byte = await asyncio.wait_for(up_reader.readexactly(1), _IO_TIMEOUT)
                writer.write(bytes([byte[0] ^ 0x40]))
                length = None if length is None else length - rule.after - 1
            await _copy(up_reader, writer, length)
        await writer.drain()


def _parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return lines[0], headers


def _with_connection_close(head: bytes) -> bytes:
    lines = [ln for ln in head.split(b"\r\n") if ln and not ln.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close", b"", b""])


def _error_response(status: int, request_line: str) -> bytes:
    code = _ERROR_CODES.get(status, "InternalError")
    body = (
        b""
        if request_line.startswith("HEAD ")
        else (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>injected by faultproxy</Message></Error>"
        ).encode()
    )
    head = (
        f"HTTP/1.1 {status} {code}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return head + body


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a crashed server or a middlebox would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _read_exactly(reader: asyncio.StreamReader, n: int) -> None:
    while n > 0:
        chunk = await asyncio.wait_for(reader.read(min(n, 1 << 16)), _IO_TIMEOUT)
        if not chunk:
            return
        n -= len(chunk)


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int | None) -> None:
    """Copy ``n`` bytes (None: until EOF) from ``reader`` to ``writer``."""
    while n is None or n > 0:
        chunk = await asyncio.wait_for(reader.read(1 << 16 if n is None else min(n, 1 << 16)), _IO_TIMEOUT)
        if not chunk:
            return
        writer.write(chunk)
        await writer.drain()
        if n is not None:
            n -= len(chunk)
