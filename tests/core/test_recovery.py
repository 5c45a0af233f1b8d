"""Recovery of a store on its own: what a server start does with each kind of leftover.

Scenarios as data: each row builds one ``.partial-ID`` as a save at some point would leave
it, and says what recovery must do with it. A complete image is never deleted.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from jupyter_gpu_snapshot.core.locks import snapshot_key
from jupyter_gpu_snapshot.core.recovery import WORK_LOCK, clean_work_dirs, recover_store
from jupyter_gpu_snapshot.core.store import DUMP_COMPLETE_FILE, SnapshotStore
from jupyter_gpu_snapshot.core.store.snapshot import new_snapshot_id
from jupyter_gpu_snapshot.core.store.staging import MEMORY_ASSEMBLY_PREFIX


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process that stands in for a kernel tree's root."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _draft(store: SnapshotStore, partial: Path, root_pid: int, started: float | None) -> None:
    snapshot_id = partial.name.removeprefix(".partial-")
    kernel = {"root_pid": root_pid, "root_started": started}
    store.write_draft(partial, _manifest(snapshot_id, kernel))


def _manifest(snapshot_id: str, kernel: dict[str, Any]) -> dict[str, Any]:
    """A manifest as a save writes it (all a signed one needs but its digests)."""
    connection = {
        "transport": "tcp", "ip": "127.0.0.1", "key": "k" * 36,
        "signature_scheme": "hmac-sha256", "shell_port": 50001, "iopub_port": 50002,
        "stdin_port": 50003, "control_port": 50004, "hb_port": 50005,
    }
    return {
        "id": snapshot_id, "name": f"k-{snapshot_id}", "created": time.time(),
        "kernel": {"name": "python3-snapshot", "connection_info": connection,
                   "log_files": [], **kernel},
    }


@dataclass(frozen=True)
class Leftover:
    """One partial as a killed save leaves it."""

    id: str
    draft: bool
    complete: bool  # criu's post-dump action ran
    kernel: str  # "alive", "gone", or "reused" (its pid now names another process)
    outcome: str  # "committed", "removed" or "kept"


LEFTOVERS = [
    Leftover("before-any-dump", draft=False, complete=False, kernel="alive", outcome="removed"),
    Leftover("dump-cut-kernel-alive", draft=True, complete=False, kernel="alive",
             outcome="removed"),
    Leftover("dump-cut-kernel-gone", draft=True, complete=False, kernel="gone", outcome="kept"),
    Leftover("dump-cut-pid-reused", draft=True, complete=False, kernel="reused", outcome="kept"),
    Leftover("dump-complete-kernel-gone", draft=True, complete=True, kernel="gone",
             outcome="committed"),
    Leftover("dump-complete-kernel-alive", draft=True, complete=True, kernel="alive",
             outcome="committed"),
]


@pytest.mark.parametrize("row", LEFTOVERS, ids=[r.id for r in LEFTOVERS])
def test_leftover(row: Leftover, tmp_path: Path, sleeper: subprocess.Popen[bytes]):
    store = SnapshotStore(tmp_path / "s")
    partial = store.begin(new_snapshot_id())
    (partial / "pages-1.img").write_bytes(b"p" * 4096)
    root = psutil.Process(sleeper.pid)
    root_pid, started = {
        "alive": (root.pid, root.create_time()),
        "gone": (2**22 + 1, 1.0),  # above pid_max: no such process
        "reused": (root.pid, root.create_time() - 100),
    }[row.kernel]
    if row.draft:
        _draft(store, partial, root_pid, started)
    if row.complete:
        (partial / DUMP_COMPLETE_FILE).touch()

    report = recover_store(store)

    listed = store.list()
    if row.outcome == "committed":
        assert [s.id for s in report.committed] == [s.id for s in listed]
        assert listed[0].manifest["recovered"] is True and "verified" not in listed[0].manifest
        assert sorted(listed[0].manifest["files"]) == ["pages-1.img"]
        store.verify(listed[0])
    elif row.outcome == "removed":
        assert report.removed == [partial] and listed == []
    else:
        (kept, why), = report.kept
        assert kept.name.startswith(".unfinished-") and (kept / "pages-1.img").is_file()
        assert "no longer runs" in why and listed == []
    assert not partial.exists()
    assert sleeper.poll() is None


def test_a_save_in_progress_is_left_alone(tmp_path: Path, sleeper: subprocess.Popen[bytes]):
    store = SnapshotStore(tmp_path / "s")
    snapshot_id = new_snapshot_id()
    with store.locks.hold(snapshot_key(snapshot_id), "a save", "test"):
        partial = store.begin(snapshot_id)
        _draft(store, partial, 2**22 + 1, 1.0)
        report = recover_store(store)
    assert report.removed == report.kept == report.committed == [] and partial.is_dir()


def test_a_partial_criu_still_writes_is_left_alone(tmp_path: Path):
    """The saver died, but criu (in its own session) has not finished."""
    store = SnapshotStore(tmp_path / "s")
    partial = store.begin(new_snapshot_id())
    _draft(store, partial, 2**22 + 1, 1.0)
    criu = subprocess.Popen(
        ["criu", "-c", "import time; time.sleep(60)", "dump", "-D", str(partial)],
        executable=sys.executable,
    )
    try:
        report = recover_store(store)
    finally:
        criu.kill()
        criu.wait()
    assert report.kept == report.removed == [] and partial.is_dir()


def test_ownership_holds_until_the_rename(tmp_path: Path):
    """A server starting while another process hashes its commit deletes nothing."""
    store = SnapshotStore(tmp_path / "s")
    snapshot_id = new_snapshot_id()
    cleaned: list[Any] = []

    def clean_meanwhile(done: int, total: int) -> None:
        if not cleaned:
            cleaned.append(recover_store(store).removed)

    with store.locks.hold(snapshot_key(snapshot_id), "a save", "test"):
        partial = store.begin(snapshot_id)
        (partial / "pages-1.img").write_bytes(b"x" * (3 << 20))
        store.write_draft(partial, _manifest(snapshot_id, {}))
        store.commit(partial, _manifest(snapshot_id, {}),
                     progress=clean_meanwhile)
    assert cleaned == [[]]
    assert [s.id for s in store.list()] == [snapshot_id]
    assert sorted(p.name for p in store.get(snapshot_id).path.iterdir()) == [
        "manifest.json", "pages-1.img.chunks"
    ]


@pytest.mark.parametrize(
    "setup, removed",
    [
        (lambda d: (d / WORK_LOCK).touch(), True),  # its saver died
        (lambda d: None, False),  # no lock file: maybe a save just starting
    ],
    ids=["dead-saver", "no-lock-file"],
)
@pytest.mark.parametrize("prefix", ["jupyter-gpu-snapshot-dump-", MEMORY_ASSEMBLY_PREFIX])
def test_leaked_work_dirs(tmp_path: Path, setup: Callable[[Path], None], removed: bool,
                          prefix: str):
    """criu's work directories, and images assembled in memory for a restore, of a process
    that died."""
    work = tmp_path / f"{prefix}abc123"
    work.mkdir()
    (work / "dump.log").write_text("log")
    setup(work)
    other = tmp_path / "someone-elses-dir"
    other.mkdir()
    assert clean_work_dirs(tmp_path) == ([work] if removed else [])
    assert work.exists() != removed and other.exists()


def test_a_work_dir_in_use_is_kept(tmp_path: Path):
    from jupyter_gpu_snapshot.core.locks import try_lock

    work = tmp_path / "jupyter-gpu-snapshot-restore-xyz"
    work.mkdir()
    held = try_lock(work / WORK_LOCK, "restore")
    assert held is not None
    try:
        assert clean_work_dirs(tmp_path) == [] and work.exists()
    finally:
        held.release()
