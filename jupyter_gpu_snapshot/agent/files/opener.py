"""Opening, as the caller, every file criu needs for their restore.

The node agent's criu runs as root. So that no path the caller controls is ever resolved
with root's privileges, the agent runs ``opener_program`` as the caller (their uid, gid
and groups, no capabilities), which opens each file of the plan (``restore_plan``) and
sends the descriptors back; criu gets them as ``--inherit-fd`` and opens none of those
paths itself. The caller's own permissions decide, links and every directory of the path
included: a link to a root-only file fails as it would for the caller. Nothing is checked
first and opened later, so there is no race between a check and criu's open. Each is
opened with the access its every use needs, so criu's reopening of it, with one use's
flags, asks for nothing the caller was not granted.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from ...core.errors import InvalidRequest, SnapshotError
from ..credentials.ownership import Caller
from .restore_plan import Opening

OPENER = Path(__file__).with_name("opener_program.py")
# A caller's file system can make open() wait (FUSE, a hung NFS server): past this the
# opener is killed and the restore refused, so no root thread waits on the caller.
OPEN_DEADLINE_SECONDS = 60.0
_ANSWER_BYTES = 4096


def open_for_criu(openings: list[Opening], caller: Caller,
                  deadline_seconds: float = OPEN_DEADLINE_SECONDS,
                  root: str | None = None) -> dict[str, int]:
    """The descriptors of ``openings``, opened as ``caller``, by criu's name for each.

    Raises :class:`InvalidRequest` naming the first file the caller cannot open, or when the
    opening takes longer than ``deadline_seconds``; the descriptors opened so far are
    closed then."""
    opened: dict[str, int] = {}
    if not openings:
        return opened
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        opener = subprocess.Popen(
            [sys.executable, "-I", "-S", str(OPENER), str(theirs.fileno()),
             *([root] if root else [])],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            pass_fds=(theirs.fileno(),), user=caller.uid, group=caller.gid,
            extra_groups=sorted(caller.groups), env={}, cwd="/", start_new_session=True,
        )
        theirs.close()
        try:
            assert opener.stdin is not None
            with opener.stdin:
                opener.stdin.write(json.dumps(
                    [{"path": o.path, "flags": o.flags} for o in openings]).encode())
            ends = time.monotonic() + deadline_seconds
            for opening in openings:
                opened[opening.key] = _receive(ours, opening, opener, ends, deadline_seconds)
        except BaseException:
            for fd in opened.values():
                os.close(fd)
            raise
        finally:
            with contextlib.suppress(ProcessLookupError):
                opener.kill()
            opener.wait()
            if opener.stderr is not None:
                opener.stderr.close()
    return opened


def _receive(channel: socket.socket, opening: Opening, opener: subprocess.Popen[bytes],
             ends: float, deadline_seconds: float) -> int:
    channel.settimeout(max(0.0, ends - time.monotonic()))
    try:
        message, fds, _, _ = socket.recv_fds(channel, _ANSWER_BYTES, 1)
    except TimeoutError:
        raise InvalidRequest(
            "restore", f"opening the kernel's files as you took more than "
            f"{deadline_seconds:.0f} s (still waiting for {opening.path})",
            hint="is a file system of the kernel's files hung (NFS, FUSE)?") from None
    if not message:
        said = b""
        if opener.stderr is not None and opener.poll() is not None:
            said = opener.stderr.read()[-500:]
        raise SnapshotError(
            "restore", "the helper that opens the kernel's files as you ended early"
            + (f": {said.decode(errors='replace').strip()}" if said else ""))
    answer = json.loads(message)
    if not answer.get("ok"):
        for fd in fds:
            os.close(fd)
        raise InvalidRequest(
            "restore", f"the kernel had {opening.path} open, and you cannot open it now: "
            f"{answer.get('error')}",
            hint="the node agent reopens a kernel's files with your own permissions: put "
            "the file back where it was, readable (and writable, if the kernel wrote it) "
            "by you")
    if len(fds) != 1:
        raise SnapshotError("restore", f"no descriptor came back for {opening.path}")
    return fds[0]
