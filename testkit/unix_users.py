"""Two real Unix users for the tests that run processes as someone other than root (the
node agent's callers, a JupyterHub's users), and the paths they need to run this checkout.

- ``unix_users`` (session): Alice and Bob, created for the session when absent.
- ``user_paths`` (session): the directories down to the venv and the repository, made
  traversable (o+x) by them for the session where they were not.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TypeVar

import psutil
import pytest

T = TypeVar("T")

USER_NAMES = ("jgs-hub-alice", "jgs-hub-bob")
# Each user's notebooks folder, in their home.
NOTEBOOKS = "notebooks"
REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)
POLL = 0.2


@dataclass(frozen=True)
class UnixUser:
    name: str
    uid: int
    gid: int
    home: Path

    @property
    def notebooks(self) -> Path:
        """Its server's root_dir."""
        return self.home / NOTEBOOKS


def unix_user(name: str) -> UnixUser:
    entry = pwd.getpwnam(name)
    return UnixUser(name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir))


def poll(check: Callable[[], T | None], timeout: float, fail: Callable[[str], NoReturn],
         what: str) -> T:
    """``check()``'s first result that is not None, asked every POLL s until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            fail(f"{what}: not after {timeout:.0f}s")
        time.sleep(POLL)


def processes_of(uids: Iterable[int]) -> list[psutil.Process]:
    wanted = set(uids)
    found = []
    for proc in psutil.process_iter(["uids"]):
        uids_of = proc.info.get("uids")
        if uids_of is not None and wanted & {uids_of.real, uids_of.effective}:
            found.append(proc)
    return found


def kill_all(procs: list[psutil.Process]) -> list[psutil.Process]:
    """SIGKILLs them; those still alive after a while."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    _, alive = psutil.wait_procs(procs, timeout=30)
    return list(alive)


# -- users -----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def unix_users() -> Iterator[tuple[UnixUser, UnixUser]]:
    """Alice and Bob, each with a home and a notebooks folder in it.

    Created with useradd when absent, and then removed (home included) at the end of the
    session; users that were there before stay.
    """
    assert os.geteuid() == 0, "these tests run as root: useradd, and processes that setuid"
    created: list[str] = []
    try:
        for name in USER_NAMES:
            try:
                pwd.getpwnam(name)
            except KeyError:
                subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name],
                               check=True, capture_output=True)
                created.append(name)
        alice, bob = (unix_user(name) for name in USER_NAMES)
        for user in (alice, bob):
            user.notebooks.mkdir(exist_ok=True)
            os.chown(user.notebooks, user.uid, user.gid)
        yield alice, bob
    finally:
        # userdel refuses a user who still runs something; the fixtures that started their
        # processes have ended them.
        uids = []
        for name in USER_NAMES:
            with contextlib.suppress(KeyError):
                uids.append(pwd.getpwnam(name).pw_uid)
        survivors = kill_all(processes_of(uids))
        failures = [f"still running: {[p.pid for p in survivors]}"] if survivors else []
        for name in created:
            done = subprocess.run(["userdel", "-r", name], capture_output=True, text=True)
            # userdel -r says 12 when the user had no mail spool to remove: still removed.
            if done.returncode not in (0, 12):
                failures.append(f"userdel -r {name}: {done.returncode} {done.stderr.strip()}")
        assert not failures, "; ".join(failures)


# -- paths -----------------------------------------------------------------------------------
def unreadable(roots: Iterable[Path]) -> list[str]:
    """What others cannot read under ``roots``: directories they cannot list or enter,
    files they cannot read, executables they cannot run. Symlinks are left to their
    targets."""
    bad: list[str] = []
    for root in roots:
        for top, _dirs, files in os.walk(root):
            mode = os.lstat(top).st_mode
            if mode & (stat.S_IROTH | stat.S_IXOTH) != stat.S_IROTH | stat.S_IXOTH:
                bad.append(f"{stat.filemode(mode)} {top}/")
            for name in files:
                path = os.path.join(top, name)
                try:
                    mode = os.lstat(path).st_mode
                except FileNotFoundError:  # a pip install or a build beside the tests
                    continue
                if stat.S_ISLNK(mode) or not stat.S_ISREG(mode):
                    continue
                if not mode & stat.S_IROTH or (mode & stat.S_IXUSR and not mode & stat.S_IXOTH):
                    bad.append(f"{stat.filemode(mode)} {path}")
    return bad


@pytest.fixture(scope="session")
def user_paths(unix_users: tuple[UnixUser, UnixUser]) -> Iterator[dict[Path, int]]:
    """Every directory from / down to the repository, the venv and the interpreter made
    searchable by others, so that the users' servers run this checkout: the directories that
    were not (a CI checkout under /root, mode 700) get o+x (search, never read) for the
    session. Their original modes, by path."""
    targets = [REPO, VENV, Path(os.path.realpath(sys.executable)).parent, Path(sys.base_prefix)]
    changed: dict[Path, int] = {}
    try:
        for target in targets:
            for directory in [*reversed(target.parents), target]:
                mode = directory.stat().st_mode
                if directory not in changed and not mode & stat.S_IXOTH:
                    changed[directory] = stat.S_IMODE(mode)
                    os.chmod(directory, stat.S_IMODE(mode) | stat.S_IXOTH)
        if changed:
            print("tests as other users: o+x added for the session to " + ", ".join(
                f"{path} ({mode:o})" for path, mode in changed.items()))
        # The servers import the package from the checkout (an editable install) and read
        # the venv: a file that only root reads breaks them in ways far from the cause.
        bad = unreadable([REPO / "jupyter_gpu_snapshot", VENV])
        repo_mode = REPO.stat().st_mode
        if not repo_mode & stat.S_IROTH:
            bad.insert(0, f"{stat.filemode(repo_mode)} {REPO}/ (on the servers' sys.path)")
        assert not bad, (
            f"{len(bad)} paths the test users cannot read (chmod o+r, o+rx for directories):"
            "\n" + "\n".join(bad[:30])
        )
        yield changed
    finally:
        for path, mode in changed.items():
            os.chmod(path, mode)
