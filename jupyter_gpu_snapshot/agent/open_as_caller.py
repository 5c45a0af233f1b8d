"""Opens files as the user it runs as, and sends the descriptors back to the node agent.

Run by the agent as the caller (their uid, gid and groups; no capabilities) with
``python -I -S open_as_caller.py FD``, where FD is one end of a SOCK_SEQPACKET socket pair.
It reads a JSON list of ``{"path", "flags", "pos"}`` from stdin and answers each, in order,
with one message: ``{"ok": true, "mode": ..., "size": ...}`` carrying the opened descriptor,
or ``{"ok": false, "error": "..."}``. The kernel checks every path component and the file
itself against the caller's own permissions, links included: whatever comes back is what
the caller could have opened themselves.

Only the standard library is imported: the agent runs this as another user.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys


def open_one(path: str, flags: int, pos: int | None) -> int:
    # O_NONBLOCK: a FIFO or a device planted at the path must not hold the restore.
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        if not flags & os.O_NONBLOCK and not flags & os.O_PATH:
            os.set_blocking(fd, True)
        if pos is not None and stat.S_ISREG(os.fstat(fd).st_mode):
            os.lseek(fd, pos, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def main(argv: list[str]) -> int:
    channel = socket.socket(fileno=int(argv[1]))
    for request in json.load(sys.stdin):
        try:
            fd = open_one(request["path"], int(request["flags"]), request.get("pos"))
        except OSError as error:
            answer = {"ok": False, "error": error.strerror or str(error)}
            channel.send(json.dumps(answer).encode())
            continue
        info = os.fstat(fd)
        answer = {"ok": True, "mode": info.st_mode, "size": info.st_size}
        socket.send_fds(channel, [json.dumps(answer).encode()], [fd])
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
