"""Files opened as the caller, by a helper of theirs, for the node agent: every file of a
user's kernel that the agent (root) needs, and every file criu needs for their restore.

So that no path the caller controls is ever resolved with root's privileges, the agent runs
``opener_program`` as the caller (their uid, gid and groups, no capabilities), which opens
each file it is asked for and sends the descriptor back; the agent then reads it, checks
its type, or hands it to criu (``--inherit-fd``), and never opens the path itself. The
caller's own permissions decide, links and every directory of the path included: a link to
a root-only file fails as it would for the caller. Nothing is checked first and opened
later, so there is no race between a check and an open. Every file is opened without
waiting (``O_NONBLOCK``), and each answer must come within a deadline: a FIFO, a device or
a hung file system of the caller's never holds a thread of the agent.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

from ...core import kernel_log
from ...core.errors import InvalidRequest, SnapshotError
from ...core.file_access import FileAccess
from ...core.user_paths import UserPath
from ..credentials.ownership import Caller
from .restore_plan import Opening

OPENER = Path(__file__).with_name("opener_program.py")
# A caller's file system can make open() wait (FUSE, a hung NFS server): past this the
# helper is killed and the step refused, so no root thread waits on the caller.
OPEN_DEADLINE_SECONDS = 60.0
_ANSWER_BYTES = 4096


class CallerFiles(FileAccess):
    """The engine's ``FileAccess`` for one operation of the caller: their helper, started
    at the first ``open`` and ended by ``close`` (``operations``, at the operation's end).
    ``root``: resolve every path in that root (a caller in a pod: their container's)."""

    def __init__(self, caller: Caller, root: str | None = None,
                 deadline_seconds: float = OPEN_DEADLINE_SECONDS) -> None:
        self.caller = caller
        self.root = root
        self.deadline_seconds = deadline_seconds
        self._lock = threading.Lock()
        self._helper: subprocess.Popen[bytes] | None = None
        self._channel: socket.socket | None = None
        # Once closed, nothing starts a helper again: a digest still running in a thread
        # after its save failed must not leave one behind.
        self._closed = False

    def open(self, path: str, flags: int, what: UserPath) -> int:
        """``path`` (``what`` of the registry) opened as the caller with ``flags`` (and
        ``O_NONBLOCK``); OSError as the caller's own open(2) fails. SnapshotError when the
        helper fails or takes longer than the deadline (it is then ended)."""
        with self._lock:
            if self._closed:
                raise OSError(errno.ECANCELED, "the operation that opened it has ended", path)
            channel = self._start()
            channel.settimeout(self.deadline_seconds)
            try:
                channel.send(json.dumps({"path": path, "flags": flags}).encode())
                message, fds, _, _ = socket.recv_fds(channel, _ANSWER_BYTES, 1)
            except TimeoutError:
                self._end()
                raise SnapshotError(
                    "agent", f"opening {what.what} {path} as you took more than "
                    f"{self.deadline_seconds:.0f} s",
                    hint="is a file system of the kernel's files hung (NFS, FUSE)?") from None
            except OSError:
                message, fds = b"", []  # the helper is gone: said below
            if not message:
                said = self._end()
                raise SnapshotError(
                    "agent", "the helper that opens your kernel's files as you ended early"
                    + (f": {said}" if said else ""))
            answer = json.loads(message)
            if not answer.get("ok"):
                for fd in fds:
                    os.close(fd)
                raise OSError(int(answer.get("errno") or 0), str(answer.get("error")), path)
            if len(fds) != 1:
                raise SnapshotError("agent", f"no descriptor came back for {path}")
            return fds[0]

    def open_log(self, path: str) -> int:
        """The kernel's log, the caller's own file: opened (made, if missing) by them for
        appending, through no link, and refused unless a regular file, naming what is
        there instead."""
        try:
            fd = self.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                           UserPath.KERNEL_LOG)
        except OSError as error:
            raise kernel_log.log_refused(path, error, self._kind(path)) from None
        try:
            kernel_log.require_regular_log(fd, path)
            # Blocking again, as the kernel had its log: it is a regular file.
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _kind(self, path: str) -> int | None:
        """What is at ``path`` (its mode), as the caller sees it without following it."""
        try:
            fd = self.open(path, os.O_PATH | os.O_NOFOLLOW, UserPath.KERNEL_LOG)
        except OSError:
            return None
        try:
            return os.fstat(fd).st_mode
        finally:
            os.close(fd)

    def _start(self) -> socket.socket:
        if self._channel is not None:
            return self._channel
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._helper = subprocess.Popen(
                [sys.executable, "-I", "-S", str(OPENER), str(theirs.fileno()),
                 *([self.root] if self.root else [])],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                pass_fds=(theirs.fileno(),), user=self.caller.uid, group=self.caller.gid,
                extra_groups=sorted(self.caller.groups), env={}, cwd="/",
                start_new_session=True,
            )
        self._channel = ours
        return ours

    def _end(self) -> str:
        """End the helper; the end of what it said on stderr."""
        said = b""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._helper is not None:
            with contextlib.suppress(ProcessLookupError):
                self._helper.kill()
            self._helper.wait()
            if self._helper.stderr is not None:
                said = self._helper.stderr.read()[-500:]
                self._helper.stderr.close()
            self._helper = None
        return said.decode(errors="replace").strip()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._end()


def open_for_criu(openings: list[Opening], files: FileAccess) -> dict[str, int]:
    """The descriptors of ``openings``, opened as the caller, by criu's name for each.

    Raises :class:`InvalidRequest` naming the first file the caller cannot open; the
    descriptors opened so far are closed then."""
    opened: dict[str, int] = {}
    try:
        for opening in openings:
            try:
                opened[opening.key] = files.open(opening.path, opening.flags, opening.what)
            except OSError as error:
                raise InvalidRequest(
                    "restore", f"the kernel had {opening.path} open, and you cannot open it "
                    f"now: {error.strerror}",
                    hint="the node agent reopens a kernel's files with your own "
                    "permissions: put the file back where it was, readable (and writable, "
                    "if the kernel wrote it) by you") from None
    except BaseException:
        for fd in opened.values():
            os.close(fd)
        raise
    return opened
