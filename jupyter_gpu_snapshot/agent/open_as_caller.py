"""Opens files as the user it runs as, and sends the descriptors back to the node agent.

Run by the agent as the caller (their uid, gid and groups; no capabilities) with
``python -I -S open_as_caller.py FD``, where FD is one end of a SOCK_SEQPACKET socket pair.
It reads a JSON list of ``{"path", "flags"}`` from stdin and answers each, in order,
with one message: ``{"ok": true}`` carrying the opened descriptor,
or ``{"ok": false, "error": "..."}``. The kernel checks every path component and the file
itself against the caller's own permissions, links included: whatever comes back is what
the caller could have opened themselves.

Only the standard library is imported: the agent runs this as another user.
"""

from __future__ import annotations

import json
import os
import socket
import sys


def open_one(path: str, flags: int) -> int:
    # O_NONBLOCK: a FIFO or a device planted at the path must not hold the restore (criu
    # reopens the file with the flags each use had).
    return os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)


def main(argv: list[str]) -> int:
    channel = socket.socket(fileno=int(argv[1]))
    for request in json.load(sys.stdin):
        try:
            fd = open_one(request["path"], int(request["flags"]))
        except OSError as error:
            answer = {"ok": False, "error": error.strerror or str(error)}
            channel.send(json.dumps(answer).encode())
            continue
        socket.send_fds(channel, [json.dumps({"ok": True}).encode()], [fd])
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
