"""Opens files as the user it runs as, and sends the descriptors back to the node agent.

Run by the agent as the caller (their uid, gid and groups; no capabilities) with
``python -I -S opener_program.py FD [ROOT]``, where FD is one end of a SOCK_SEQPACKET socket
pair. With ROOT (``/proc/PID/root`` of a process of the caller's container, for an agent
that serves pods), every path is resolved inside that root, its links and ``..`` included
(``openat2`` with ``RESOLVE_IN_ROOT``), as the container itself would resolve it.

Each message on FD asks for one file, ``{"path", "flags"}``; each is answered, in order,
with one message: ``{"ok": true}`` carrying the opened descriptor, or ``{"ok": false,
"errno": N, "error": "..."}``. It ends when the agent closes its end. Every file is opened
without waiting (``O_NONBLOCK``: a FIFO or a device there answers at once) and without
taking a terminal. The kernel checks every path component and the file itself against the
caller's own permissions, links included: whatever comes back is what the caller could
have opened themselves.

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
REQUEST_BYTES = 1 << 16
# What a file made here is (a kernel's log): the caller's alone.
CREATED_MODE = 0o600


def open_one(path: str, flags: int, root: int | None = None) -> int:
    # O_NONBLOCK: a FIFO or a device planted at the path must not hold the agent (criu
    # reopens each file with the flags each use had).
    flags |= os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    if flags & os.O_PATH:
        # A handle opens nothing (no FIFO can hold it); openat2 refuses (EINVAL) any flag
        # beside these, where open(2) ignores them.
        flags &= os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    mode = CREATED_MODE if flags & os.O_CREAT else 0
    if root is None:
        return os.open(path, flags, mode)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    how = struct.pack("QQQ", flags, mode, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    fd = libc.syscall(SYS_OPENAT2, root, os.fsencode(path), how, len(how))
    if fd < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error), path)
    return int(fd)


def main(argv: list[str]) -> int:
    channel = socket.socket(fileno=int(argv[1]))
    root = os.open(argv[2], os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if len(argv) > 2 else None
    while True:
        message = channel.recv(REQUEST_BYTES)
        if not message:
            return 0
        request = json.loads(message)
        try:
            fd = open_one(request["path"], int(request["flags"]), root)
        except OSError as error:
            answer = {"ok": False, "errno": error.errno, "error": error.strerror or str(error)}
            channel.send(json.dumps(answer).encode())
            continue
        socket.send_fds(channel, [json.dumps({"ok": True}).encode()], [fd])
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
