"""criu through the node agent, held to account: it ends, and what it says names the user's
file.

An agent with ``changed_files = 'warn'`` (the setting a refusal's own hint suggests), and
Alice's kernel holding a file of hers open for reading and another for writing; she saves
it, and then, before a restore:

- appends to the file the kernel wrote to: criu refuses the restore for its size, and the
  message names her file, not the descriptor the agent handed criu (``fd/46``);
- swaps the file the kernel read for a FIFO (a change that 'warn' lets through): the
  restore ends (refused) within bounds rather than holding root's criu, and the agent's
  operation, for good in the FIFO's open; Bob is served after;
- and a criu that hangs (a stand-in that never ends while the test wants it to) is killed
  at the agent's deadline for criu (``c.GPUSnapshot.criu_timeout``), the restore failing
  with a message that says so.

Each time the snapshot is still listed, and once the files are put right it restores.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from jupyter_gpu_snapshot.agent_client.protocol import encode
from jupyter_gpu_snapshot.core import procfs
from testkit.criu_wrappers import install
from testkit.file_watch import release_fifo

from .conftest import (
    CLI,
    COMMAND_SECONDS,
    Agent,
    as_user,
    ask_kernel,
    cli,
    kill_users_kernels,
    start_node_agent,
    start_user_kernel,
    stop_node_agent,
)
from .test_limits import send

PAGE = 4096
READ = "held = open({path!r}, 'rb')"
WRITE = "import os; out = os.open({path!r}, os.O_WRONLY); os.lseek(out, 0, os.SEEK_END)"


# Seconds the agent below gives criu: far more than its restores of the kernel here take,
# even on a busy machine.
CRIU_TIMEOUT = 30


@pytest.fixture(scope="module")
def warning_agent(agent_root: Path, unix_users, user_paths) -> Iterator[Agent]:
    """The agent, with criu's stand-in: the real criu, except that a restore hangs (saying
    so in ``criu-hangs``) while the file ``hang`` exists beside it."""
    directory = agent_root / "warn"
    directory.mkdir(mode=0o711)
    hang, hangs = directory / "hang", directory / "criu-hangs"
    wrapper = install(directory, f'if [ "$1" = restore ] && [ -e {hang} ]; then\n'
                                 f"  touch {hangs}; while :; do sleep 1; done\nfi\n"
                                 f'exec {shutil.which("criu")} "$@"\n')
    config = directory / "config.py"
    config.write_text("c.GPUSnapshot.changed_files = 'warn'\n"
                      f"c.GPUSnapshot.criu_path = {wrapper!r}\n"
                      f"c.GPUSnapshot.criu_timeout = {CRIU_TIMEOUT}\n")
    running = start_node_agent(directory / "agent", "--config", str(config))
    try:
        yield running
    finally:
        kill_users_kernels(unix_users)
        stop_node_agent(running)


@pytest.fixture(scope="module")
def saved(warning_agent: Agent, unix_users) -> Iterator[tuple[str, Path, Path]]:
    """Alice's snapshot of a kernel that reads ``read.bin`` and writes to ``out.log``, both
    hers; the kernel ended."""
    alice, _ = unix_users
    read, out = alice.home / "read.bin", alice.home / "out.log"
    as_user(alice, warning_agent, ["sh", "-c", f"head -c {PAGE} /dev/urandom > {read} && "
                                               f"printf 'first\\n' > {out}"])
    kernel = start_user_kernel(alice, warning_agent)
    for code in (READ.format(path=str(read)), WRITE.format(path=str(out))):
        ask_kernel(alice, warning_agent, kernel.connection_file, f"exec({code!r}) or 'held'")
    taken = json.loads(cli(alice, warning_agent, "save", "--pid", str(kernel.root_pid),
                           "--json").stdout)
    procfs.kill_tree(kernel.root_pid)
    yield taken["id"], read, out


def _listed(agent: Agent, user) -> list[str]:
    return [s["id"] for s in json.loads(cli(user, agent, "list", "--json").stdout)]


def test_criu_refusing_a_file_names_it_not_its_descriptor(warning_agent, unix_users, saved):
    alice, _ = unix_users
    snapshot, _read, out = saved
    before = out.read_bytes()
    as_user(alice, warning_agent, ["sh", "-c", f"printf 'later\\n' >> {out}"])
    try:
        refused = cli(alice, warning_agent, "restore", snapshot, "--json", check=False)
        if refused.returncode == 0:
            procfs.kill_tree(json.loads(refused.stdout)["pid"])
        assert refused.returncode != 0, refused.stdout
        assert str(out) in refused.stderr, refused.stderr
        assert "fd/" not in refused.stderr, refused.stderr
        assert snapshot in _listed(warning_agent, alice)
    finally:
        out.write_bytes(before)  # hers still: root writes into her file


def test_a_file_swapped_for_a_fifo_does_not_hold_criu(warning_agent, unix_users, saved):
    alice, bob = unix_users
    snapshot, read, _out = saved
    kept = read.with_suffix(".kept")
    as_user(alice, warning_agent, ["mv", str(read), str(kept)])
    as_user(alice, warning_agent, ["mkfifo", "-m", "600", str(read)])
    try:
        refused = as_user(alice, warning_agent, [*CLI, "restore", snapshot], check=False,
                          timeout=COMMAND_SECONDS)
        assert refused.returncode != 0, refused.stdout
        assert str(read) in refused.stderr, refused.stderr
        said = send(bob, warning_agent, encode({"op": "hello", "args": {}}))
        assert "result" in said[-1], said
        assert snapshot in _listed(warning_agent, alice)
    finally:
        release_fifo(read)
        os.unlink(read)
        as_user(alice, warning_agent, ["mv", str(kept), str(read)])
    restored = json.loads(cli(alice, warning_agent, "restore", snapshot, "--json").stdout)
    assert ask_kernel(alice, warning_agent, restored["connection_file"], "x") == "41"
    procfs.kill_tree(restored["pid"])


def test_a_criu_that_hangs_is_stopped_at_its_deadline(warning_agent, agent_root, unix_users,
                                                      saved):
    alice, _ = unix_users
    snapshot = saved[0]
    hang, hangs = agent_root / "warn" / "hang", agent_root / "warn" / "criu-hangs"
    hang.touch()
    try:
        started = time.monotonic()
        refused = as_user(alice, warning_agent, [*CLI, "restore", snapshot], check=False,
                          timeout=COMMAND_SECONDS)
        took = time.monotonic() - started
    finally:
        hang.unlink()
    assert hangs.exists(), "criu's stand-in did not hang"
    assert refused.returncode != 0, refused.stdout
    assert f"criu did not finish within {CRIU_TIMEOUT} s" in refused.stderr, refused.stderr
    assert took >= CRIU_TIMEOUT
    # criu and its stand-in are gone; the snapshot is still there, and restores.
    assert not [p for p in psutil.process_iter(["cmdline"])
                if str(agent_root / "warn") in " ".join(p.info.get("cmdline") or [])
                and "restore" in (p.info.get("cmdline") or [])]
    assert snapshot in _listed(warning_agent, alice)
    restored = json.loads(cli(alice, warning_agent, "restore", snapshot, "--json").stdout)
    assert ask_kernel(alice, warning_agent, restored["connection_file"], "x") == "41"
    procfs.kill_tree(restored["pid"])
