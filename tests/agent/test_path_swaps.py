"""The path-swap table: every path of a user's that the engine touches through the node agent
(the registry ``core.user_paths.UserPath``) swapped for a file, a FIFO, a device, a link and
a directory, right before the operation that touches it. Scenarios as data, as in CRIU's
zdtm: each case says what the operation must do (``done`` or ``refused``), and every case
checks that the kernel still runs (a save) or its snapshot is still listed (a restore),
that nothing of root's or of another user's shows in what the agent answered or stored, and
that the agent answers at once (a FIFO held none of its threads).

A registry entry without a scenario here fails ``test_every_registered_path_has_a_scenario``.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.user_paths import UserPath
from testkit.unix_users import UnixUser

from .conftest import Agent, UserKernel, as_user, ask_kernel, cli, save_and_stop, start_user_kernel

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent and the users need root")

KINDS = ("file", "fifo", "device", "link", "directory")
ROOT_SECRET = "root's secret, never for a user"
BOBS_SECRET = "bob's secret, never for alice"
CONTENT = "alice's data\n"


@dataclass(frozen=True)
class Scenario:
    """A path of the registry: which operation touches it, where it is for a kernel of
    the table (``where``), and what the operation does once it was swapped, by kind."""

    step: str  # "save" (of a running kernel) or "restore" (of its stopped snapshot)
    where: Callable[[Table], Path]
    outcome: dict[str, str]


REFUSED_BUT_A_FILE = {"file": "done", "fifo": "refused", "device": "refused",
                      "link": "refused", "directory": "refused"}
SCENARIOS: dict[UserPath, Scenario] = {
    UserPath.CONNECTION_FILE: Scenario(
        "save", lambda t: Path(t.running.connection_file), REFUSED_BUT_A_FILE),
    UserPath.DEV_SHM: Scenario(
        "save", lambda t: Path("/dev/shm") / f"jgs-swap-{t.alice.uid}",
        dict.fromkeys(KINDS, "done")),
    UserPath.WORKING_DIRECTORY: Scenario(
        "restore", lambda t: t.workdir, dict.fromkeys(KINDS, "refused")),
    UserPath.OPEN_FILE: Scenario(
        "restore", lambda t: t.files / "opened.txt", REFUSED_BUT_A_FILE),
    UserPath.MAPPED_FILE: Scenario(
        "restore", lambda t: t.files / "mapped.txt", REFUSED_BUT_A_FILE),
    # Even a copy of the same program is another file than the one recorded at the save.
    UserPath.EXECUTABLE: Scenario(
        "restore", lambda t: t.files / "program", dict.fromkeys(KINDS, "refused")),
    UserPath.KERNEL_LOG: Scenario(
        "restore", lambda t: Path(t.stopped_log), REFUSED_BUT_A_FILE),
}

# Run in the kernel of the restore cases: a working directory of hers, and apart from it
# (each swap alone decides) a file of hers open for reading, another mapped, and a child
# running a program of hers.
HOLD_FILES = (
    "import os, mmap, subprocess\n"
    "os.chdir({workdir!r})\n"
    "held = open({files!r} + '/opened.txt')\n"
    "_m = open({files!r} + '/mapped.txt', 'rb')\n"
    "mapped = mmap.mmap(_m.fileno(), 0, access=mmap.ACCESS_READ)\n"
    "child = subprocess.Popen([{files!r} + '/program', '100000'])\n"
)


@dataclass
class Table:
    agent: Agent
    alice: UnixUser
    bob: UnixUser
    files: Path
    workdir: Path
    running: UserKernel
    stopped_id: str
    stopped_log: str
    secrets: tuple[Path, Path]


@pytest.fixture(scope="module")
def table(agent: Agent, unix_users: tuple[UnixUser, UnixUser]) -> Iterator[Table]:
    alice, bob = unix_users
    files = alice.home / "swaps"
    workdir = files / "wd"
    shutil.rmtree(files, ignore_errors=True)
    as_user(alice, agent, ["mkdir", "-m", "755", "-p", str(workdir)])
    for name in ("opened.txt", "mapped.txt"):
        (files / name).write_text(CONTENT)
        os.chown(files / name, alice.uid, alice.gid)
    shutil.copy("/bin/sleep", files / "program")
    os.chown(files / "program", alice.uid, alice.gid)
    root_secret = Path("/root/jgs-swap-secret")
    root_secret.write_text(ROOT_SECRET)
    os.chmod(root_secret, 0o600)
    bobs = bob.home / "private"
    shutil.rmtree(bobs, ignore_errors=True)
    bobs.mkdir(mode=0o755)
    (bobs / "notes.txt").write_text(BOBS_SECRET)
    for path in (bobs, bobs / "notes.txt"):
        os.chown(path, bob.uid, bob.gid)
    mode = stat.S_IMODE(bob.home.stat().st_mode)
    os.chmod(bob.home, 0o700)
    held = start_user_kernel(alice, agent)
    code = HOLD_FILES.format(workdir=str(workdir), files=str(files))
    assert ask_kernel(alice, agent, held.connection_file, f"exec({code!r}) or 'held'") == "held"
    stopped = save_and_stop(alice, agent, held)
    try:
        yield Table(agent, alice, bob, files, workdir, start_user_kernel(alice, agent),
                    stopped["id"], held.log, (root_secret, bobs / "notes.txt"))
    finally:
        os.chmod(bob.home, mode)
        root_secret.unlink(missing_ok=True)
        shutil.rmtree(bobs, ignore_errors=True)
        shutil.rmtree(files, ignore_errors=True)


def test_every_registered_path_has_a_scenario() -> None:
    assert set(SCENARIOS) == set(UserPath), (
        f"no path-swap scenario for {sorted(p.name for p in set(UserPath) - set(SCENARIOS))}")


def swap(path: Path, kind: str, table: Table) -> None:
    """Put a ``kind`` where ``path`` was (kept aside as ``path.orig``), as Alice could (a
    device: as root, which she cannot make but may find there)."""
    alice = table.alice
    if path.exists() or path.is_symlink():
        path.rename(path.with_name(path.name + ".orig"))
    directory = path.with_name(path.name + ".orig").is_dir()
    if kind == "file":
        source = path.with_name(path.name + ".orig")
        path.write_bytes(source.read_bytes() if source.is_file() else CONTENT.encode())
        if source.is_file():  # a copy as she would make it: criu checks a file's mode
            shutil.copymode(source, path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    elif kind == "link":
        path.symlink_to(table.secrets[1].parent if directory else table.secrets[0])
    else:
        path.mkdir()
    os.chown(path, alice.uid, alice.gid, follow_symlinks=False)


def put_back(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    kept = path.with_name(path.name + ".orig")
    if kept.exists() or kept.is_symlink():
        kept.rename(path)


def stored(table: Table) -> str:
    """Everything of Alice's store that root reads: her manifests."""
    return "".join(p.read_text(errors="replace")
                   for p in table.agent.store_of(table.alice).glob("*/manifest*.json"))


@pytest.mark.parametrize(("user_path", "kind"), [(p, k) for p in SCENARIOS for k in KINDS],
                         ids=lambda v: v.name.lower() if isinstance(v, UserPath) else v)
def test_a_swapped_path(table: Table, user_path: UserPath, kind: str) -> None:
    scenario = SCENARIOS[user_path]
    alice, agent = table.alice, table.agent
    path = scenario.where(table)
    swap(path, kind, table)
    restored: dict[str, Any] | None = None
    try:
        if scenario.step == "save":
            done = cli(alice, agent, "save", "--pid", str(table.running.root_pid), "--json",
                       check=False)
        else:
            done = cli(alice, agent, "restore", table.stopped_id, "--json", check=False)
            if done.returncode == 0:
                restored = json.loads(done.stdout)
    finally:
        put_back(path)
    said = done.stdout + done.stderr
    outcome = "done" if done.returncode == 0 else "refused"
    assert outcome == scenario.outcome[kind], said
    if outcome == "refused":
        assert "Traceback" not in said and said.strip(), said
        if user_path is UserPath.WORKING_DIRECTORY:
            assert str(path) in said, said
    for secret in (ROOT_SECRET, BOBS_SECRET):
        assert secret not in said and secret not in stored(table)
    # The kernel still runs, or its snapshot is still listed; and the agent answers.
    assert ask_kernel(alice, agent, table.running.connection_file, "x") == "41"
    listed = json.loads(cli(alice, agent, "list", "--json").stdout)
    assert table.stopped_id in [s["id"] for s in listed]
    if restored is not None:
        try:
            held = ask_kernel(alice, agent, restored["connection_file"], "held.read()")
            assert held == CONTENT.strip()
        finally:
            procfs.kill_tree(int(restored["pid"]))


def test_the_table_s_snapshot_restores_with_every_path_in_place(table: Table) -> None:
    """Last: the refusals above came of the swaps, not of a snapshot that never restores."""
    done = cli(table.alice, table.agent, "restore", table.stopped_id, "--json")
    restored = json.loads(done.stdout)
    try:
        assert ask_kernel(table.alice, table.agent, restored["connection_file"],
                          "os.getcwd()") == str(table.workdir)
    finally:
        procfs.kill_tree(int(restored["pid"]))
