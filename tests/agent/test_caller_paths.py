"""Paths that Alice can change, which the agent must never resolve with root's rights: the
second audit's failures of that kind, each tried as the attacker tried it.

- Her kernel's connection file (``-f PATH`` on its command line, which she chose) swapped
  for a link to Bob's connection file, whose path anyone reads in ``/proc/PID/cmdline``:
  a save must neither hand her Bob's key and ports (in its result, its manifest or the
  list) nor have root read Bob's file at all.
- Her kernel's working directory swapped, between a save and a restore, for a link to a
  directory of Bob's that is open to all (0755) inside his home that is not (0700): the
  restored kernel must not read what is there (the restore is refused, or the kernel sits
  in a directory of her own).

Each run also checks what zdtm would: the kernels still run and answer, and the snapshot
is still listed.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot.core import procfs
from testkit.file_watch import FileOpens
from testkit.unix_users import UnixUser

from .conftest import Agent, as_user, ask_kernel, cli, save_and_stop, start_user_kernel

BOBS_NOTES = "bob's private notes"


def _listed(user: UnixUser, agent: Agent) -> list[dict[str, Any]]:
    return json.loads(cli(user, agent, "list", "--json").stdout)  # type: ignore[no-any-return]


def _manifests(agent: Agent, user: UnixUser) -> list[dict[str, Any]]:
    """Every manifest in the user's store, listed or not (read by root, as the agent)."""
    found = []
    for path in agent.store_of(user).glob("*/manifest*.json"):
        found.append(json.loads(path.read_text()))
    return found


def _in_kernel(user: UnixUser, agent: Agent, connection_file: str, code: str) -> str:
    """What ``code`` (statements that set ``seen``) leaves in ``seen``, run in the kernel."""
    return ask_kernel(user, agent, connection_file, f"exec({code!r}) or seen")


def test_a_connection_file_linked_to_another_users_gives_nothing_of_theirs(agent, unix_users):
    alice, bob = unix_users
    alices = start_user_kernel(alice, agent)
    bobs = start_user_kernel(bob, agent)
    bobs_file = Path(bobs.connection_file)
    bobs_info = json.loads(bobs_file.read_text())
    bobs_ports = {bobs_info[f"{c}_port"] for c in ("shell", "iopub", "stdin", "control", "hb")}
    # Alice cannot read it herself: his runtime directory is his alone.
    denied = as_user(alice, agent, ["cat", str(bobs_file)], check=False)
    assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied
    # Her kernel's own connection, kept aside to ask it later; then the link in its place.
    kept = alice.home / "alices-kernel.json"
    as_user(alice, agent, ["cp", alices.connection_file, str(kept)])
    as_user(alice, agent, ["ln", "-sfn", str(bobs_file), alices.connection_file])

    with FileOpens(bobs_file) as opens:
        saved = cli(alice, agent, "save", "--pid", str(alices.root_pid), "--name", "linked",
                    "--json", check=False)
        listed = cli(alice, agent, "list", "--json").stdout
        manifests = _manifests(agent, alice)
        opened = opens.opened()
    said = saved.stdout + saved.stderr
    for where, text in (("the save's answer", said), ("the list", listed),
                        ("a manifest", json.dumps(manifests))):
        assert bobs_info["key"] not in text, f"Bob's key is in {where}"
    for manifest in manifests:
        info = (manifest.get("kernel") or {}).get("connection_info") or {}
        assert not bobs_ports & {info.get(f"{c}_port") for c in
                                 ("shell", "iopub", "stdin", "control", "hb")}, info
    assert opened == 0, f"Bob's connection file was opened {opened} times during her save"
    # Both kernels run on and answer their own users.
    assert ask_kernel(alice, agent, str(kept), "x") == "41"
    assert ask_kernel(bob, agent, bobs.connection_file, "x") == "41"


@pytest.fixture
def bobs_project(unix_users: tuple[UnixUser, UnixUser]) -> Iterator[Path]:
    """A directory of Bob's that anyone may list and read (0755, its notes 0644), in his
    home that nobody else may enter (0700): his home's mode is put back at the end."""
    _, bob = unix_users
    mode = stat.S_IMODE(bob.home.stat().st_mode)
    project = bob.home / "proj"
    subprocess.run(["rm", "-rf", str(project)], check=True)
    project.mkdir(mode=0o755)
    (project / "notes.txt").write_text(BOBS_NOTES)
    for path in (project, project / "notes.txt"):
        os.chown(path, bob.uid, bob.gid)
    os.chmod(project / "notes.txt", 0o644)
    os.chmod(bob.home, 0o700)
    try:
        yield project
    finally:
        os.chmod(bob.home, mode)
        subprocess.run(["rm", "-rf", str(project)], check=True)


def test_a_working_directory_linked_into_another_users_home_gives_nothing_of_theirs(
        agent, unix_users, bobs_project):
    alice, _ = unix_users
    workdir = alice.home / "wd"
    subprocess.run(["rm", "-rf", str(workdir), f"{workdir}.old"], check=True)
    as_user(alice, agent, ["mkdir", "-m", "755", str(workdir)])
    kernel = start_user_kernel(alice, agent, cwd=workdir)
    kernel_pid = procfs.kernel_of(kernel.root_pid)
    assert kernel_pid is not None
    assert os.readlink(f"/proc/{kernel_pid.pid}/cwd") == str(workdir)
    saved = save_and_stop(alice, agent, kernel)
    as_user(alice, agent, ["mv", str(workdir), f"{workdir}.old"])
    as_user(alice, agent, ["ln", "-s", str(bobs_project), str(workdir)])
    # By the path, she cannot reach his notes: his home is closed to her.
    denied = as_user(alice, agent, ["cat", str(workdir / "notes.txt")], check=False)
    assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied

    done = cli(alice, agent, "restore", saved["id"], "--json", check=False)
    if done.returncode != 0:
        # Refused: the restore names her directory, and the snapshot is kept for later.
        assert str(workdir) in done.stderr, done.stderr
        assert saved["id"] in [s["id"] for s in _listed(alice, agent)]
        return
    restored = json.loads(done.stdout)
    connection = restored["connection_file"]
    try:
        for attempt in ("seen = open('notes.txt').read()", "seen = str(os.listdir('.'))"):
            seen = _in_kernel(alice, agent, connection, "import os\ntry:\n    " + attempt
                              + "\nexcept OSError as exc:\n    seen = type(exc).__name__")
            assert BOBS_NOTES not in seen and "notes.txt" not in seen, (attempt, seen)
        assert ask_kernel(alice, agent, connection, "x + 1") == "42"
    finally:
        procfs.kill_tree(restored["pid"])
