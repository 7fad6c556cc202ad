"""Segments through Redis, for a vLLM server on another host: a minimal RESP2 client and the keys.

    Blendserve (host A)                              vLLM (host B, this connector loaded)
    -------------------                              ------------------------------------
    segment filled in a host buffer                  scheduler: GETRANGE key 0 4095 + STRLEN key
    SET blendserve:segment:<name> <bytes> EX ttl ->    (the header, and the size it promises)
    handle "redis:<name>" in kv_transfer_params      worker: GET key into one buffer, the layers are
                                                       views of it (`Segment.from_buffer`); DEL key

The value is exactly the shared-memory segment's bytes (`segments`), so both paths share one format.
The connector may import nothing beyond the standard library, torch, numpy and vLLM, so this speaks
RESP2 over a plain socket: `redis://[[user]:password@]host[:port][/db]` (AUTH and SELECT when
given), binary-safe values written with `sendall` from a memoryview and bulk replies read with
`recv_into` straight into one preallocated buffer. A segment larger than the server's
`proto-max-bulk-len` (512 MB by default) is refused by the server: raise it there for long prompts.
Every failure (refused, timed out, dropped, an error reply) is a `RedisError`, a `SegmentError`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from blendserve_vllm.segments import HEADER_BYTES, Segment, SegmentError, SegmentMeta, check_name

logger = logging.getLogger(__name__)

HANDLE_PREFIX = "redis:"  # a handle naming a segment in Redis: "redis:<name>"
KEY_PREFIX = "blendserve:segment:"  # its key: "blendserve:segment:<name>"
DEFAULT_PORT = 6379
SMALL = 1 << 16  # arguments up to this size are joined into one send; larger ones go as they are
RECV = 1 << 16

Arg = str | int | bytes | bytearray | memoryview


class RedisError(SegmentError):
    """Redis unreachable, timed out, dropped, or answering with an error."""


def is_redis_handle(handle: object) -> bool:
    return isinstance(handle, str) and handle.startswith(HANDLE_PREFIX)


def redis_name(handle: str) -> str:
    """The segment name inside a Redis handle ("redis:<name>"), checked as a shm name is."""
    if not is_redis_handle(handle):
        raise SegmentError(f"not a Redis segment handle: {handle!r}")
    return check_name(handle[len(HANDLE_PREFIX):])


def segment_key(name: str) -> str:
    return KEY_PREFIX + check_name(name)


@dataclass(frozen=True)
class RedisAddress:
    """Where a Redis server is and how to log in (from a `redis://` URL)."""

    host: str
    port: int = DEFAULT_PORT
    db: int = 0
    username: str | None = None
    password: str | None = None

    @classmethod
    def from_url(cls, url: str) -> RedisAddress:
        """`redis://[[user]:password@]host[:port][/db]`; anything else is a RedisError."""
        try:
            parts = urlsplit(url)
            port = parts.port or DEFAULT_PORT
        except ValueError as exc:
            raise RedisError(f"bad Redis URL: {exc}") from None
        if parts.scheme != "redis":
            raise RedisError(f"Redis URL scheme must be redis:// (TLS is not supported), got {parts.scheme!r}")
        if not parts.hostname:
            raise RedisError("Redis URL without a host")
        path = parts.path.strip("/")
        if path and not path.isdigit():
            raise RedisError(f"Redis URL database must be a number, got {path!r}")
        password = unquote(parts.password) if parts.password is not None else None
        username = unquote(parts.username) if parts.username else None
        return cls(parts.hostname, port, int(path or 0), username, password)

    def __str__(self) -> str:
        """The URL with the password hidden (for logs)."""
        login = f"{self.username or ''}:***@" if self.password is not None else ""
        return f"redis://{login}{self.host}:{self.port}/{self.db}"


class RedisClient:
    """One connection (opened on first use, re-opened once when a reused one broke), one command at
    a time (thread-safe). Timeouts apply to connecting and to each socket read or write."""

    def __init__(self, url: str | RedisAddress, timeout_s: float = 5.0) -> None:
        self.address = url if isinstance(url, RedisAddress) else RedisAddress.from_url(url)
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._pid = os.getpid()
        self._rbuf = bytearray()
        self._rpos = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ commands
    def ping(self) -> bool:
        return self.execute("PING") == "PONG"

    def set(self, key: str, value: bytes | bytearray | memoryview, ex_s: int | None = None) -> None:
        """SET key value [EX ex_s]: the value is sent from its own memory, never copied."""
        args: list[Arg] = ["SET", key, value]
        if ex_s is not None:
            args += ["EX", max(1, int(ex_s))]
        self.execute(*args)

    def get(self, key: str) -> bytearray | None:
        """GET key: the value read into one buffer of its size; None for a missing key."""
        return self.execute("GET", key)

    def getrange(self, key: str, start: int, end: int) -> bytes:
        """GETRANGE key start end (both inclusive): b"" for a missing key."""
        return bytes(self.execute("GETRANGE", key, start, end))

    def head(self, key: str, nbytes: int) -> tuple[bytes, int]:
        """The first `nbytes` of a value and its full length, in one round trip (0 for a missing key)."""
        head, size = self.pipeline([("GETRANGE", key, 0, nbytes - 1), ("STRLEN", key)])
        return bytes(head), size

    def delete(self, *keys: str) -> int:
        """DEL keys: how many existed."""
        return self.execute("DEL", *keys) if keys else 0

    def exists(self, key: str) -> bool:
        return self.execute("EXISTS", key) == 1

    def exists_each(self, keys: Sequence[str]) -> list[bool]:
        """EXISTS per key, pipelined (one round trip)."""
        return [n == 1 for n in self.pipeline([("EXISTS", k) for k in keys])] if keys else []

    def execute(self, *args: Arg):
        return self.pipeline([args])[0]

    def pipeline(self, commands: Sequence[Sequence[Arg]]) -> list:
        """Send every command, then read every reply; an error reply raises once all are read."""
        with self._lock:
            replies = self._round_trip(commands)
        for reply in replies:
            if isinstance(reply, _ErrorReply):
                raise RedisError(f"Redis at {self.address}: {reply.message}")
        return replies

    def close(self) -> None:
        with self._lock:
            self._drop()

    # ------------------------------------------------------------------ connection
    def _round_trip(self, commands: Sequence[Sequence[Arg]]) -> list:
        for attempt in (0, 1):
            reused = self._sock is not None and self._pid == os.getpid()
            try:
                if not reused:
                    self._connect()
                self._send(commands)
                return [self._read_reply() for _ in commands]
            except (OSError, ValueError, RedisError) as exc:
                self._drop()
                if attempt or not reused or isinstance(exc, (TimeoutError, RedisError)):
                    raise _as_redis_error(self.address, exc) from None
                logger.debug("Redis connection to %s broke (%s); reconnecting once", self.address, exc)
        raise AssertionError("unreachable")

    def _connect(self) -> None:
        self._drop()
        a = self.address
        sock = socket.create_connection((a.host, a.port), timeout=self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self._pid = sock, os.getpid()
        login: list[tuple[Arg, ...]] = []
        if a.password is not None:
            login.append(("AUTH", a.username, a.password) if a.username else ("AUTH", a.password))
        if a.db:
            login.append(("SELECT", a.db))
        if login:
            self._send(login)
            for reply in [self._read_reply() for _ in login]:
                if isinstance(reply, _ErrorReply):
                    raise RedisError(f"Redis at {a} refused the login: {reply.message}")

    def _drop(self) -> None:
        if self._sock is not None and self._pid == os.getpid():
            self._sock.close()  # a socket inherited over fork is the parent's: left alone
        self._sock, self._rbuf, self._rpos = None, bytearray(), 0

    # ------------------------------------------------------------------ RESP2
    def _send(self, commands: Sequence[Sequence[Arg]]) -> None:
        encoded = [[_as_bytes(arg) for arg in args] for args in commands]  # views: nothing copied yet
        small = bytearray()
        for args in encoded:
            small += b"*%d\r\n" % len(args)
            for data in args:
                small += b"$%d\r\n" % data.nbytes
                if data.nbytes <= SMALL:
                    small += data
                else:  # a segment: straight from its buffer
                    self._sock.sendall(small)
                    self._sock.sendall(data)
                    small = bytearray()
                small += b"\r\n"
        self._sock.sendall(small)

    def _read_reply(self):
        line = self._readline()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return _ErrorReply(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            return self._read_bulk(int(rest))
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._read_reply() for _ in range(n)]
        raise ValueError(f"unexpected Redis reply {line[:40]!r}")

    def _read_bulk(self, n: int) -> bytearray | None:
        """A bulk string of n bytes into one buffer allocated for it (None for nil)."""
        if n < 0:
            return None
        out = bytearray(n)
        self._read_into(memoryview(out))
        if self._readline() != b"":
            raise ValueError("Redis bulk string not followed by CRLF")
        return out

    def _readline(self) -> bytes:
        while True:
            end = self._rbuf.find(b"\r\n", self._rpos)
            if end >= 0:
                line = bytes(self._rbuf[self._rpos:end])
                self._rpos = end + 2
                return line
            self._recv_more()

    def _recv_more(self) -> None:
        if self._rpos:
            del self._rbuf[:self._rpos]
            self._rpos = 0
        chunk = self._sock.recv(RECV)
        if not chunk:
            raise ConnectionError("Redis closed the connection")
        self._rbuf += chunk

    def _read_into(self, out: memoryview) -> None:
        """Fill `out`: first what is buffered already, then recv_into it directly."""
        have = min(len(out), len(self._rbuf) - self._rpos)
        out[:have] = self._rbuf[self._rpos:self._rpos + have]
        self._rpos += have
        while have < len(out):
            n = self._sock.recv_into(out[have:])
            if n == 0:
                raise ConnectionError("Redis closed the connection mid-reply")
            have += n


@dataclass(frozen=True)
class _ErrorReply:
    message: str


def _as_bytes(arg: Arg) -> memoryview:
    if isinstance(arg, str):
        arg = arg.encode()
    elif isinstance(arg, int):
        arg = b"%d" % arg
    return memoryview(arg).cast("B")


def _as_redis_error(address: RedisAddress, exc: Exception) -> RedisError:
    if isinstance(exc, RedisError):
        return exc
    if isinstance(exc, TimeoutError):
        return RedisError(f"Redis at {address} timed out")
    return RedisError(f"Redis at {address} unavailable: {exc}")


# ------------------------------------------------------------------ segments in Redis
def read_meta(client: RedisClient, name: str) -> SegmentMeta:
    """A segment's header alone (the connector's scheduler side), or SegmentError."""
    head, size = client.head(segment_key(name), HEADER_BYTES)
    if size == 0:
        raise SegmentError(f"segment {HANDLE_PREFIX}{name} is gone")
    meta = SegmentMeta.decode(head)
    if size != meta.nbytes:
        raise SegmentError(f"segment {HANDLE_PREFIX}{name} is torn")
    return meta


def open_segment(client: RedisClient, name: str) -> Segment:
    """A whole segment read into one host buffer (the connector's worker side), or SegmentError."""
    buf = client.get(segment_key(name))
    if buf is None:
        raise SegmentError(f"segment {HANDLE_PREFIX}{name} is gone")
    return Segment.from_buffer(name, buf)


def free(client: RedisClient, names: Sequence[str]) -> int:
    """DEL the segments' keys: how many were still there."""
    return client.delete(*(segment_key(n) for n in names))
