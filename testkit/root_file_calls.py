"""Every path-based system call that a process tree makes with root's file rights, seen from
the kernel: for the node agent's class-level test of its privilege rule.

A process "has root's file rights" while its fsuid is 0 or it holds ``CAP_DAC_OVERRIDE``,
``CAP_DAC_READ_SEARCH`` or ``CAP_FOWNER`` in its effective set: then the kernel does not
check its path lookups against the user's permissions. Each such call (``open``, ``stat``,
``execve``, ``chdir``, ``connect`` to a Unix socket's path...) is recorded with the path
as passed and, for a relative path, the owner and mode of the directory it starts from.

Why bpftrace and not ``strace -f``: a tracer that uses ptrace takes every process of the
tree as its tracee, and criu must ptrace its own children (its feature probe at start, the
restored tasks at the end of a restore); a second tracer fails both (criu: "kerndat_breakpoints
has failed"). The kernel's syscall tracepoints watch the tree without becoming its tracer,
and read each task's credentials from the kernel itself rather than from a model of them.

``RootFileCalls.start(argv)`` starts a process held at a gate (a shell waiting on its
stdin), attaches bpftrace to it and every task it will create (threads and children,
through ``sched_process_fork``), then lets it ``exec`` ``argv``. Needs root, bpftrace
(Debian's, ``scripts/install-system-deps.sh``) and tracefs, which is mounted in bpftrace's
own mount namespace only.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import stat
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

AT_FDCWD = -100
# Effective capabilities that bypass the kernel's checks of file permissions and owners.
ROOT_FILE_CAPABILITIES = (1 << 1) | (1 << 2) | (1 << 3)  # DAC_OVERRIDE, DAC_READ_SEARCH, FOWNER
# Seconds bpftrace may take to compile and attach its probes (a few on a busy 2-core machine).
ATTACH_SECONDS = 120.0
NO_BASE = (1 << 64) - 1
PROC_BASE = NO_BASE - 1
PROC_SUPER_MAGIC = 0x9FA0

# x86_64 system calls that take a path, by number: their name, and for each path argument
# the index of its directory descriptor (None: relative to the cwd) and of the string.
_PATHS: dict[int, tuple[str, tuple[tuple[int | None, int], ...]]] = {
    2: ("open", ((None, 0),)), 4: ("stat", ((None, 0),)), 6: ("lstat", ((None, 0),)),
    21: ("access", ((None, 0),)), 59: ("execve", ((None, 0),)),
    76: ("truncate", ((None, 0),)), 80: ("chdir", ((None, 0),)),
    82: ("rename", ((None, 0), (None, 1))), 83: ("mkdir", ((None, 0),)),
    84: ("rmdir", ((None, 0),)), 85: ("creat", ((None, 0),)),
    86: ("link", ((None, 0), (None, 1))), 87: ("unlink", ((None, 0),)),
    88: ("symlink", ((None, 1),)), 89: ("readlink", ((None, 0),)),
    90: ("chmod", ((None, 0),)), 92: ("chown", ((None, 0),)), 94: ("lchown", ((None, 0),)),
    132: ("utime", ((None, 0),)), 133: ("mknod", ((None, 0),)), 137: ("statfs", ((None, 0),)),
    155: ("pivot_root", ((None, 0), (None, 1))), 161: ("chroot", ((None, 0),)),
    165: ("mount", ((None, 0), (None, 1))), 166: ("umount2", ((None, 0),)),
    188: ("setxattr", ((None, 0),)), 189: ("lsetxattr", ((None, 0),)),
    191: ("getxattr", ((None, 0),)), 192: ("lgetxattr", ((None, 0),)),
    194: ("listxattr", ((None, 0),)), 195: ("llistxattr", ((None, 0),)),
    197: ("removexattr", ((None, 0),)), 198: ("lremovexattr", ((None, 0),)),
    235: ("utimes", ((None, 0),)), 254: ("inotify_add_watch", ((None, 1),)),
    257: ("openat", ((0, 1),)), 258: ("mkdirat", ((0, 1),)), 259: ("mknodat", ((0, 1),)),
    260: ("fchownat", ((0, 1),)), 261: ("futimesat", ((0, 1),)),
    262: ("newfstatat", ((0, 1),)), 263: ("unlinkat", ((0, 1),)),
    264: ("renameat", ((0, 1), (2, 3))), 265: ("linkat", ((0, 1), (2, 3))),
    266: ("symlinkat", ((1, 2),)), 267: ("readlinkat", ((0, 1),)),
    268: ("fchmodat", ((0, 1),)), 269: ("faccessat", ((0, 1),)),
    280: ("utimensat", ((0, 1),)), 303: ("name_to_handle_at", ((0, 1),)),
    316: ("renameat2", ((0, 1), (2, 3))), 322: ("execveat", ((0, 1),)),
    332: ("statx", ((0, 1),)), 428: ("open_tree", ((0, 1),)),
    429: ("move_mount", ((0, 1), (2, 3))), 433: ("fspick", ((0, 1),)),
    437: ("openat2", ((0, 1),)), 439: ("faccessat2", ((0, 1),)), 452: ("fchmodat2", ((0, 1),)),
}
# connect and bind: a Unix socket's path is a path too.
_SOCKETS = {42: "connect", 49: "bind"}
_EXECS = (59, 322)


def _base(slot: int, dfd_arg: int | None) -> str:
    """bpftrace: the owner, group and mode of the directory that a relative path of
    argument ``dfd_arg`` starts from (the cwd, or the directory descriptor), packed; or
    ``PROC_BASE`` for a directory of /proc (a process's own, which no user changes)."""
    cwd = "curtask->fs->pwd.dentry->d_inode"
    # uid, the low 16 bits of the gid (compared as such: a match too many, never one
    # too few), and the mode.
    pack = ("(((uint64){i}->i_uid.val) << 32) | (((uint64){i}->i_gid.val & 0xffff) << 16)"
            " | {i}->i_mode")
    store = ("if ({i}->i_sb->s_magic == " + str(PROC_SUPER_MAGIC) + ") {{ @b{slot}[tid] = "
             + str(PROC_BASE) + "; }} else {{ @b{slot}[tid] = " + pack + "; }}")
    if dfd_arg is None:
        return store.format(i=cwd, slot=slot)
    return (
        f"$d = (int32)args->args[{dfd_arg}]; "
        f"if ($d == {AT_FDCWD}) {{ {store.format(i=cwd, slot=slot)} }} "
        f"else {{ if ($d >= 0 && $d < 1048576 && $d < (int32)curtask->files->fdt->max_fds) {{ "
        f"$f = *(curtask->files->fdt->fd + $d); "
        f"if ($f != 0) {{ {store.format(i='$f->f_inode', slot=slot)} }} }} }}"
    )


def bpftrace_program() -> str:
    """The program: ``$1`` is the pid to watch, with every task it creates."""
    groups: dict[tuple[tuple[int | None, int], ...], list[int]] = {}
    for number, (_name, slots) in _PATHS.items():
        groups.setdefault(slots, []).append(number)
    branches = []
    for slots, numbers in groups.items():
        test = " || ".join(f"$id == {n}" for n in numbers)
        body = ["@kind[tid] = 1;"]
        for slot, (dfd_arg, path_arg) in enumerate(slots, 1):
            body.append(f"@p{slot}[tid] = args->args[{path_arg}];")
            body.append(_base(slot, dfd_arg))
        branches.append(f"if ({test}) {{ {' '.join(body)} }}")
    # The open flags: O_PATH opens nothing (a FIFO there cannot hold it).
    branches.insert(0, "if ($id == 2) { @fl[tid] = args->args[1]; } "
                       "if ($id == 257) { @fl[tid] = args->args[2]; } "
                       "if ($id == 437) { @how[tid] = args->args[2]; }")
    sockets = " || ".join(f"$id == {n}" for n in _SOCKETS)
    branches.append(f"if ({sockets}) {{ @kind[tid] = 2; @p1[tid] = args->args[1]; }}")
    rights = (f"(curtask->cred->fsuid.val == 0 || "
              f"(curtask->cred->cap_effective.val & {ROOT_FILE_CAPABILITIES}) != 0)")
    execs = " || ".join(f"@id[tid] == {n}" for n in _EXECS)
    # fsuid and the open flags share a value: the BPF stack holds little.
    head = "C\\t%d\\t%d\\t%s\\t%d\\t%d\\t%llu\\t%llu\\t%llu\\t{slot}\\t%llu\\t"
    values = ("tid, pid, comm, @id[tid], {ret}, (@fsuid[tid] << 32) | (@fl[tid] & 0xffffffff), "
              "@caps[tid], @root[tid], @b{slot}[tid]")

    def record(ret: str, slot: int, tail: str, *more: str) -> str:
        return (f'printf("{head.format(slot=slot)}{tail}\\n", '
                f'{", ".join([values.format(ret=ret, slot=slot), *more])});')

    clear = " ".join(f"delete(@{m}[tid]);" for m in
                     ("kind", "id", "p1", "p2", "b1", "b2", "fsuid", "caps", "root", "fl", "how"))
    return f"""
BEGIN {{ @watch[$1] = 1; printf("READY\\n"); }}
tracepoint:sched:sched_process_fork /@watch[args->parent_pid]/ {{ @watch[args->child_pid] = 1; }}
tracepoint:sched:sched_process_exit /@watch[tid]/ {{ delete(@watch[tid]); }}
tracepoint:raw_syscalls:sys_enter /@watch[tid] && {rights}/ {{
    $id = args->id;
    @b1[tid] = {NO_BASE}; @b2[tid] = {NO_BASE}; @p2[tid] = 0;
    {branches[0]}
    {' else '.join(branches[1:])}
    if (@kind[tid]) {{
        @id[tid] = $id; @fsuid[tid] = curtask->cred->fsuid.val;
        @caps[tid] = curtask->cred->cap_effective.val;
        @root[tid] = curtask->fs->root.dentry->d_inode->i_ino;
    }} else {{ {clear} }}
}}
tracepoint:sched:sched_process_exec /@kind[tid] && ({execs})/ {{
    {record("0", 1, "%s", "str(args->filename)")}
    {clear}
}}
tracepoint:raw_syscalls:sys_exit /@kind[tid] == 2/ {{
    {record("args->ret", 1, "%d:%s", "*(uint16 *)uptr(@p1[tid])", "str(uptr(@p1[tid] + 2))")}
    {clear}
}}
tracepoint:raw_syscalls:sys_exit /@how[tid]/ {{ @fl[tid] = *(uint64 *)uptr(@how[tid]); }}
tracepoint:raw_syscalls:sys_exit /@kind[tid] == 1 && @p2[tid]/ {{
    {record("args->ret", 2, "%s", "str(uptr(@p2[tid]))")}
}}
tracepoint:raw_syscalls:sys_exit /@kind[tid] == 1/ {{
    {record("args->ret", 1, "%s", "str(uptr(@p1[tid]))")}
    {clear}
}}
"""


@dataclass(frozen=True)
class FileCall:
    """One path of a path-based call made with root's file rights, and for a relative path
    the (uid, gid, mode) of the directory it starts from (``base``)."""

    tid: int
    pid: int
    comm: str
    syscall: str
    result: int
    fsuid: int
    capabilities: int
    root_inode: int
    path: str
    base: tuple[int, int, int] | None
    in_proc: bool = False
    flags: int = 0  # of an open

    def __str__(self) -> str:
        rights = f"fsuid {self.fsuid}, caps {self.capabilities:#x}"
        return (f"{self.comm}[{self.pid}/{self.tid}] {self.syscall}({self.path!r}) = "
                f"{self.result} ({rights})")


def _unpack(value: int) -> tuple[int, int, int] | None:
    if value in (NO_BASE, PROC_BASE):
        return None
    return value >> 32, (value >> 16) & 0xFFFF, value & 0xFFFF


def parse(lines: Iterable[str]) -> list[FileCall]:
    """The calls of bpftrace's output (one line per path of a call)."""
    calls = []
    for line in lines:
        fields = line.rstrip("\n").split("\t", 11)
        if fields[0] != "C" or len(fields) != 12:
            continue
        number = int(fields[4])
        path = fields[11]
        fsuid, flags = int(fields[6]) >> 32, int(fields[6]) & 0xFFFFFFFF
        if number in _SOCKETS:
            family, _, path = path.partition(":")
            if family != "1" or not path:  # not AF_UNIX, or an abstract name
                continue
            name = _SOCKETS[number]
        else:
            name = _PATHS[number][0] if number in _PATHS else str(number)
        calls.append(FileCall(int(fields[1]), int(fields[2]), fields[3], name, int(fields[5]),
                              fsuid, int(fields[7]), int(fields[8]), path,
                              _unpack(int(fields[10])), int(fields[10]) == PROC_BASE, flags))
    return calls


class RootFileCalls:
    """bpftrace watching one process tree (see the module's docstring)."""

    def __init__(self, directory: Path) -> None:
        self.output = directory / "root-file-calls.txt"
        self._tracer: subprocess.Popen[bytes] | None = None

    def start(self, argv: Sequence[str], **popen: object) -> subprocess.Popen[bytes]:
        """``argv`` started as ``subprocess.Popen(argv, **popen)`` would, watched from its
        first instruction on; its stdin is /dev/null (``popen`` may say so, or nothing)."""
        stdin = popen.pop("stdin", subprocess.DEVNULL)
        assert stdin == subprocess.DEVNULL, "the gate holds stdin: the program gets /dev/null"
        gate_in, gate_out = os.pipe()
        # The gate waits on its stdin, then becomes ``argv``.
        started: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            ["/bin/sh", "-c", 'read _; exec "$@" </dev/null', "gate", *argv],
            stdin=gate_in, **popen)
        os.close(gate_in)
        try:
            self._attach(started.pid)
            os.write(gate_out, b"go\n")
        except BaseException:
            started.kill()
            started.wait()
            self.stop(check=False)
            raise
        finally:
            os.close(gate_out)
        return started

    def _attach(self, pid: int) -> None:
        bpftrace = shutil.which("bpftrace")
        assert bpftrace, "bpftrace is missing: scripts/install-system-deps.sh installs it"
        script = self.output.with_suffix(".bt")
        script.write_text(bpftrace_program())
        env = {**os.environ, "BPFTRACE_STRLEN": "200", "BPFTRACE_MAP_KEYS_MAX": "65536",
               "BPFTRACE_PERF_RB_PAGES": "1024"}
        with open(self.output, "wb") as out:
            self._tracer = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
                 "mount -t tracefs none /sys/kernel/tracing && exec \"$0\" \"$@\"",
                 bpftrace, str(script), str(pid)],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + ATTACH_SECONDS
        while "READY" not in self._text():
            if self._tracer.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"bpftrace did not attach:\n{self._text()[-3000:]}")
            time.sleep(0.1)

    def _text(self) -> str:
        try:
            return self.output.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, check: bool = True) -> list[FileCall]:
        """Stop watching; every call recorded. Fails if the kernel lost any (``check``)."""
        if self._tracer is not None and self._tracer.poll() is None:
            self._tracer.send_signal(2)  # SIGINT: bpftrace prints what it holds and ends
            try:
                self._tracer.wait(60)
            except subprocess.TimeoutExpired:
                self._tracer.kill()
                self._tracer.wait()
        text = self._text()
        lost = re.findall(r"Lost (\d+) events", text)
        assert not (check and lost), (
            f"bpftrace lost {sum(map(int, lost))} events: the record is not whole")
        return parse(text.splitlines())


@dataclass(frozen=True)
class UserDirs:
    """What a user can change: directories they may write (or own) and everything below,
    and the uid and groups that decide whether a directory a relative path starts from is
    theirs to change."""

    uid: int
    groups: frozenset[int]
    writable: tuple[str, ...]

    def changes(self, base: tuple[int, int, int]) -> bool:
        uid, gid, mode = base
        return (uid == self.uid or bool(mode & 0o002)
                or (gid in {g & 0xFFFF for g in self.groups} and bool(mode & 0o020)))


# Relative to a process's directory of /proc: a path below one of its magic links.
_BELOW_PROC_LINK = re.compile(r"^(?:task/\d+/)?(?:root|cwd|fd/\d+|map_files/[^/]+)/.")
# A path through a process's magic links in /proc: which one, and what follows it.
_PROC = re.compile(
    r"^/proc/(?:self|thread-self|\d+)(?:/task/\d+)?/(root|cwd|fd/\d+|map_files/[^/]+)(/.*)?$")


def offence(call: FileCall, user: UserDirs) -> str | None:
    """Why ``call`` resolved a path that ``user`` can change with root's rights, or None."""
    path = call.path
    if not path:
        return None  # AT_EMPTY_PATH: the descriptor itself
    if call.syscall == "mount" and not path.startswith("/"):
        return None  # a file system's name ("proc", "none"), not a path
    if not path.startswith("/"):
        if call.in_proc:
            # A process's own directory of /proc holds handles the kernel keeps; a lookup
            # below one of its magic links is a lookup in the user's files.
            if _BELOW_PROC_LINK.match(path):
                return f"{call}: a lookup below a process's magic link in /proc"
            return None
        if path == ".." and call.base is not None and not user.changes(call.base):
            # The parent of a directory the user cannot change (getcwd's walk up from a
            # directory the kernel cannot name, as a helper criu runs in a pod does): the
            # directory's own parent, named by nothing of theirs; a lookup from where the
            # walk leads is judged by its own base.
            return None
        if ".." in path.split("/") or call.base is None or user.changes(call.base):
            return f"{call}: relative to a directory the user can change"
        # Relative to a directory of root's: most likely a namespace's root (criu names
        # paths of the restored mount namespace so); taken as such.
        path = "/" + path
    path = posixpath.normpath(path)
    through = _PROC.match(path)
    if through:
        kind, rest = through.groups()
        if not rest:
            return None  # the magic link itself: a handle the kernel holds
        if kind != "root":
            return f"{call}: a lookup below a process's {kind.split('/')[0]} in /proc"
        path = rest
    if path.startswith("/dev/fd/"):
        return None
    for directory in user.writable:
        # Below it: the directory itself is named in a directory of root's.
        if path.startswith(directory.rstrip("/") + "/") and _replaceable(
                path, directory, user):
            return f"{call}: under {directory}, which the user can change"
    return None


def _replaceable(path: str, directory: str, user: UserDirs) -> bool:
    """Whether ``user`` can change what ``path``, below ``directory`` that they may write,
    names. In a sticky directory (/tmp) they may replace only their own entries, so a path
    below an entry of root's is theirs to change only where a directory on the way down is
    theirs to write, or lets them make what is missing."""
    top = directory.rstrip("/")
    try:
        if not os.stat(top).st_mode & 0o1000:
            return True
    except OSError:
        return True
    names = path[len(top) + 1:].split("/")
    entries = [f"{top}/{'/'.join(names[:i])}" for i in range(1, len(names) + 1)]
    for index, entry in enumerate(entries):
        try:
            st = os.lstat(entry)
            if stat.S_ISLNK(st.st_mode):
                st = os.stat(entry)  # a link's own mode says nothing: its target's does
        except FileNotFoundError:
            # Nobody made it: the user may where they can write its parent, the sticky
            # directory itself for the first entry; the others' parents were found root's.
            return index == 0
        except OSError:
            return True
        if index == 0 and st.st_uid == user.uid:
            return True
        if index < len(entries) - 1 and user.changes((st.st_uid, st.st_gid, st.st_mode)):
            return True
    return False


def offences(calls: Iterable[FileCall], user: UserDirs) -> list[str]:
    found = [offence(call, user) for call in calls]
    return [line for line in found if line is not None]
