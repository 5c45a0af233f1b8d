"""A real node agent, run as root, and two real Unix users who call it.

- ``agent`` (module): a ``jupyter gpu-snapshot agent`` process on a private socket, state
  and run directory, at most one operation per user at once and no disk quota.
- ``start_agent``: starts another one with other limits (the quota tests).
- ``as_user(user, argv)``: runs a command as that user, with the agent's socket in its
  environment, as a user's own shell would.
- ``user_kernel(user)``: a snapshot-ready kernel the user started through the agent (real
  jupyter_client and our provisioner, run as the user), with ``x = 41`` in it.

The helpers that run as a user take any agent that has a socket and a log
(``ServingAgent``): a process of its own, or one served in this process
(``test_gpu_tier``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil
import pytest

from jupyter_gpu_snapshot.core import procfs
from testkit.unix_users import POLL, REPO, UnixUser

AGENT_START_SECONDS = 60.0
COMMAND_SECONDS = 180.0
CLI = [sys.executable, "-m", "jupyter_gpu_snapshot.cli"]

# Run as the user: starts a kernel through the agent, sets x, prints where it is.
START_KERNEL = """
import json, sys
from jupyter_client.manager import KernelManager
km = KernelManager(kernel_name="python3-snapshot")
km.start_kernel()
kc = km.client(); kc.start_channels(); kc.wait_for_ready(timeout=120)
reply = kc.execute_interactive("x = 41", timeout=120)
assert reply["content"]["status"] == "ok", reply
kc.stop_channels()
print(json.dumps({"kernel_id": km.kernel_id, "root_pid": km.provisioner.root_pid,
                  "connection_file": km.connection_file, "log": str(km.provisioner.log_path)}),
      flush=True)
# Held, as a server holds its kernels: jupyter_client removes the connection file at exit.
sys.stdin.read()
"""

# Run as the user: the value of an expression in the kernel of a connection file.
ASK_KERNEL = """
import sys
from jupyter_client.blocking import BlockingKernelClient
kc = BlockingKernelClient(connection_file=sys.argv[1]); kc.load_connection_file()
kc.start_channels(); kc.wait_for_ready(timeout=120)
out = []
kc.execute_interactive("print(" + sys.argv[2] + ")", timeout=120,
                       output_hook=lambda m: out.append(m["content"].get("text", "")))
print("".join(out).strip())
"""


# Run as the user: a cell that makes the kernel 300 MiB bigger, so that its save takes a
# while (a second request can arrive during it).
BIG_CELL = """
import sys
from jupyter_client.blocking import BlockingKernelClient
kc = BlockingKernelClient(connection_file=sys.argv[1]); kc.load_connection_file()
kc.start_channels(); kc.wait_for_ready(timeout=120)
reply = kc.execute_interactive("import os; blob = os.urandom(300 << 20)", timeout=300)
assert reply["content"]["status"] == "ok", reply
kc.stop_channels()
"""


class ServingAgent(Protocol):
    """What a user's commands need of an agent: its socket, and its log when they fail."""

    @property
    def socket(self) -> Path: ...

    def log(self) -> str: ...


@dataclass
class Agent:
    process: subprocess.Popen[bytes]
    socket: Path
    state_dir: Path
    run_dir: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def store_of(self, user: UnixUser) -> Path:
        return self.state_dir / "users" / str(user.uid) / "snapshots"

    def key_of(self, user: UnixUser) -> Path:
        return self.state_dir / "users" / str(user.uid) / "signing.key"


@dataclass
class UserKernel:
    user: UnixUser
    kernel_id: str
    root_pid: int
    connection_file: str
    log: str


def start_node_agent(directory: Path, *options: str, program: list[str] | None = None,
                     env: dict[str, str] | None = None) -> Agent:
    """An agent whose socket, state, run directory and log are in ``directory``, run by
    ``program`` (the CLI's ``agent`` command; a fault agent of ``testkit``) with ``env``
    added to this process's environment."""
    # The agent's state is root's; the users reach only the socket and their log dirs.
    directory.mkdir(mode=0o711, exist_ok=True)
    os.chmod(directory, 0o711)
    socket = directory / "agent.sock"
    log_path = directory / "agent.log"
    # A killed agent's socket stays: this one is listening once it is there again.
    socket.unlink(missing_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [*(program or [*CLI, "agent"]), "--socket", str(socket),
             "--state-dir", str(directory / "state"), "--run-dir", str(directory / "run"),
             *options],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **env} if env else None, cwd=REPO,
        )
    agent = Agent(process, socket, directory / "state", directory / "run", log_path)
    deadline = time.monotonic() + AGENT_START_SECONDS
    while not socket.is_socket():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"the agent did not start:\n{agent.log()[-3000:]}")
        time.sleep(POLL)
    return agent


def stop_node_agent(agent: Agent) -> None:
    agent.process.send_signal(signal.SIGTERM)
    try:
        agent.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        agent.process.kill()
        agent.process.wait()


@pytest.fixture(scope="module")
def agent_root() -> Iterator[Path]:
    """A root-owned directory the users may only traverse."""
    directory = Path(tempfile.mkdtemp(prefix="jgs-agent-"))
    os.chmod(directory, 0o711)
    try:
        yield directory
    finally:
        subprocess.run(["rm", "-rf", str(directory)], check=False)


@pytest.fixture(scope="module")
def agent(agent_root: Path, unix_users: tuple[UnixUser, UnixUser],
          user_paths: dict[Path, int]) -> Iterator[Agent]:
    running = start_node_agent(agent_root / "main", "--max-operations", "1")
    try:
        yield running
    finally:
        kill_users_kernels(unix_users)
        stop_node_agent(running)


@pytest.fixture
def start_agent(agent_root: Path, unix_users: tuple[UnixUser, UnixUser],
                user_paths: dict[Path, int]) -> Iterator[Callable[..., Agent]]:
    started: list[Agent] = []

    def start(name: str, *options: str) -> Agent:
        started.append(start_node_agent(agent_root / name, *options))
        return started[-1]

    try:
        yield start
    finally:
        kill_users_kernels(unix_users)
        for running in started:
            stop_node_agent(running)


def kill_users_kernels(users: tuple[UnixUser, ...]) -> None:
    _release_holders()
    uids = {u.uid for u in users}
    for proc in psutil.process_iter(["uids"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["uids"] and proc.info["uids"].real in uids:
                proc.kill()


def user_env(user: UnixUser, agent: ServingAgent) -> dict[str, str]:
    return {
        "HOME": str(user.home), "USER": user.name, "LOGNAME": user.name,
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "JUPYTER_GPU_SNAPSHOT_AGENT_SOCKET": str(agent.socket),
        # Only the venv's kernelspec and settings, not the tests' private runtime dir.
        "JUPYTER_PLATFORM_DIRS": "1",
    }


def as_user(user: UnixUser, agent: ServingAgent, argv: list[str],
            env: dict[str, str] | None = None, check: bool = True,
            timeout: float = COMMAND_SECONDS) -> subprocess.CompletedProcess[str]:
    """``argv`` run as ``user`` (their uid, gid and groups), from their home."""
    done = subprocess.run(
        argv, user=user.uid, group=user.gid, extra_groups=os.getgrouplist(user.name, user.gid),
        env={**user_env(user, agent), **(env or {})}, cwd=user.home, capture_output=True,
        text=True, timeout=timeout, check=False,
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"{argv[2:]} as {user.name} ended {done.returncode}:\n{done.stdout}\n{done.stderr}"
            f"\n--- agent log ---\n{agent.log()[-3000:]}")
    return done


def cli(user: UnixUser, agent: Agent, *args: str, check: bool = True
        ) -> subprocess.CompletedProcess[str]:
    return as_user(user, agent, [*CLI, *args], check=check)


def start_user_kernel(user: UnixUser, agent: ServingAgent,
                      env: dict[str, str] | None = None, cwd: Path | None = None
                      ) -> UserKernel:
    """A kernel of ``user``'s, held by a jupyter_client of theirs until the agent fixture
    ends (it kills every process of the users). ``env`` is added to the kernel's; the
    kernel runs in ``cwd`` (their home unless given)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", START_KERNEL], user=user.uid, group=user.gid,
        extra_groups=os.getgrouplist(user.name, user.gid),
        env={**user_env(user, agent), **(env or {})},
        cwd=cwd or user.home, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stderr is not None
    line = holder.stdout.readline()
    if not line:
        holder.wait(timeout=COMMAND_SECONDS)
        raise AssertionError(f"{user.name}'s kernel did not start:\n{holder.stderr.read()}"
                             f"\n--- agent log ---\n{agent.log()[-3000:]}")
    _holders.append(holder)
    found: dict[str, Any] = json.loads(line)
    return UserKernel(user, found["kernel_id"], int(found["root_pid"]),
                      found["connection_file"], found["log"])


_holders: list[subprocess.Popen[str]] = []


def _release_holders() -> None:
    while _holders:
        holder = _holders.pop()
        holder.kill()
        holder.communicate()


def ask_kernel(user: UnixUser, agent: ServingAgent, connection_file: str,
               expression: str) -> str:
    done = as_user(user, agent, [sys.executable, "-c", ASK_KERNEL, connection_file, expression])
    return done.stdout.strip().splitlines()[-1]


def tree_uids(root_pid: int) -> set[tuple[int, ...]]:
    """Every process's (real, effective, saved) uids in the tree."""
    return {tuple(p.uids()) for p in procfs.tree(root_pid)}


def save_and_stop(user: UnixUser, agent: Agent, kernel: UserKernel) -> dict[str, Any]:
    """Save ``kernel`` with --stop, as its user; the snapshot's fields, once the tree ended."""
    saved: dict[str, Any] = json.loads(cli(user, agent, "save", "--pid", str(kernel.root_pid),
                                           "--stop", "--json").stdout)
    deadline = time.monotonic() + 60
    while procfs.tree_alive(kernel.root_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return saved
