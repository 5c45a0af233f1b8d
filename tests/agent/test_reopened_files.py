"""No path Alice controls is resolved with root's privileges when the agent restores her
kernel: every file criu would reopen is opened as her and handed to criu.

The attack, tried for each kind of object a restore reopens: Alice's kernel holds a file of
hers (read-only, write-only, read-write, mapped); she saves it, and swaps the file for a
link to a root-only one of the same size and mode. A working directory swapped for a link
to root's directory is refused, before the kernel runs there.

Two flavours, a table as zdtm keeps one:
- ``before``: the link is there when she asks for the restore. The restore is refused,
  naming the file and her missing permission; the snapshot stays listed.
- ``at criu``: the link is put there after every check of the agent, right before criu
  runs (a criu wrapper swaps it, as Alice, at that moment: the race a check-then-open
  loses). The restore goes on, and the kernel holds her own file, not root's.

Either way the root-only file is untouched and no process of hers holds it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from jupyter_gpu_snapshot.core import procfs
from testkit.criu_wrappers import install
from testkit.unix_users import UnixUser, processes_of

from .conftest import Agent, ask_kernel, cli, start_user_kernel

SECRET = b"ROOT-ONLY-SECRET-" + b"x" * 4079  # one page, so a mapping reads it whole
OWN = b"alice-own-bytes-" + b"y" * (len(SECRET) - 16)


@dataclass(frozen=True)
class Held:
    """How the kernel holds Alice's object: Python run in it, ``{path}`` the object."""

    kind: str
    code: str
    # What refuses the ``before`` flavour: the opening as Alice, or a check before it that
    # reads the object without following links (read-only files and mappings are checked
    # for changes since the save).
    refused: str = "and you cannot open it now: Permission denied"


HELD = [
    Held("read-only file", "held = open({path!r}, 'rb')",
         refused="files the kernel had open changed since snapshot"),
    Held("write-only file", "import os; held = os.open({path!r}, os.O_WRONLY)"),
    Held("read-write file", "import os; held = os.open({path!r}, os.O_RDWR)"),
    # A mapping with no descriptor left open: mmap(2) through ctypes, the file closed.
    Held("mapped file", "import ctypes, os; libc = ctypes.CDLL(None); "
         "libc.mmap.restype = ctypes.c_void_p; "
         "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, "
         "ctypes.c_int, ctypes.c_int, ctypes.c_long]; fd = os.open({path!r}, os.O_RDONLY); "
         "held = libc.mmap(None, 4096, 1, 2, fd, 0); os.close(fd)",
         refused="file(s) the kernel had mapped are missing here"),
]
FLAVOURS = ["before", "at criu"]


@pytest.fixture(scope="module")
def swapping_agent(agent_root: Path, unix_users, user_paths) -> Iterator[tuple[Agent, Path]]:
    """An agent whose criu runs ``swap-hook`` (when present) before each restore."""
    from .conftest import kill_users_kernels, start_node_agent, stop_node_agent

    directory = agent_root / "reopen"
    directory.mkdir(mode=0o711)
    hook = directory / "swap-hook"
    wrapper = install(directory, f'[ "$1" = restore ] && [ -x {hook} ] && {hook}\n'
                                 f'exec {shutil.which("criu")} "$@"\n')
    config = directory / "config.py"
    config.write_text(f"c.GPUSnapshot.criu_path = {wrapper!r}\n")
    running = start_node_agent(directory / "agent", "--config", str(config))
    try:
        yield running, hook
    finally:
        kill_users_kernels(unix_users)
        stop_node_agent(running)


def _as(user: UnixUser, command: str) -> str:
    return (f"setpriv --reuid={user.uid} --regid={user.gid} --clear-groups "
            f"sh -c {shlex.quote(command)}")


def _tree(root_pid: int) -> list[int]:
    return [p.pid for p in procfs.tree(root_pid)]


def _inodes(pids: list[int]) -> set[tuple[int, int]]:
    """The (device, inode) of every file the processes hold: descriptors, mappings, cwd."""
    found: set[tuple[int, int]] = set()
    for pid in pids:
        base = Path(f"/proc/{pid}")
        try:
            links = [base / "cwd", *(base / "fd").iterdir()]
            maps = (base / "maps").read_text().splitlines()
        except OSError:  # ended meanwhile
            continue
        for link in links:
            try:
                info = os.stat(link)
            except OSError:
                continue
            found.add((info.st_dev, info.st_ino))
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and parts[4] != "0":
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                found.add((os.makedev(major, minor), int(parts[4])))
    return found


def _swap_then_restore(alice: UnixUser, agent: Agent, hook: Path, swap: str, flavour: str,
                       snapshot_id: str) -> subprocess.CompletedProcess[str]:
    """Restore ``snapshot_id`` as Alice, with ``swap`` run as her before she asks
    (``before``) or by the criu wrapper right before criu runs (``at criu``)."""
    if flavour == "before":
        subprocess.run(swap, shell=True, check=True)
    else:
        hook.write_text(f"#!/bin/sh\n{swap}\nrm -f {hook}\n")
        hook.chmod(0o755)
    try:
        return cli(alice, agent, "restore", snapshot_id, "--json", check=False)
    finally:
        hook.unlink(missing_ok=True)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("held", HELD, ids=[h.kind for h in HELD])
def test_a_link_swapped_in_for_a_reopened_object_never_gives_root_s_object(
        swapping_agent, agent_root, unix_users, held, flavour):
    agent, hook = swapping_agent
    alice, _ = unix_users
    slug = re.sub(r"\W+", "-", f"{held.kind}-{flavour}")
    # Root's file, 0600, in a directory only root may list.
    secret_dir = agent_root / f"secret-{slug}"
    secret_dir.mkdir(mode=0o700)
    (secret_dir / "secret").write_bytes(SECRET)
    os.chmod(secret_dir / "secret", 0o600)
    target = secret_dir / "secret"
    # Alice's, of the same size and mode: criu's own checks cannot tell them apart.
    mine = alice.home / f"reopen-{slug}"
    subprocess.run(_as(alice, f"rm -rf {mine} && mkdir -m 700 {mine} && "
                              f"printf %s {shlex.quote(OWN.decode())} > {mine}/secret && "
                              f"chmod 600 {mine}/secret"), shell=True, check=True)
    path = mine / "secret"
    own_inode = (path.stat().st_dev, path.stat().st_ino)
    target_inode = (target.stat().st_dev, target.stat().st_ino)

    kernel = start_user_kernel(alice, agent)
    ask_kernel(alice, agent, kernel.connection_file,
               f"exec({held.code.format(path=str(path))!r}) or 'held'")
    assert own_inode in _inodes(_tree(kernel.root_pid))
    saved = json.loads(cli(alice, agent, "save", "--pid", str(kernel.root_pid),
                           "--json").stdout)
    procfs.kill_tree(kernel.root_pid)

    swap = _as(alice, f"mv {path} {path}.real && ln -s {target} {path}")
    done = _swap_then_restore(alice, agent, hook, swap, flavour, saved["id"])
    assert path.is_symlink(), "the link was not swapped in"

    if flavour == "before":
        assert done.returncode == 2, done.stdout + done.stderr
        assert held.refused in done.stderr and str(path) in done.stderr, done.stderr
        assert saved["id"] in cli(alice, agent, "list").stdout
        holders = _inodes([p.pid for p in processes_of([alice.uid])])
    else:
        assert done.returncode == 0, done.stdout + done.stderr
        restored = json.loads(done.stdout)
        holders = _inodes(_tree(restored["pid"]))
        assert own_inode in holders, "the restored kernel does not hold Alice's own object"
        assert ask_kernel(alice, agent, restored["connection_file"], "x + 1") == "42"
        procfs.kill_tree(restored["pid"])
    assert target_inode not in holders
    assert (secret_dir / "secret").read_bytes() == SECRET


@dataclass(frozen=True)
class Unrestorable:
    """What criu would create or open by path as root: refused when the save ends, while the
    kernel still runs. Python run in the kernel, ``{dir}`` a directory of Alice's."""

    kind: str
    code: str
    said: str


UNRESTORABLE = [
    Unrestorable("a deleted file", "import tempfile; held = tempfile.TemporaryFile(dir={dir!r}); "
                 "held.write(b'x' * 100); held.flush()", "held a deleted file open"),
    Unrestorable("a Unix socket with a path",
                 "import socket; held = socket.socket(socket.AF_UNIX); "
                 "held.bind({dir!r} + '/sock'); held.listen()", "had a Unix socket at"),
    Unrestorable("a FIFO", "import os; os.mkfifo({dir!r} + '/fifo'); "
                 "held = os.open({dir!r} + '/fifo', os.O_RDONLY | os.O_NONBLOCK)",
                 "had a FIFO open"),
]


@pytest.mark.parametrize("case", UNRESTORABLE, ids=[c.kind for c in UNRESTORABLE])
def test_a_kernel_the_agent_could_not_restore_is_refused_at_its_save(
        swapping_agent, unix_users, case):
    agent, _ = swapping_agent
    alice, _ = unix_users
    mine = alice.home / ("unrestorable-" + re.sub(r"\W+", "-", case.kind))
    subprocess.run(_as(alice, f"rm -rf {shlex.quote(str(mine))} && mkdir -m 700 "
                              f"{shlex.quote(str(mine))}"), shell=True, check=True)
    kernel = start_user_kernel(alice, agent)
    ask_kernel(alice, agent, kernel.connection_file,
               f"exec({case.code.format(dir=str(mine))!r}) or 'held'")
    before = cli(alice, agent, "list").stdout
    done = cli(alice, agent, "save", "--pid", str(kernel.root_pid), check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "the node agent could not restore this kernel: " in done.stderr, done.stderr
    assert case.said in done.stderr, done.stderr
    # The kernel runs on, and nothing partial is listed.
    assert ask_kernel(alice, agent, kernel.connection_file, "x + 1") == "42"
    assert cli(alice, agent, "list").stdout == before
    procfs.kill_tree(kernel.root_pid)


def test_a_restored_kernel_saves_again_and_each_opening_keeps_its_own_offset(
        swapping_agent, unix_users):
    """Files reach the restored kernel from descriptors opened outside its mount namespace;
    its next save and restore must work all the same, with one file open twice (a reader
    part-way through it, a writer appending) keeping two offsets."""
    agent, _ = swapping_agent
    alice, _ = unix_users
    data = alice.home / "two-openings.txt"
    subprocess.run(_as(alice, f"printf abcdef > {data}"), shell=True, check=True)
    kernel = start_user_kernel(alice, agent)
    code = f"reader = open({str(data)!r}); reader.read(2); writer = open({str(data)!r}, 'a')"
    ask_kernel(alice, agent, kernel.connection_file, f"exec({code!r}) or 'held'")
    pid, connection = kernel.root_pid, kernel.connection_file
    for generation in (1, 2):
        saved = json.loads(cli(alice, agent, "save", "--pid", str(pid), "--json").stdout)
        procfs.kill_tree(pid)
        restored = json.loads(cli(alice, agent, "restore", saved["id"], "--json").stdout)
        pid, connection = restored["pid"], restored["connection_file"]
        assert ask_kernel(alice, agent, connection, "reader.tell(), x") == "2 41"
        ask_kernel(alice, agent, connection, f"writer.write('{generation}') and writer.flush()")
    assert data.read_text() == "abcdef12"
    assert ask_kernel(alice, agent, connection, "reader.read()") == "cdef12"
    procfs.kill_tree(pid)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_working_directory_swapped_for_root_s_is_refused(
        swapping_agent, agent_root, unix_users, flavour):
    """A working directory swapped for a link to root's directory, before the agent's
    checks or right before criu: the restore is refused, naming the directory, before the
    kernel runs a single instruction there (her own opening fails, or criu's lookup finds
    another directory than the one she opened), and the snapshot stays for later."""
    agent, hook = swapping_agent
    alice, _ = unix_users
    slug = re.sub(r"\W+", "-", flavour)
    secret_dir = agent_root / f"secret-cwd-{slug}"
    secret_dir.mkdir(mode=0o700)
    (secret_dir / "secret").write_bytes(SECRET)
    mine = alice.home / f"reopen-cwd-{slug}"
    subprocess.run(_as(alice, f"rm -rf {mine} && mkdir -m 700 {mine}"), shell=True, check=True)
    kernel = start_user_kernel(alice, agent)
    ask_kernel(alice, agent, kernel.connection_file, f"__import__('os').chdir({str(mine)!r})")
    saved = json.loads(cli(alice, agent, "save", "--pid", str(kernel.root_pid),
                           "--json").stdout)
    procfs.kill_tree(kernel.root_pid)
    swap = _as(alice, f"mv {mine} {mine}.real && ln -s {secret_dir} {mine}")
    done = _swap_then_restore(alice, agent, hook, swap, flavour, saved["id"])
    assert mine.is_symlink(), "the link was not swapped in"
    assert done.returncode != 0, done.stdout
    assert str(mine) in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert saved["id"] in [s["id"] for s in json.loads(
        cli(alice, agent, "list", "--json").stdout)]
    assert (secret_dir / "secret").read_bytes() == SECRET
