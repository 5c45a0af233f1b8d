"""Facts about a kernel's process tree, read from /proc: the one place that reads it
outside the kernel itself. psutil answers wherever it can; /proc is read directly only
for what psutil does not offer (namespaces, NSpid, capabilities, device fds, maps).

A snapshot-ready kernel runs as the child of a small init that is PID 1 of its own PID
namespace (see ``nsinit``). CRIU dumps that init with everything below it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from .errors import NotFound, NotReady
from .user_paths import OWN_OPENER, OpensUserPaths, UserPath


def status_fields(pid: int | str = "self", thread: int | None = None) -> dict[str, str]:
    """The fields of ``/proc/PID/status`` (of its thread ``thread``, when given) by name,
    each value as the kernel writes it, less the blanks around it: the one reader of that
    file. Raises OSError once the process is gone."""
    path = f"/proc/{pid}/status" if thread is None else f"/proc/{pid}/task/{thread}/status"
    with open(path, encoding="utf-8", errors="replace") as f:
        fields = (line.partition(":") for line in f)
        return {key: value.strip() for key, colon, value in fields if colon}


def _status_field(pid: int | str, key: str) -> list[str]:
    return status_fields(pid).get(key, "").split()


def ns_pids(pid: int) -> list[int]:
    """Process ``pid``'s pid in each PID namespace from ours down to its own (NSpid)."""
    return [int(p) for p in _status_field(pid, "NSpid")] or [pid]


def ns_pid(pid: int) -> int:
    """The pid of ``pid`` inside its innermost PID namespace (itself if it has no other)."""
    with contextlib.suppress(OSError, ValueError):
        return ns_pids(pid)[-1]
    return pid


def thread_group(tid: int) -> int | None:
    """The process (thread group) that thread ``tid`` belongs to, or None once it is gone."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(_status_field(tid, "Tgid")[0])
    return None


def thread_states(pid: int) -> dict[int, str]:
    """Each thread of ``pid`` by host tid, with its one-letter state ('t': stopped by a
    tracer, 'T': stopped by a signal, 'S'/'R'/'D': running or able to run)."""
    states: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, IndexError), \
                    open(f"/proc/{pid}/task/{name}/stat") as f:
                states[int(name)] = f.read().rsplit(")", 1)[1].split()[0]
    return states


def effective_capabilities(pid: int | str = "self") -> int:
    """The CapEff bit mask of a process (ours by default)."""
    caps = _status_field(pid, "CapEff")
    return int(caps[0], 16) if caps else 0


def pids_with_open(pids: list[int], path_prefix: str) -> list[int]:
    """The pids that hold a descriptor on a path starting with ``path_prefix``.

    psutil's ``open_files`` lists regular files only; device files (``/dev/nvidia*``) need
    the fd links.
    """
    holders = []
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(path_prefix):
                        holders.append(pid)
                        break
    return holders


def append_only_files(root: int) -> list[str]:
    """Regular files the tree has open write-only for appending (kernel logs), each read
    through its descriptor in /proc: no path of the kernel's user is looked up (psutil's
    ``open_files`` would stat each by its path)."""
    found: set[str] = set()
    for proc in tree(root):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{proc.pid}/fd"):
                with contextlib.suppress(OSError, ValueError):
                    if _appends_to_a_file(proc.pid, fd):
                        found.add(os.readlink(f"/proc/{proc.pid}/fd/{fd}"))
    return sorted(found)


def _appends_to_a_file(pid: int, fd: str) -> bool:
    with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii") as info:
        flags = next((int(line.split()[1], 8) for line in info if line.startswith("flags:")), 0)
    if flags & os.O_ACCMODE != os.O_WRONLY or not flags & os.O_APPEND:
        return False
    return stat.S_ISREG(os.stat(f"/proc/{pid}/fd/{fd}").st_mode)


def stderr_file(pid: int) -> str | None:
    """The regular file a process writes its stderr to (a kernel tree's log), else None."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/2")
        is_file = stat.S_ISREG(os.stat(f"/proc/{pid}/fd/2").st_mode)
    except OSError:
        return None
    if not is_file or not target.startswith("/") or target.endswith(" (deleted)"):
        return None
    return target


def executable(pid: int) -> str | None:
    """The path of the program a process runs, as /proc names it (with " (deleted)" when
    it was removed), or None when it cannot be read. Only the link is read: psutil's
    ``exe`` stats a deleted program's path, a path of the kernel's user."""
    try:
        return os.readlink(f"/proc/{pid}/exe") or None
    except OSError:
        return None


def environment_variable(pid: int, name: str) -> str | None:
    """One variable of a process's environment as it started, or None when unset/unreadable."""
    try:
        return psutil.Process(pid).environ().get(name)
    except psutil.Error:
        return None


def pid_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")


def namespace_init(pid: int) -> int | None:
    """Host pid of the init of ``pid``'s PID namespace, or None when it shares ours."""
    if pid_namespace(pid) == pid_namespace(os.getpid()):
        return None
    ns = pid_namespace(pid)
    current = pid
    while True:
        nspids = _status_field(current, "NSpid")
        if nspids and nspids[-1] == "1":
            return current
        parent = psutil.Process(current).ppid()
        if parent <= 0 or pid_namespace(parent) != ns:
            return current
        current = parent


# A tree's root, by pid, or as a ``psutil.Process`` taken while it ran: the latter names that
# process alone (psutil checks its start time), never one that got the pid after it ended:
# a process that is not our child leaves no zombie to keep its pid from others.
Root = int | psutil.Process


def held(pid: int) -> psutil.Process | None:
    """``pid``'s process as it is now, to signal and watch later; None if it ended."""
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def tree(root: Root) -> list[psutil.Process]:
    proc = psutil.Process(root) if isinstance(root, int) else root
    return [proc, *proc.children(recursive=True)]


def tree_alive(root: Root) -> bool:
    try:
        proc = psutil.Process(root) if isinstance(root, int) else root
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tree_rss(root: int) -> int:
    total = 0
    for proc in tree(root):
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total


def tree_stopped(root: int) -> bool:
    """Whether every process of the tree is stopped by a signal (not by a tracer)."""
    try:
        return all(p.status() == psutil.STATUS_STOPPED for p in tree(root))
    except psutil.Error:
        return False


def continue_tree(root: int) -> None:
    """Wake every task of the tree; a dump that died mid-way may leave tasks stopped."""
    with contextlib.suppress(psutil.Error):
        for proc in tree(root):
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGCONT)


def kill_tree(root: Root) -> None:
    """SIGKILL the init of a namespace; the kernel dies with it."""
    with contextlib.suppress(psutil.Error):
        procs = tree(root)
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(procs, timeout=5)


# The states of a connection its process has closed, which the system alone ends.
_CLOSED_BY_ITS_PROCESS = frozenset({
    psutil.CONN_FIN_WAIT1, psutil.CONN_FIN_WAIT2, psutil.CONN_CLOSING, psutil.CONN_LAST_ACK,
    psutil.CONN_TIME_WAIT,
})


def ports_closing(connection_info: dict[str, Any]) -> bool:
    """Whether the kernel's ports are held only by connections their process has closed
    (TIME_WAIT, or on the way to it): no process has them, the system frees them within a
    minute (a criu restore killed midway leaves these)."""
    ports = set(kernel_ports(connection_info).values())
    states = {c.status for c in psutil.net_connections(kind="tcp")
              if c.laddr and c.laddr.port in ports}
    return bool(states) and states <= _CLOSED_BY_ITS_PROCESS


def kill_orphans(children: dict[int, float], connection_info: dict[str, Any],
                 since: float) -> list[int]:
    """Kill what a criu restore that died midway left: the trees of its children (pid →
    start time, as ``CriuRun.children`` saw them) still alive, and the orphaned tree of
    another PID namespace, started since ``since`` (criu's start, wall clock), that holds
    the restored kernel's ports (a child criu forked between two looks). Returns the roots
    killed."""
    roots = []
    for pid, started in children.items():
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).create_time() == started:
                roots.append(pid)
    ports = set(kernel_ports(connection_info).values())
    with contextlib.suppress(psutil.Error):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.pid and conn.status == psutil.CONN_LISTEN and conn.laddr \
                    and conn.laddr.port in ports:
                with contextlib.suppress(OSError, psutil.Error):
                    init = namespace_init(conn.pid)
                    if init is not None and psutil.Process(init).ppid() == 1 \
                            and psutil.Process(init).create_time() >= since:
                        roots.append(init)
    for root in dict.fromkeys(roots):
        kill_tree(root)
    return list(dict.fromkeys(roots))


def tree_maps_library(root: int, library: str) -> bool:
    """Whether any process of the tree has a library mapped, e.g. ``libcuda.so``.

    psutil's ``memory_maps`` reads smaps, which costs a walk of every page table; the
    plain maps file is enough to see a name.
    """
    try:
        procs = tree(root)
    except psutil.Error:  # a vanished tree maps nothing
        return False
    for proc in procs:
        with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/maps") as f:
            if any(library in line for line in f):
                return True
    return False


def _ppid(proc: psutil.Process) -> int:
    try:
        return int(proc.ppid())
    except psutil.Error:
        return -1


def kernel_of(root: int) -> psutil.Process | None:
    """The kernel process under a namespace init (its first child), or the root itself."""
    try:
        proc = psutil.Process(root)
        children = proc.children()
    except psutil.NoSuchProcess:
        return None
    return children[0] if children else proc


def _fd_kind(pid: int, fd: int) -> str:
    try:
        mode = os.stat(f"/proc/{pid}/fd/{fd}").st_mode
    except OSError:
        return "closed"
    if stat.S_ISFIFO(mode):
        return "pipe"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            return "closed"  # closed, or the process exited, since the stat
        return "null" if target == "/dev/null" else "tty"
    return "file"


def _descriptors_shared_within(procs: list[psutil.Process]) -> Callable[[int, int], bool]:
    """Whether a pipe or socket fd has its other end inside the tree.

    ipykernel itself puts a pipe on fds 1 and 2 to capture C-level output; both ends live
    in the kernel, so CRIU restores it. A pipe to the launching server would not survive.
    """
    seen: dict[str, int] = {}
    for proc in procs:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{proc.pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
                    seen[target] = seen.get(target, 0) + 1

    def internal(pid: int, fd: int) -> bool:
        try:
            return seen.get(os.readlink(f"/proc/{pid}/fd/{fd}"), 0) > 1
        except OSError:
            return False

    return internal


# A connection file is a few hundred bytes; more is not one.
MAX_CONNECTION_FILE_BYTES = 64 * 1024


def connection_file_of(pid: int) -> Path | None:
    """The ``-f`` argument of an ipykernel command line."""
    try:
        cmdline = psutil.Process(pid).cmdline()
    except psutil.Error:
        return None
    for i, arg in enumerate(cmdline):
        if arg in ("-f", "--f") and i + 1 < len(cmdline):
            return Path(cmdline[i + 1])
        if arg.startswith(("--f=", "--IPKernelApp.connection_file=")):
            return Path(arg.split("=", 1)[1])
    return None


def kernel_ports(connection_info: dict[str, Any]) -> dict[str, int]:
    """The TCP port of each of the kernel's channels that has one, by channel."""
    return {channel: int(connection_info[f"{channel}_port"])
            for channel in ("shell", "iopub", "stdin", "control", "hb")
            if connection_info.get(f"{channel}_port")}


def ports_in_use(connection_info: dict[str, Any]) -> list[str]:
    """Names of the kernel's channels whose TCP port cannot be bound now."""
    if connection_info.get("transport", "tcp") != "tcp":
        return []
    ip = connection_info.get("ip", "127.0.0.1")
    busy = []
    for channel, port in kernel_ports(connection_info).items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((ip, int(port)))
            except OSError:
                busy.append(f"{channel} port {port}")
    return busy


@dataclass
class KernelProcess:
    """A running kernel as the engine sees it."""

    root_pid: int
    kernel_pid: int
    connection_file: Path | None
    connection_info: dict[str, Any] | None
    problems: list[str] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return not self.problems


def inspect_kernel(pid: int, files: OpensUserPaths | None = OWN_OPENER) -> KernelProcess:
    """Find the tree to dump for ``pid`` and everything that would make the dump unsafe.
    Its connection file is read with ``files`` (the engine's ``FileAccess``: as the
    kernel's user, for the node agent), or not at all with None."""
    if not psutil.pid_exists(pid):
        raise NotFound("preflight", f"no process with pid {pid}")
    problems: list[str] = []
    try:
        init = namespace_init(pid)
        kernel = psutil.Process(pid)
    except (OSError, psutil.Error):
        # It exited meanwhile: a kernel killed while its status is asked for, say.
        raise NotFound("preflight", f"process {pid} has exited") from None
    if init is None:
        root = pid
        problems.append(
            "it shares the host's PID namespace, so its PIDs could clash at restore; "
            "start it with the 'Python 3 (snapshots)' kernel (python3-snapshot)"
        )
    else:
        root = init
    # One walk of the host's process table (psutil reads every /proc/N/stat for it).
    try:
        procs = tree(root)
    except psutil.NoSuchProcess:
        raise NotFound("preflight", f"process {pid} has exited") from None
    if init is not None and pid == init:
        # The kernel is the init's first child, as ``kernel_of`` says.
        children = sorted((p for p in procs[1:] if _ppid(p) == init), key=lambda p: p.pid)
        kernel = children[0] if children else procs[0]
    with contextlib.suppress(psutil.Error):
        if "JPY_PARENT_PID" in kernel.environ():
            problems.append(
                "it polls its parent process (JPY_PARENT_PID is set) and would exit after restore"
            )
    internal = _descriptors_shared_within(procs)
    for proc in procs:
        for fd, label in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
            kind = _fd_kind(proc.pid, fd)
            if kind == "tty" or (kind in ("pipe", "socket") and not internal(proc.pid, fd)):
                problems.append(
                    f"{label} of pid {proc.pid} is a {kind} to the outside, "
                    "which does not survive a restore"
                )
    connection_file = connection_file_of(kernel.pid)
    info = None
    if connection_file is not None and files is not None:
        info = read_connection_file(kernel.pid, connection_file, files)
    return KernelProcess(root, kernel.pid, connection_file, info, problems)


def read_connection_file(pid: int, path: Path, files: OpensUserPaths) -> dict[str, Any] | None:
    """The connection info in kernel ``pid``'s connection file ``path`` (as the kernel
    names it), opened by ``files``; None unless it is a regular file of JSON."""
    try:
        fd = files.open(str(path if path.is_absolute() else Path(f"/proc/{pid}/cwd", path)),
                        os.O_RDONLY, UserPath.CONNECTION_FILE)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        # Only a regular file is read: a FIFO or a device there, opened without waiting,
        # would otherwise hold the save (and its thread) until someone wrote to it.
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with contextlib.suppress(OSError, ValueError):
            found = json.loads(file.read(MAX_CONNECTION_FILE_BYTES))
            return found if isinstance(found, dict) else None
    return None


def require_ready(kernel: KernelProcess) -> None:
    if kernel.problems:
        raise NotReady(
            "preflight",
            f"kernel pid {kernel.kernel_pid} is not snapshot-ready: " + "; ".join(kernel.problems),
        )


def criu_working_on(directory: Path) -> bool:
    """Whether a criu process runs with ``directory`` as its images or work directory.

    criu runs in its own session, so it outlives a saver killed under it; what it writes
    must not be cleaned away meanwhile.
    """
    wanted = str(directory)
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if cmdline and "criu" in Path(cmdline[0]).name and wanted in cmdline:
            return True
    return False


def start_time(pid: int) -> float | None:
    """When ``pid`` started (seconds since the epoch): with the pid, it names one process."""
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def is_snapshot_ready_kernel(kernel: KernelProcess) -> bool:
    """Whether the tree is one that our provisioner launched (or a restore brought back):
    an ipykernel with a connection file, under ``nsinit`` in its own PID namespace."""
    if kernel.root_pid == kernel.kernel_pid or kernel.connection_file is None:
        return False
    try:
        cmdline = psutil.Process(kernel.root_pid).cmdline()
    except psutil.Error:
        return False
    return any(Path(arg).name == "nsinit.py" for arg in cmdline)


def mapped_files(root: int) -> list[str]:
    """Regular files the tree has mapped privately: the interpreter, its shared libraries,
    locale data. Shared mappings are data (``np.memmap``), which ``open_files`` looks after.

    Deleted files, device files and anonymous memory (memfd, SysV) are left out: the image
    holds them or they are no files at all.
    """
    found: set[str] = set()
    try:
        procs = tree(root)
    except psutil.Error:
        return []
    for proc in procs:
        with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                # address perms offset dev inode path; inode 0 is no file.
                if len(parts) < 6 or parts[1][3] != "p" or parts[4] == "0":
                    continue
                path = parts[5].rstrip("\n")
                if path.startswith("/") and not path.endswith(" (deleted)") and not path.startswith(
                    ("/dev/", "/proc/", "/sys/", "/memfd:", "/SYSV")
                ):
                    found.add(path)
    return sorted(found)


def same_process(pid: int, started: float | None) -> bool:
    """Whether ``pid`` is still the process that started at ``started`` (not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        return alive and (started is None or abs(proc.create_time() - started) < 0.5)
    except psutil.Error:
        return False
