"""The process that holds a kernel tree's threads while its CUDA state sleeps in host memory.

The driver's protocol wants no thread of a process to run while its CUDA state is
checkpointed (JAX's threads crash in libcuda otherwise), and the driver's own restore thread
to run during the checkpoint and the restore. Stopping the whole process (SIGSTOP, the
cgroup freezer) would stop that thread too, so the holder does what CRIU does: it seizes
every other thread of every process of the tree with ptrace and keeps each in a ptrace stop.

It runs as its own process, in its own session, so that the kernel sleeps on while the
Jupyter server restarts or the node agent's request ends. Every thread is seized with
``PTRACE_O_EXITKILL``: should the holder die, for any reason and at any moment, the kernel
gets SIGKILL from the kernel of the OS itself. It can never be left running on checkpointed
CUDA; it can only end, as a kernel that crashed.

It tells its starter ``{"held": N}`` (or ``{"error": ...}``) on its standard output, then
answers one JSON line per connection on its socket: ``status``; ``release``, which lets
every thread run again and ends the holder; or ``hand_over``, which stops every process of
the tree (SIGSTOP) before letting go of its threads, so that they go from the holder's stop
straight into a job-control stop and no code of theirs runs: criu can then seize the tree
and write it to disk (the second tier of hibernation), its CUDA state untouched. Only its
own user and root may ask.

With ``--continue`` it takes over a tree that is stopped that way (a dump that failed, a
tree criu restored stopped): it seizes the stopped threads, then continues the processes,
so that only the driver's restore threads run again.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

from ..core import procfs

PTRACE_CONT = 7
PTRACE_DETACH = 17
PTRACE_GETEVENTMSG = 0x4201
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_O_TRACEFORK = 0x02
PTRACE_O_TRACEVFORK = 0x04
PTRACE_O_TRACECLONE = 0x08
PTRACE_O_EXITKILL = 0x100000
PTRACE_EVENT_FORK, PTRACE_EVENT_VFORK, PTRACE_EVENT_CLONE = 1, 2, 3
PTRACE_EVENT_STOP = 128
WALL = 0x40000000
SEIZE_OPTIONS = PTRACE_O_EXITKILL | PTRACE_O_TRACECLONE | PTRACE_O_TRACEFORK | PTRACE_O_TRACEVFORK
# Threads that appear while the holder seizes (a clone in flight) are found by listing the
# tree again; a tree still growing after this many rounds is refused.
SEIZE_ROUNDS = 20
IDLE_POLL_SECONDS = 1.0
# What a status answer adds to the starter's note (``serve``).
STATUS_FIELDS = ("root", "held", "since", "holder_pid")
# How long the threads let go by a hand-over may take to reach their job-control stop.
HAND_OVER_SECONDS = 10.0
MAX_REQUEST_BYTES = 4096

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


class HoldError(Exception):
    """The tree could not be held; the message names the thread and the cause."""


def _ptrace(request: int, tid: int, addr: int = 0, data: int = 0) -> int:
    result = _libc.ptrace(request, tid, ctypes.c_void_p(addr), ctypes.c_void_p(data))
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(result)


def _event_message(tid: int) -> int:
    value = ctypes.c_ulong(0)
    _ptrace(PTRACE_GETEVENTMSG, tid, 0, ctypes.addressof(value))
    return int(value.value)


def tree_threads(root: int) -> dict[int, list[int]]:
    """Every thread (host tid) of every process of the tree, by process."""
    found: dict[int, list[int]] = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        top = psutil.Process(root)
        for proc in [top, *top.children(recursive=True)]:
            with contextlib.suppress(OSError):
                found[proc.pid] = sorted(int(t) for t in os.listdir(f"/proc/{proc.pid}/task"))
    return found


class ThreadHolder:
    """Seizes and stops the threads of a tree, all but ``keep_running``; one per process."""

    def __init__(self, root: int, keep_running: Iterable[int], timeout: float) -> None:
        self.root = root
        self.timeout = timeout
        self.keep_running = frozenset(keep_running)
        # Held thread -> the signal it was stopped with, given back when it runs again.
        self.held: dict[int, int] = {}
        self._gone: set[int] = set()
        # Seized threads whose stop did not come in time: a detach waits for it.
        self._not_stopped: set[int] = set()

    def hold(self) -> int:
        self._deadline = time.monotonic() + self.timeout
        for _ in range(SEIZE_ROUNDS):
            fresh = [tid for tids in tree_threads(self.root).values() for tid in tids
                     if tid not in self.held and tid not in self.keep_running
                     and tid not in self._gone]
            if not fresh:
                return len(self.held)
            for tid in fresh:
                self._seize(tid)
        raise HoldError(f"the kernel tree {self.root} kept starting threads while they "
                        "were being stopped")

    def _seize(self, tid: int) -> None:
        try:
            _ptrace(PTRACE_SEIZE, tid, 0, SEIZE_OPTIONS)
            _ptrace(PTRACE_INTERRUPT, tid)
        except OSError as exc:
            if exc.errno == errno.ESRCH:  # it ended meanwhile
                self._gone.add(tid)
                return
            raise HoldError(f"cannot stop thread {tid} of the kernel tree {self.root}: "
                            f"{exc.strerror}") from exc
        self._wait_stopped(tid)

    def _wait_stopped(self, tid: int) -> None:
        """Wait for the thread's first ptrace stop; whatever the stop, it stays in it."""
        while True:
            try:
                found, status = os.waitpid(tid, WALL | os.WNOHANG)
            except ChildProcessError:
                self._gone.add(tid)
                return
            if found == 0:
                # A thread in an uninterruptible wait (a stuck file system) stops only
                # when it comes back; the whole hold is given up rather than wait on.
                if time.monotonic() > self._deadline:
                    self._not_stopped.add(tid)
                    raise HoldError(f"thread {tid} of the kernel tree {self.root} did not "
                                    f"stop within {self.timeout:g} s")
                time.sleep(0.0005)
                continue
            if not os.WIFSTOPPED(status):
                self._gone.add(tid)  # it exited, or was killed
                return
            event, sig = status >> 16, os.WSTOPSIG(status)
            # A signal that arrived first is kept for the moment the thread runs again.
            self.held[tid] = sig if event == 0 and sig != signal.SIGTRAP else 0
            if event in (PTRACE_EVENT_CLONE, PTRACE_EVENT_FORK, PTRACE_EVENT_VFORK):
                # A thread or child born under the seize is traced already: it stops too.
                self._wait_stopped(_event_message(tid))
            return

    def reap(self) -> None:
        """Collect what happened to held threads meanwhile: only deaths (SIGKILL)."""
        while self.held:
            try:
                tid, status = os.waitpid(-1, WALL | os.WNOHANG)
            except ChildProcessError:
                self.held.clear()
                return
            if tid == 0:
                return
            if not os.WIFSTOPPED(status):
                self.held.pop(tid, None)

    def alive(self) -> bool:
        return bool(self.held) and psutil.pid_exists(self.root)

    def release(self) -> int:
        released = 0
        for tid in self._not_stopped:
            # Only a stopped tracee can be detached; leaving it traced would kill it with
            # the holder (EXITKILL), so its stop is waited for however long it takes.
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(tid, WALL)
                if os.WIFSTOPPED(status):
                    self.held[tid] = 0
        self._not_stopped.clear()
        for tid, sig in list(self.held.items()):
            with contextlib.suppress(OSError):
                _ptrace(PTRACE_DETACH, tid, 0, sig)
                released += 1
        self.held.clear()
        return released

    def hand_over(self) -> int:
        """Stop every process of the tree, then let go of its threads: each goes from its
        ptrace stop into the job-control stop without running. Returns the threads let go."""
        processes = list(tree_threads(self.root))
        signal_processes(processes, signal.SIGSTOP)
        released = self.release()
        deadline = time.monotonic() + HAND_OVER_SECONDS
        while not all_stopped(processes):
            if time.monotonic() > deadline:
                raise HoldError(f"the kernel tree {self.root} did not stop within "
                                f"{HAND_OVER_SECONDS:g} s of being let go")
            time.sleep(0.005)
        return released


def signal_processes(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def all_stopped(pids: Iterable[int]) -> bool:
    """Whether every thread of these processes sits in a job-control stop (state T); one
    that ended runs no more either."""
    return all(state in ("T", "Z", "X")
               for pid in pids for state in procfs.thread_states(pid).values())


def _peer_allowed(conn: socket.socket) -> bool:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    return uid in (0, os.getuid())


def _answer(conn: socket.socket, data: dict[str, object]) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(data).encode() + b"\n")


def _read_request(conn: socket.socket) -> dict[str, object]:
    conn.settimeout(5.0)
    data = b""
    while b"\n" not in data and len(data) < MAX_REQUEST_BYTES:
        chunk = conn.recv(MAX_REQUEST_BYTES)
        if not chunk:
            break
        data += chunk
    request = json.loads(data.split(b"\n", 1)[0] or b"{}")
    return request if isinstance(request, dict) else {}


def serve(holder: ThreadHolder, listener: socket.socket, since: float,
          note: dict[str, object]) -> None:
    """Answer requests until asked to release, or until the tree has ended."""
    while True:
        ready, _, _ = select.select([listener], [], [], IDLE_POLL_SECONDS)
        holder.reap()
        if not holder.alive():
            return
        if not ready:
            continue
        conn, _ = listener.accept()
        with conn:
            if not _peer_allowed(conn):
                _answer(conn, {"error": "only the kernel's owner and root may ask"})
                continue
            try:
                request = _read_request(conn)
            except (OSError, ValueError) as exc:
                _answer(conn, {"error": f"unreadable request: {exc}"})
                continue
            op = request.get("op")
            if op == "status":
                # Its fields beside the note's are STATUS_FIELDS.
                _answer(conn, {**note, "root": holder.root, "held": len(holder.held),
                               "since": since, "holder_pid": os.getpid()})
            elif op == "release":
                _answer(conn, {"released": holder.release()})
                return
            elif op == "hand_over":
                try:
                    _answer(conn, {"handed_over": holder.hand_over()})
                except HoldError as exc:
                    _answer(conn, {"error": str(exc)})
                return
            else:
                _answer(conn, {"error": f"unknown op {op!r}: status, release or hand_over"})


def _listen(path: Path) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        listener.bind(str(path))
    finally:
        os.umask(old)
    listener.listen(8)
    return listener


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jupyter_gpu_snapshot.gpu.holder")
    parser.add_argument("--root", type=int, required=True)
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--keep-running", type=int, action="append", default=[])
    parser.add_argument("--timeout", type=float, default=30.0)
    # The tree is stopped (SIGSTOP): continue it once its threads are held.
    parser.add_argument("--continue", dest="continue_tree", action="store_true")
    # What the starter wants a later server to read back (the GPU memory it freed).
    parser.add_argument("--note", type=json.loads, default={})
    args = parser.parse_args(argv)
    # Only SIGKILL ends the holder: a stray SIGTERM or a closed terminal must not take
    # the sleeping kernel with it (its death kills the kernel; see the module docstring).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    # The starter waits for this first process only: the holder lives on as no one's child
    # but init's, so that the starter neither reaps it nor has to keep it.
    if os.fork() > 0:
        os._exit(0)
    holder = ThreadHolder(args.root, args.keep_running, args.timeout)
    try:
        listener = _listen(args.socket)
        held = holder.hold()
        if args.continue_tree:
            signal_processes(tree_threads(args.root), signal.SIGCONT)
    except (HoldError, OSError) as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        holder.release()
        return 1
    print(json.dumps({"held": held, "holder_pid": os.getpid()}), flush=True)
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    try:
        serve(holder, listener, time.time(), dict(args.note))
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            args.socket.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
