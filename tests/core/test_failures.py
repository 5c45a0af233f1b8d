"""The failure contract: whatever fails, one clear error naming the step and the cause,
the kernel alive and answering, nothing partial listed, earlier snapshots untouched."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.criu import CriuRunner
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.errors import NotReady, SnapshotError
from jupyter_gpu_snapshot.core.hooks import SaveContext, SaveTarget, SnapshotHook
from jupyter_gpu_snapshot.core.store import SnapshotStore
from testkit.criu_wrappers import install, kill_while_writing_pages
from tests.conftest import KernelHandle, run, start_kernel, stop_kernel


def _target(kernel: KernelHandle) -> SaveTarget:
    return SaveTarget(pid=kernel.root_pid, connection_info=kernel.km.get_connection_info())


def _assert_contract(kernel: KernelHandle, store: SnapshotStore, listed_before: list[str]) -> None:
    assert procfs.tree_alive(kernel.root_pid)
    assert kernel.execute("counter += 1; print(counter)").strip().isdigit()
    assert [s.id for s in store.list()] == listed_before
    assert not any(p.name.startswith(".partial-") for p in store.root.iterdir())


@pytest.fixture
def busy_kernel(kernel: KernelHandle) -> KernelHandle:
    kernel.execute("import numpy as np; counter = 0; data = np.ones(20_000_000)")
    return kernel


def test_criu_missing(store, busy_kernel):
    engine = SnapshotEngine(store, CriuRunner("/nonexistent/criu"))
    with pytest.raises(NotReady) as err:
        run(engine.save(_target(busy_kernel)))
    assert err.value.step == "preflight" and "criu not found" in err.value.message
    store.ensure()
    _assert_contract(busy_kernel, store, [])


def test_criu_too_old(store, busy_kernel, tmp_path):
    old = install(tmp_path, 'echo "Version: 3.17.1"\n')
    engine = SnapshotEngine(store, CriuRunner(old))
    with pytest.raises(NotReady, match=r"criu 3\.17\.1 is too old"):
        run(engine.save(_target(busy_kernel)))
    store.ensure()
    _assert_contract(busy_kernel, store, [])


def test_criu_killed_mid_dump(store, busy_kernel, tmp_path):
    good = SnapshotEngine(store)
    earlier = run(good.save(_target(busy_kernel), name="earlier"))
    killer = install(tmp_path, kill_while_writing_pages())
    engine = SnapshotEngine(store, CriuRunner(killer))
    with pytest.raises(SnapshotError) as err:
        run(engine.save(_target(busy_kernel), name="doomed"))
    assert err.value.step == "dump"
    assert "killed by signal 9" in err.value.message
    assert err.value.log_path is not None and err.value.log_path.exists()
    _assert_contract(busy_kernel, store, [earlier.id])
    # The earlier snapshot is intact: it still verifies.
    store.verify(store.get("earlier"))


def test_criu_error_is_explained_from_its_log(store, busy_kernel, tmp_path):
    failing = install(
        tmp_path,
        'case "$1" in --version) echo "Version: 4.2.1";; '
        'dump) while [ "$1" != "-W" ]; do shift; done; '
        'echo "(00.012) Error (criu/cr-dump.c:1): No space left on device" > "$2/dump.log"; '
        "exit 1;; esac\n",
    )
    engine = SnapshotEngine(store, CriuRunner(failing))
    with pytest.raises(SnapshotError) as err:
        run(engine.save(_target(busy_kernel)))
    assert err.value.step == "dump"
    assert "disk holding the snapshot store is full" in err.value.message
    _assert_contract(busy_kernel, store, [])


@pytest.fixture
def small_fs(tmp_path: Path):
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_too_small_is_refused_before_freezing(small_fs, busy_kernel):
    store = SnapshotStore(small_fs / "store")
    engine = SnapshotEngine(store)
    with pytest.raises(SnapshotError) as err:
        run(engine.save(_target(busy_kernel)))
    assert err.value.step == "preflight" and "not enough free disk" in err.value.message
    _assert_contract(busy_kernel, store, [])


def test_disk_filling_during_dump(small_fs, busy_kernel, monkeypatch):
    # The disk fills while the dump runs (another writer raced us past the preflight).
    store = SnapshotStore(small_fs / "store")
    monkeypatch.setattr(SnapshotStore, "free_bytes", lambda self: 1 << 40)
    engine = SnapshotEngine(store)
    with pytest.raises(SnapshotError) as err:
        run(engine.save(_target(busy_kernel)))
    assert err.value.step in ("dump", "commit")
    assert "full" in err.value.message or "No space" in err.value.message
    _assert_contract(busy_kernel, store, [])


class FillsTheDiskAfterTheDump(SnapshotHook):
    """Takes all but a sliver of the store's file system once the dump is written: the
    commit, which packs the image's new pages into the store, then runs out of room."""

    def __init__(self, filler: Path) -> None:
        self.filler = filler

    async def after_dump(self, ctx: SaveContext, error: BaseException | None) -> None:
        if error is None:
            free = shutil.disk_usage(self.filler.parent).free
            await asyncio.to_thread(
                subprocess.run, ["fallocate", "-l", str(free - (1 << 20)), str(self.filler)],
                check=True)


@pytest.fixture
def roomy_fs(tmp_path: Path):
    """A file system with room for a snapshot and the next one's dump, filled at will."""
    mount = tmp_path / "roomy"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_filling_during_commit_names_the_full_disk(roomy_fs, kernel):
    """The dump fits, the disk fills before the commit has packed the new pages: the error
    names the full disk (and not what closing the page buffer said after it)."""
    store = SnapshotStore(roomy_fs / "store")
    kernel.execute("import os; counter = 0")
    earlier = run(SnapshotEngine(store).save(_target(kernel), name="earlier"))
    # Pages no snapshot holds yet: the commit has tens of MiB to write.
    kernel.execute("noise = os.urandom(64 << 20)")
    filler = roomy_fs / "filler"
    engine = SnapshotEngine(store, hooks=[FillsTheDiskAfterTheDump(filler)])
    with pytest.raises(SnapshotError) as err:
        run(engine.save(_target(kernel)))
    failed = err.value
    assert failed.step == "commit", failed
    assert f"could not write the snapshot to {store.root}: its disk is full" in failed.cause
    assert "No space left on device" in failed.cause, failed
    assert failed.hint and "free space" in failed.hint, failed
    assert "BufferError" not in str(failed)
    _assert_contract(kernel, store, [earlier.id])
    assert not [p for p in (store.root / "chunks").iterdir() if p.name.endswith(".pack")
                and not (p.parent / (p.name[:-len(".pack")] + ".ids")).exists()]
    filler.unlink()
    store.verify(store.get("earlier"))


def test_kernel_not_snapshot_ready(store):
    plain = start_kernel("python3")
    try:
        pid = plain.km.provisioner.process.pid
        with pytest.raises(NotReady) as err:
            run(SnapshotEngine(store).save(SaveTarget(pid=pid)))
        message = err.value.message
        assert "not snapshot-ready" in message and "python3-snapshot" in message
        assert "1" in plain.execute("print(1)")
    finally:
        stop_kernel(plain)


def test_unknown_pid(store):
    with pytest.raises(SnapshotError, match="no process with pid"):
        run(SnapshotEngine(store).save(SaveTarget(pid=2**22 + 12345)))


class RecordingHook(SnapshotHook):
    """Notes each call the engine makes to it, with the error it was told of."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def preflight_save(self, ctx: SaveContext) -> None:
        self.calls.append("preflight")

    async def before_dump(self, ctx: SaveContext) -> None:
        self.calls.append("before")

    async def after_dump(self, ctx: SaveContext, error: BaseException | None) -> None:
        self.calls.append(f"after: {error}")


class RefusingHook(SnapshotHook):
    """Refuses the save at ``step``: in its preflight, or right before the dump."""

    def __init__(self, step: str, cause: str) -> None:
        self.refusal = SnapshotError(step, cause)

    async def preflight_save(self, ctx: SaveContext) -> None:
        if self.refusal.step == "preflight":
            raise self.refusal

    async def before_dump(self, ctx: SaveContext) -> None:
        raise self.refusal


# A hook refusing after another hook's preflight passed: that one is told how the save
# ended (the GPU layer's preflight notes the save's CUDA processes, and must let go).
HOOK_REFUSALS = {
    "in preflight": (
        RefusingHook("preflight", "the GPU is in exclusive mode"),
        ["preflight", "after: preflight failed: the GPU is in exclusive mode"],
    ),
    "before the dump": (
        RefusingHook("suspend", "CUDA lock timed out after 0.1 s"),
        ["preflight", "before", "after: suspend failed: CUDA lock timed out after 0.1 s"],
    ),
}


@pytest.mark.parametrize("refusal", HOOK_REFUSALS)
def test_a_hook_refusing_rolls_back_and_the_others_are_told(
    store: SnapshotStore, busy_kernel: KernelHandle, refusal: str
) -> None:
    refusing, calls = HOOK_REFUSALS[refusal]
    recorder = RecordingHook()
    engine = SnapshotEngine(store, hooks=[recorder, refusing])
    with pytest.raises(SnapshotError) as failed:
        run(engine.save(_target(busy_kernel)))
    assert failed.value is refusing.refusal
    assert recorder.calls == calls
    _assert_contract(busy_kernel, store, [])


def test_criu_dying_without_a_log(store, busy_kernel, tmp_path):
    silent = install(
        tmp_path,
        'case "$1" in --version) echo "Version: 4.2.1";; dump) exit 3;; esac\n',
    )
    engine = SnapshotEngine(store, CriuRunner(silent))
    with pytest.raises(SnapshotError) as err:
        run(engine.save(_target(busy_kernel)))
    assert err.value.step == "dump" and "criu exited with status 3" in err.value.message
    assert err.value.log_path is None
    _assert_contract(busy_kernel, store, [])
