"""Two processes, one kernel or one snapshot: the CLI and an engine in this process (as the
server runs it) never collide. One operation wins; the other gets one clear 'busy' error;
the kernel stays alive and the snapshot intact."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.criu import CriuRunner
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.errors import Busy, SnapshotError
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.locks import kernel_key, name_key, snapshot_key
from jupyter_gpu_snapshot.core.store import SnapshotStore
from testkit.criu_wrappers import gated, install, slow
from tests.cli.test_cli import cli
from tests.conftest import KernelHandle, RestoredTrees, run, start_kernel, stop_kernel


def _slow_criu(tmp_path: Path, action: str, seconds: float = 3.0) -> str:
    return install(tmp_path, slow(action, seconds), f"criu-slow-{action}")


CliStarter = Callable[..., "subprocess.Popen[str]"]


@pytest.fixture
def cli_in_background(store: SnapshotStore) -> Iterator[CliStarter]:
    """Starts the CLI on ``store`` without waiting; whatever a failed test left running is
    killed and reaped at teardown, so that it cannot spill into the next test."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter_gpu_snapshot.cli", "--store", str(store.root), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _until_held(store: SnapshotStore, key: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not store.locks.is_held(key):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{key} was never taken"
        time.sleep(0.02)


def _command_lines(pid: int) -> list[str]:
    """The command lines of ``pid``'s descendants; one that ends or turns zombie while it is
    read (criu's short `--version` and `check` calls do) is skipped."""
    lines = []
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            lines.append(" ".join(child.cmdline()))
    return lines


def _until_running(proc: subprocess.Popen[str], command: str) -> None:
    """Until a descendant of ``proc`` runs ``command``."""
    deadline = time.monotonic() + 60
    while not any(command in line for line in _command_lines(proc.pid)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{command} never ran"
        time.sleep(0.02)


def test_cli_save_and_engine_save_of_one_kernel(
    store: SnapshotStore, kernel: KernelHandle, tmp_path: Path, cli_in_background: CliStarter
):
    kernel.execute("counter = 0; blob = b'x' * (20 << 20)")
    criu, gate = gated(tmp_path, "dump")
    first = cli_in_background("--criu", criu, "save", "--pid", str(kernel.kernel_pid), "--json")
    try:
        _until_held(store, kernel_key(kernel.root_pid), first)
        with pytest.raises(Busy) as err:
            run(SnapshotEngine(store).save(SaveTarget(pid=kernel.root_pid)))
    finally:
        gate.touch()
    assert err.value.step == "preflight"
    assert f"kernel pid {kernel.kernel_pid} is busy: pid {first.pid}" in err.value.message
    out, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    assert [s.id for s in store.list()] == [json.loads(out)["id"]]
    assert kernel.execute("counter += 1; print(counter)").strip() == "1"


def test_two_saves_under_one_name(
    store: SnapshotStore, kernel: KernelHandle, tmp_path: Path, cli_in_background: CliStarter
):
    other = start_kernel()
    criu, gate = gated(tmp_path, "dump")
    try:
        first = cli_in_background(
            "--criu", criu, "save", "--pid", str(kernel.kernel_pid), "--name", "mine", "--json",
        )
        try:
            _until_held(store, name_key("mine"), first)
            with pytest.raises(Busy, match="the snapshot name 'mine' is busy"):
                run(SnapshotEngine(store).save(SaveTarget(pid=other.root_pid), name="mine"))
        finally:
            gate.touch()
        _, stderr = first.communicate(timeout=120)
        assert first.returncode == 0, stderr
        # Once committed, the name is taken for good.
        with pytest.raises(SnapshotError, match="'mine' exists already"):
            run(SnapshotEngine(store).save(SaveTarget(pid=other.root_pid), name="mine"))
        assert [s.name for s in store.list()] == ["mine"]
        assert other.execute("print(1 + 1)").strip() == "2"
    finally:
        stop_kernel(other)


def test_cli_rm_during_a_restore(
    store: SnapshotStore, kernel: KernelHandle, tmp_path: Path, restored: RestoredTrees
):
    kernel.execute("state = 'kept'")
    snapshot = run(SnapshotEngine(store).save(SaveTarget(pid=kernel.root_pid), stop=True))
    # criu restores while the digests are checked: it waits until the CLI's rm has ended.
    criu, gate = gated(tmp_path, "restore")
    engine = SnapshotEngine(store, CriuRunner(criu))

    async def restore_while_deleting() -> subprocess.CompletedProcess[str]:
        verifying = asyncio.Event()  # reported with the snapshot's lock held
        restoring = asyncio.ensure_future(
            engine.restore(snapshot.id, lambda p: verifying.set())
        )
        try:
            await verifying.wait()
            rm = await asyncio.to_thread(cli, store.root, "rm", snapshot.id, check=False)
        finally:
            gate.touch()
        back = await restoring
        restored.connect(back.connection_info, back.pid)
        return rm

    rm = run(restore_while_deleting())
    assert rm.returncode == 2
    message = " ".join(rm.stderr.split())  # one message, however the terminal wraps it
    assert message.startswith("error: delete failed: snapshot") and message.count("error") == 1
    assert "is busy: pid" in message and "(restore: python" in message
    store.verify(store.get(snapshot.id))


def test_delete_during_a_cli_restore(
    store: SnapshotStore, kernel: KernelHandle, tmp_path: Path, cli_in_background: CliStarter
):
    snapshot = run(SnapshotEngine(store).save(SaveTarget(pid=kernel.root_pid), stop=True))
    criu, gate = gated(tmp_path, "restore")
    restoring = cli_in_background("--criu", criu, "restore", snapshot.id, "--json")
    try:
        _until_held(store, snapshot_key(snapshot.id), restoring)
        with pytest.raises(Busy, match="is busy"):
            store.delete(snapshot.id)
    finally:
        gate.touch()
    out, stderr = restoring.communicate(timeout=120)
    assert restoring.returncode == 0, stderr
    result = json.loads(out)
    try:
        assert procfs.tree_alive(result["pid"])
        store.verify(store.get(snapshot.id))
    finally:
        procfs.kill_tree(result["pid"])


def test_kept_criu_logs_have_unique_names(store: SnapshotStore, tmp_path: Path):
    log = tmp_path / "dump.log"
    log.write_text("(00.000001) Error (criu/x.c:1): boom\n")
    engine = SnapshotEngine(store)
    kept = {engine._keep_log(log, "dump") for _ in range(3)}
    assert len(kept) == 3 and all(p is not None and p.stat().st_mode & 0o777 == 0o600
                                  for p in kept)


@pytest.mark.parametrize("stop", [False, True], ids=["keep-running", "stop"])
def test_ctrl_c_during_a_cli_save(
    store: SnapshotStore, kernel: KernelHandle, tmp_path: Path, stop: bool,
    cli_in_background: CliStarter,
):
    """Ctrl-C waits for criu, then rolls back; a stopping dump that completed is kept."""
    kernel.execute("counter = 0; blob = b'x' * (20 << 20)")
    saving = cli_in_background(
        "--criu", _slow_criu(tmp_path, "dump", 2.0), "save",
        "--pid", str(kernel.kernel_pid), "--name", "interrupted", *(["--stop"] if stop else []),
    )
    # Into the dump, where criu's wrapper sleeps 2 s; not its `--version` call at preflight.
    _until_running(saving, "criu-slow-dump dump")
    saving.send_signal(signal.SIGINT)
    out, stderr = saving.communicate(timeout=120)
    assert "Traceback" not in stderr
    if stop:
        assert saving.returncode == 0, stderr
        assert out.startswith("saved interrupted")
        assert [s.name for s in store.list()] == ["interrupted"]
        store.verify(store.get("interrupted"))
    else:
        assert saving.returncode == 130
        assert " ".join(stderr.split()) == (
            "interrupted: stopped at a safe point and rolled back; the kernel keeps running"
        )
        assert store.list() == []
        assert kernel.execute("counter += 1; print(counter)").strip() == "1"
    assert [p.name for p in store.root.iterdir() if p.name.startswith(".")] == []
