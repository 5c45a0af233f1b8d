"""The node agent's bookkeeping, in this process: its realms, the launches a client gave up,
and the check it repeats right before criu dumps a tree.

The agent runs here as root, on its own state and run directories; Alice is a real Unix
user whose kernels it launches (``test_isolation`` serves the same agent over its socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from traitlets.config import Config

from jupyter_gpu_snapshot.agent import launching, operations, realms, server
from jupyter_gpu_snapshot.agent.credentials.ownership import Caller
from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.errors import SnapshotError
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from testkit.unix_users import UnixUser

from ..conftest import run, start_kernel, stop_kernel


@pytest.fixture
def node(agent_root: Path, request: pytest.FixtureRequest) -> Iterator[server.NodeAgent]:
    directory = agent_root / request.node.name
    directory.mkdir(mode=0o711)  # Alice's kernels reach their logs in it
    os.chmod(directory, 0o711)
    yield server.NodeAgent(socket_path=directory / "agent.sock", state_dir=directory / "state",
                           run_dir=directory / "run")
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def alice(unix_users: tuple[UnixUser, UnixUser], user_paths: dict[Path, int]) -> Caller:
    user = unix_users[0]
    return Caller(user.uid, user.gid, frozenset(os.getgrouplist(user.name, user.gid)),
                  user.name)


def test_first_requests_at_once_make_one_realm(node, alice):
    async def both() -> list[realms.Realm]:
        return await asyncio.gather(node.realm(alice), node.realm(alice))

    first, second = run(both())
    assert first is second


def test_kernels_remembered_at_once_are_all_remembered(node, alice):
    """Launches and restores of one user record their kernels from threads at once."""
    realm = run(node.realm(alice))
    sleepers = [subprocess.Popen(["sleep", "120"]) for _ in range(8)]
    try:
        for _ in range(5):
            realm.launched_file.unlink(missing_ok=True)
            assert _remember_at_once(realm, [s.pid for s in sleepers]) == []
            assert set(realm.launched()) == {s.pid for s in sleepers}
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()


def _remember_at_once(realm: realms.Realm, pids: list[int]) -> list[BaseException]:
    """``realm.remember`` of each pid, each in a thread, all let go at once; what they
    raised."""
    start = threading.Barrier(len(pids))
    errors: list[BaseException] = []

    def remember(pid: int) -> None:
        start.wait()
        try:
            realm.remember(pid)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=remember, args=(pid,)) for pid in pids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_a_launch_whose_client_went_away_leaves_no_kernel(node, alice, monkeypatch):
    """The client closes the connection once the tree runs, before the agent knows its
    pid: the agent kills the tree and reaps its launcher."""
    started, go_on = threading.Event(), threading.Event()
    wait_for_init = launching.wait_for_namespace_init

    def held(launcher_pid: int, script: str) -> int:
        started.set()
        go_on.wait(60)
        return wait_for_init(launcher_pid, script=script)

    monkeypatch.setattr(launching, "wait_for_namespace_init", held)

    async def launch_then_go() -> list[int]:
        realm = await node.realm(alice)
        session = operations.Session(node, alice, None)  # type: ignore[arg-type]
        launch = asyncio.ensure_future(session.op_launch(realm, {
            "argv": [shutil.which("sleep") or "sleep", "120"], "kernel_id": "abandoned"}))
        assert await asyncio.to_thread(started.wait, 60)
        launcher = next(p for p in psutil.Process().children()
                        if "kernel-abandoned.log" in " ".join(p.cmdline()))
        tree = [launcher]
        try:
            deadline = time.monotonic() + 60
            while not [p for p in tree if p.uids().real == alice.uid and p.name() == "sleep"]:
                assert time.monotonic() < deadline, "the kernel did not start"
                await asyncio.sleep(0.1)
                tree = procfs.tree(launcher.pid)
            launch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await launch
            go_on.set()
            await asyncio.wait_for(asyncio.gather(*node._launchers), 30)
            return await _running_after(tree, seconds=10)
        finally:
            # Whatever the agent left, on this loop, which reaps its children.
            go_on.set()
            for proc in tree:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            await _running_after(tree, seconds=10)

    assert run(launch_then_go()) == []


async def _running_after(procs: list[psutil.Process], seconds: float) -> list[int]:
    """The pids of ``procs`` still running (zombies are not) after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        running = [p.pid for p in procs if _running(p)]
        if not running or time.monotonic() > deadline:
            return running
        await asyncio.sleep(0.1)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_tree_that_is_no_longer_the_callers_is_refused_right_before_the_dump(node, alice):
    """The check ``op_save`` makes before the engine's save is made again by the engine
    itself right before criu: here a root kernel reaches the engine of Alice's realm
    directly, as if one of her processes had become root's in between."""
    realm = run(node.realm(alice))
    kernel = start_kernel(config=Config(
        {"SnapshotReadyProvisioner": {"log_dir": str(realm.log_dir)}}))
    engine = realm.engine_for(alice)
    try:
        with pytest.raises(SnapshotError, match=r"runs as uid \[0\], not as you"):
            # With its connection, as a server sends it: the agent reads no file of root's.
            run(engine.save(SaveTarget(
                pid=kernel.root_pid, connection_info=dict(kernel.km.get_connection_info())),
                name="roots"))
        assert procfs.tree_alive(kernel.root_pid)
        assert [s.name for s in realm.shared.catalog()] == []
    finally:
        engine.files.close()
        stop_kernel(kernel)


def test_a_dump_refused_another_users_limits_names_the_capability_and_the_agent(tmp_path):
    """The line criu logs when root lacks CAP_SYS_RESOURCE and the process is another
    user's (seen on this project's CI and GPU machines): the message points at the agent,
    not at privileges root already has."""
    from jupyter_gpu_snapshot.core.criu import explain_log

    log = tmp_path / "dump.log"
    log.write_text(
        "(00.038320) dumping /proc/22847/oom_score_adj\n"
        "(00.038330) Error (criu/cr-dump.c:389): Can't get rlimit 0: Operation not permitted\n"
        "(00.039192) Error (criu/cr-dump.c:1975): Dumping FAILED.\n")
    said = explain_log(log, 1)
    assert "CAP_SYS_RESOURCE" in said and "node agent" in said
    assert "run as root" not in said
