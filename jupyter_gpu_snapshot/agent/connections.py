"""One connection to the node agent, seen from the socket: who is at the other end, the
request line and what it must be, the answer and the end of the connection, and the
agent's log of its clients' mistakes (``server.NodeAgent`` serves each)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..agent_client.protocol import OPERATIONS, encode
from ..core.errors import InvalidRequest, SnapshotError
from .pods.entry_program import start_ticks
from .pods.identity import pid_of

log = logging.getLogger(__name__)

# Seconds a client has to read a reply before its connection is dropped.
REPLY_TIMEOUT = 60.0
# How often an operation whose client half-closed the connection checks that the client
# is still there to read the answer (``client_gone``).
HANGUP_POLL_SECONDS = 0.5


def peer_ids(sock: socket.socket) -> tuple[int, int]:
    """The uid and gid of the process at the other end of ``sock``, as the kernel says
    (``SO_PEERCRED``): one system call."""
    _pid, uid, gid = peer_credentials(sock)
    return uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """The pid (in the agent's pid namespace), uid and gid of the process at the other
    end of ``sock`` when it connected (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


# getsockopt(2): a pidfd of the peer's process (Linux 6.5+; the same number everywhere).
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


@dataclass
class Peer:
    """The process at the other end of a connection, as the agent accepted it: its pid (in
    the agent's namespace), uid and gid (``SO_PEERCRED``), a pidfd of it (``SO_PEERPIDFD``)
    and its start (clock ticks since boot). The pidfd stands for that very process: a pid
    reused later is never taken for it. Closed once the caller is known, or the connection
    ends (``close``): whichever comes first, and never under a thread that reads with it
    (``pidfd_in_use``), so that its number is never another descriptor's by then."""

    pid: int
    uid: int
    gid: int
    pidfd: int | None
    start: int
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _users: int = 0
    _closing: bool = False

    @classmethod
    def of(cls, sock: socket.socket, in_pod: bool) -> Peer:
        """The peer of ``sock``, read when it is accepted. Only a caller in a pod
        (``in_pod``, an agent that serves pods) is known by its process, which takes a
        pidfd and a start; a user is known by their uid alone, and takes no descriptor.
        Where the kernel gives no pidfd of the peer (before Linux 6.5), one is opened now,
        and the start read with it is that of the process found at the pid: its start is
        then checked at each later use (``start_ticks``). OSError: the peer is gone
        already (ProcessLookupError, FileNotFoundError), or no descriptor is left."""
        pid, uid, gid = peer_credentials(sock)
        if not in_pod:
            return cls(pid, uid, gid, None, 0)
        try:
            pidfd: int | None = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
        except OSError as exc:
            if exc.errno not in (errno.ENOPROTOOPT, errno.EINVAL):
                raise
            pidfd = os.pidfd_open(pid) if pid > 0 else None
        try:
            start = start_ticks(pid) if pid > 0 else 0
            # Read while the pidfd's process was still at the pid: the start is its own.
            if pidfd is not None and pid_of(pidfd) != pid:
                raise ProcessLookupError(errno.ESRCH, f"process {pid} has ended")
        except BaseException:
            if pidfd is not None:
                os.close(pidfd)
            raise
        return cls(pid, uid, gid, pidfd, start)

    @contextlib.contextmanager
    def pidfd_in_use(self) -> Iterator[int | None]:
        """The pidfd, kept open until the block ends whoever closes the peer meanwhile;
        None once it was closed."""
        with self._lock:
            self._users += 1
            pidfd = None if self._closing else self.pidfd
        try:
            yield pidfd
        finally:
            with self._lock:
                self._users -= 1
                if self._closing and not self._users:
                    self._close_now()

    def close(self) -> None:
        """Close the pidfd now, or once the last block that uses it ends."""
        with self._lock:
            self._closing = True
            if not self._users:
                self._close_now()

    def _close_now(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def parse_request(line: bytes) -> tuple[str, dict[str, Any]]:
    """The operation and arguments of a request line; InvalidRequest naming what is wrong."""
    shape = 'send {"op": NAME, "args": {...}} on one line'
    try:
        request = json.loads(line)
    except ValueError as exc:  # not UTF-8 or not JSON
        raise InvalidRequest("agent", f"the request is not JSON: {exc}", hint=shape) from None
    except RecursionError:  # lists in lists deeper than the parser's stack
        raise InvalidRequest("agent", "the request is nested too deeply to be read",
                             hint=shape) from None
    if not isinstance(request, dict):
        raise InvalidRequest(
            "agent", f"the request is a JSON {type(request).__name__}, not an object",
            hint=shape)
    op, args = request.get("op"), request.get("args")
    if op not in OPERATIONS:
        raise InvalidRequest("agent", f"unknown operation {op!r}",
                             hint=f"one of {', '.join(OPERATIONS)}")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise InvalidRequest("agent", f"args must be a JSON object, not {type(args).__name__}",
                             hint=f'send {{"op": "{op}", "args": {{...}}}}')
    return str(op), args


async def client_gone(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Returns once no one is left to read the answer; what the client sends after its
    request line is read and ignored.

    The end of what the client sends (EOF) is not enough: a client may shut down only its
    writing side once it has sent its request (``shutdown(SHUT_WR)``, ``nc -N``) and still
    wait for the answer. So after EOF the socket itself is asked: a Unix socket reports
    POLLHUP once the peer has shut down both sides or closed it (Linux sets POLLHUP when
    both directions are shut, POLLRDHUP alone for a half-close), and POLLERR on a reset. A
    write that failed (a progress report to a closed socket) closes the transport, which
    counts too. Polled every ``HANGUP_POLL_SECONDS``, only while such a client's operation
    runs: the event loop's own selector would report the readable EOF without end."""
    with contextlib.suppress(ConnectionError, OSError):
        while await reader.read(1 << 16):
            pass
    sock = writer.get_extra_info("socket")
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLHUP)
    while not writer.transport.is_closing():
        if any(events & (select.POLLHUP | select.POLLERR | select.POLLNVAL)
               for _fd, events in poller.poll(0)):
            return
        await asyncio.sleep(HANGUP_POLL_SECONDS)


def say_and_close(writer: asyncio.StreamWriter, error: SnapshotError) -> None:
    """One error line, then the connection closed, without waiting: a client that does not
    read it (its buffer full) is cut off rather than holding a descriptor."""
    with contextlib.suppress(OSError, ConnectionError, RuntimeError):
        writer.write(encode({"error": error.to_dict()}))
    if writer.transport.get_write_buffer_size():
        writer.transport.abort()
    else:
        writer.close()


async def finish(writer: asyncio.StreamWriter) -> None:
    """Send what is left of the answer, within ``REPLY_TIMEOUT``, and close."""
    try:
        await asyncio.wait_for(writer.drain(), REPLY_TIMEOUT)
    except (OSError, ConnectionError, asyncio.TimeoutError):
        writer.transport.abort()
        return
    writer.close()


class QuietLog:
    """Errors logged at most once per origin and kind every ``seconds``, with the number
    of those left unsaid since: enough to see who does what, never a line per connection
    of a client that opens thousands."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        # (who, kind) -> (when it was last logged, how many since)
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def note(self, who: str, kind: str, line: str, level: int = logging.INFO) -> None:
        now = time.monotonic()
        last, unsaid = self._last.get((who, kind), (-self.seconds, 0))
        if now - last < self.seconds:
            self._last[(who, kind)] = (last, unsaid + 1)
            return
        self._last[(who, kind)] = (now, 0)
        if unsaid:
            line += f" ({unsaid} more {kind} of {who} unlogged before this)"
        log.log(level, "%s", line)
