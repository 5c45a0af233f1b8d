"""Opens files as the user it runs as, and sends the descriptors back to the node agent.

Run by the agent as the caller (their uid, gid and groups; no capabilities) with
``python -I -S opener_program.py FD [ROOT]``, where FD is one end of a SOCK_SEQPACKET socket
pair. With ROOT (``/proc/PID/root`` of a process of the caller's container, for an agent
that serves pods), every path is resolved inside that root, its links and ``..`` included
(``openat2`` with ``RESOLVE_IN_ROOT``), as the container itself would resolve it.
It reads a JSON list of ``{"path", "flags"}`` from stdin and answers each, in order,
with one message: ``{"ok": true}`` carrying the opened descriptor,
or ``{"ok": false, "error": "..."}``. The kernel checks every path component and the file
itself against the caller's own permissions, links included: whatever comes back is what
the caller could have opened themselves.

Only the standard library is imported: the agent runs this as another user.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import struct
import sys

__stdlib_only__ = True  # run as python -I -S: it imports the standard library alone

SYS_OPENAT2 = 437  # the same number on every architecture that has it
RESOLVE_NO_MAGICLINKS, RESOLVE_IN_ROOT = 0x02, 0x10


def open_one(path: str, flags: int, root: int | None = None) -> int:
    # O_NONBLOCK: a FIFO or a device planted at the path must not hold the restore (criu
    # reopens the file with the flags each use had).
    flags |= os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    if root is None:
        return os.open(path, flags)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    how = struct.pack("QQQ", flags, 0, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    fd = libc.syscall(SYS_OPENAT2, root, os.fsencode(path), how, len(how))
    if fd < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error), path)
    return int(fd)


def main(argv: list[str]) -> int:
    channel = socket.socket(fileno=int(argv[1]))
    root = os.open(argv[2], os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if len(argv) > 2 else None
    for request in json.load(sys.stdin):
        try:
            fd = open_one(request["path"], int(request["flags"]), root)
        except OSError as error:
            answer = {"ok": False, "error": error.strerror or str(error)}
            channel.send(json.dumps(answer).encode())
            continue
        socket.send_fds(channel, [json.dumps({"ok": True}).encode()], [fd])
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
