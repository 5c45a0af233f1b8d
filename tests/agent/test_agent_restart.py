"""The node agent killed (``kill -9``: systemd's restart, the OOM killer, a rolling update of
the DaemonSet) at each moment of a stopping save of Alice's kernel, or of a restore, then
started again on the same state: the fault suite's table (``tests/core/test_faults.py``),
for the agent.

The agent that dies is ``testkit/fault_agent.py``: the agent itself, killing itself at the
row's moment. Every row checks, once the agent is back, what a recovery at its start must
have made true, as a server's start does for its own store:

- a kernel the save had not stopped yet runs and answers; a kernel that the save stopped
  left a complete image, which is listed (the death notice in its log names it);
- nothing partial is left in the store, nor any criu work directory in the temp directory;
- the quota counts the store as ``du`` does: a kept image counts, a removed one does not;
- the snapshot kept restores, and a restore cut off leaves it listed and restorable.

The rows share one state directory and one kernel while it lives, as an agent restarted on
a node does.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from jupyter_gpu_snapshot.agent_client.protocol import encode
from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.kernel_log import kernel_death_cause
from jupyter_gpu_snapshot.core.recovery import WORK_PREFIXES
from jupyter_gpu_snapshot.core.store import (
    ASSEMBLED_PREFIX,
    DELETING_PREFIX,
    PARTIAL_PREFIX,
    UNFINISHED_PREFIX,
)
from testkit.criu_wrappers import install, kill_saver_while_writing_pages
from testkit.unix_users import POLL, UnixUser

from .conftest import (
    COMMAND_SECONDS,
    Agent,
    UserKernel,
    ask_kernel,
    cli,
    kill_users_kernels,
    start_node_agent,
    start_user_kernel,
    stop_node_agent,
)
from .test_limits import send

LEFTOVERS = (PARTIAL_PREFIX, UNFINISHED_PREFIX, DELETING_PREFIX, ASSEMBLED_PREFIX)


@dataclass(frozen=True)
class AgentDeath:
    """One row: where the agent dies, and what must be true once it is back."""

    moment: str  # a phase of the save or the restore, or a point of testkit/fault_points
    kernel_lives: bool  # the kernel was not stopped yet: it runs on
    kept: bool  # the save's image is complete: it is listed
    after_bytes: int = 0  # with a phase: only once this many bytes are reported done
    criu_outlives: bool = False  # killed by criu's wrapper while criu writes the pages
    restore: bool = False  # the agent dies restoring the snapshot the rows kept last


DEATHS = (
    # The draft written, the hooks run, criu about to start.
    AgentDeath("dump", kernel_lives=True, kept=False),
    # criu goes on without the agent, ends the kernel and completes the image.
    AgentDeath("none", kernel_lives=False, kept=True, criu_outlives=True),
    # The image complete, its commit under way: the audit's case.
    AgentDeath("commit", kernel_lives=False, kept=True, after_bytes=1),
    # Right after the rename that lists it, before the whole files that became recipes go.
    AgentDeath("renamed", kernel_lives=False, kept=True),
    # criu restoring, its images served by the agent.
    AgentDeath("restore", kernel_lives=False, kept=True, after_bytes=1, restore=True),
)


def _fault_agent(death: AgentDeath) -> list[str]:
    return [sys.executable, "-m", "testkit.fault_agent", death.moment,
            "--after-bytes", str(death.after_bytes), "--"]


def _stopping_save(user: UnixUser, agent: Agent, kernel: UserKernel, name: str) -> None:
    """A stopping save (hibernation's, a shutdown's) of ``kernel``, asked as its server asks
    it; returns once the agent answered or its connection ended."""
    send(user, agent, encode({"op": "save", "args": {
        "target": {"pid": kernel.root_pid, "kernel_id": kernel.kernel_id},
        "name": name, "stop": True}}), timeout=COMMAND_SECONDS)


def _wait_for_criu_to_end(state: Path) -> None:
    """criu runs in a session of its own: it outlives the agent that started it."""
    deadline = time.monotonic() + COMMAND_SECONDS
    while any(str(state) in " ".join(_cmdline(p)) for p in psutil.process_iter()):
        assert time.monotonic() < deadline, "criu still runs"
        time.sleep(POLL)


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _listed(user: UnixUser, agent: Agent) -> dict[str, dict[str, object]]:
    found = json.loads(cli(user, agent, "list", "--json").stdout)
    return {s["name"]: s for s in found}


def _require_recovered(user: UnixUser, agent: Agent, temp: Path, row: str) -> None:
    """Nothing partial in the store nor in the temp directory; the quota as du counts.

    The agent serves while it recovers the stores; each realm's first request waits for
    its own store's recovery: the user's ``hello`` is the moment it is done."""
    said = send(user, agent, encode({"op": "hello", "args": {}}))
    store = agent.store_of(user)
    leftovers = [p.name for p in store.iterdir() if p.name.startswith(LEFTOVERS)]
    assert leftovers == [], (row, leftovers)
    # criu works in the agent's temp directory: its own under RUN (RUN/tmp), or TMPDIR.
    work = [p.name for where in (temp, agent.run_dir / "tmp") if where.is_dir()
            for p in where.iterdir() if p.name.startswith(WORK_PREFIXES)]
    assert work == [], (row, work)
    used = said[-1]["result"]["limits"]["used_bytes"]
    du = subprocess.run(["du", "-sb", str(store)], capture_output=True, text=True, check=True)
    on_disk = int(du.stdout.split()[0])
    assert abs(used - on_disk) <= on_disk // 50 + (64 << 10), (row, used, on_disk)


@pytest.mark.timeout(900)
def test_an_agent_killed_at_each_moment_comes_back_with_its_store_whole(
        agent_root, unix_users, user_paths):
    alice, _ = unix_users
    home = agent_root / "r"
    temp = home / "t"  # the agents' temp directory, where criu works
    temp.mkdir(parents=True, mode=0o700)
    env = {"TMPDIR": str(temp)}
    config = home / "criu-outlives.py"
    wrapper = install(home, kill_saver_while_writing_pages())
    config.write_text(f"c.GPUSnapshot.criu_path = {wrapper!r}\n")
    kernel: UserKernel | None = None
    kept_last: str | None = None
    try:
        for number, death in enumerate(DEATHS):
            row = f"{death.moment}{' (restore)' if death.restore else ''}"
            options = ("--config", str(config)) if death.criu_outlives else ()
            dying = start_node_agent(home, *options, program=_fault_agent(death), env=env)
            name = f"row-{number}"
            try:
                if death.restore:
                    assert kept_last is not None
                    cli(alice, dying, "restore", kept_last, check=False)
                else:
                    if kernel is None or not procfs.tree_alive(kernel.root_pid):
                        kernel = start_user_kernel(alice, dying)
                    _stopping_save(alice, dying, kernel, name)
                assert dying.process.wait(timeout=COMMAND_SECONDS) == -signal.SIGKILL, (
                    row, dying.log()[-3000:])
            finally:
                if dying.process.poll() is None:
                    dying.process.kill()
                    dying.process.wait()
            _wait_for_criu_to_end(dying.state_dir)

            agent = start_node_agent(home, env=env)
            try:
                _require_recovered(alice, agent, temp, row)
                listed = _listed(alice, agent)
                if death.restore:
                    assert kept_last in {s["id"] for s in listed.values()}, (row, listed)
                    restored = json.loads(cli(alice, agent, "restore", kept_last,
                                              "--json").stdout)
                    assert ask_kernel(alice, agent, restored["connection_file"], "x") == "41"
                    procfs.kill_tree(restored["pid"])
                    continue
                assert kernel is not None
                if death.kernel_lives:
                    assert name not in listed, (row, listed)
                    assert ask_kernel(alice, agent, kernel.connection_file, "x") == "41", row
                    continue
                assert not procfs.tree_alive(kernel.root_pid), row
                assert death.kept and name in listed, (row, listed)
                kept_last = str(listed[name]["id"])
                # The death notice: the kernel's log says what ended it, and what is left.
                cause = kernel_death_cause(kernel.log) or ""
                assert kept_last in cause, (row, cause)
            finally:
                stop_node_agent(agent)
    finally:
        kill_users_kernels(unix_users)
