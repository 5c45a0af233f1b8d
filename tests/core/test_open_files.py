"""Kernel states a CRIU image does not hold: each is warned about at the save, and a restore
that would read changed files is refused (or, by the setting, warned about).

Scenarios as data: code that sets up the state in a real kernel, what the save must say,
what happens to the files after the save, and what the restore must do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from jupyter_gpu_snapshot.core.criu import CriuRunner
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.errors import NotReady
from jupyter_gpu_snapshot.core.hooks import Progress, SaveTarget
from jupyter_gpu_snapshot.core.open_files import OpenFilesHook
from jupyter_gpu_snapshot.core.store import SnapshotStore
from tests.conftest import KernelHandle, RestoredTrees, execute, run


@dataclass(frozen=True)
class OpenFileCase:
    id: str
    setup: str  # run in the kernel; DATA is the test's directory
    warning: str | None  # a warning the save must give
    after_save: str | None  # run in the test (python) after the kernel is gone
    restore: str  # "ok", "refused", or "warned" (with changed_files="warn")
    check: str | None = None  # code whose output the restored kernel must print...
    expect: str | None = None  # ...as this


CASES = [
    OpenFileCase(
        "memmap-written-after-save",
        "import numpy as np; m = np.memmap(DATA + '/m.bin', 'uint8', 'w+', shape=4096); "
        "m[:] = 1; m.flush()",
        "mapped shared and writable",
        "Path(DATA, 'm.bin').write_bytes(b'\\x02' * 4096)",
        "refused",
    ),
    OpenFileCase(
        "memmap-written-after-save-allowed",
        "import numpy as np; m = np.memmap(DATA + '/m.bin', 'uint8', 'w+', shape=4096); "
        "m[:] = 1; m.flush()",
        "mapped shared and writable",
        "Path(DATA, 'm.bin').write_bytes(b'\\x02' * 4096)",
        "warned",
        "print(int(m[0]))",
        "2",  # what the warning is about: the file's new content shows through
    ),
    OpenFileCase(
        "read-only-file-changed-same-size",
        "Path = __import__('pathlib').Path; Path(DATA, 'r.txt').write_text('before'); "
        "f = open(DATA + '/r.txt', 'rb', buffering=0)",
        None,
        "Path(DATA, 'r.txt').write_text('after!')",
        "refused",
    ),
    OpenFileCase(
        "read-only-file-unchanged",
        "Path = __import__('pathlib').Path; Path(DATA, 'r.txt').write_text('before'); "
        "f = open(DATA + '/r.txt', 'rb', buffering=0)",
        None,
        None,
        "ok",
        "print(f.read().decode())",
        "before",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_open_file_case(
    case: OpenFileCase, store: SnapshotStore, kernel: KernelHandle, tmp_path: Path,
    restored: RestoredTrees,
):
    data = tmp_path / "data"
    data.mkdir()
    kernel.execute(f"DATA = {str(data)!r}; " + case.setup)
    messages: list[str] = []

    def progress(p: Progress) -> None:
        if p.message:
            messages.append(p.message)

    saver = SnapshotEngine(store, hooks=[OpenFilesHook()])
    snapshot = run(saver.save(SaveTarget(pid=kernel.root_pid), stop=True, progress=progress))
    warnings = snapshot.summary()["warnings"]
    if case.warning:
        assert any(case.warning in w for w in warnings), warnings
        assert any(case.warning in m for m in messages), messages
    else:
        assert warnings == []
    if case.after_save:
        exec(case.after_save, {"Path": Path, "DATA": str(data)})

    policy = "warn" if case.restore == "warned" else "refuse"
    restorer = SnapshotEngine(store, hooks=[OpenFilesHook(changed_files=policy)])
    messages.clear()
    if case.restore == "refused":
        with pytest.raises(NotReady) as err:
            run(restorer.restore(snapshot, progress))
        assert err.value.step == "preflight" and "changed since snapshot" in err.value.message
        # A notebook's user is told what to do; the server's setting is for its operator.
        assert err.value.hint == "put the files back as they were"
        assert "changed_files" in err.value.details["setting"]
        assert err.value.details["changed_files"]
        return
    back = run(restorer.restore(snapshot, progress))
    client = restored.connect(back.connection_info, back.pid)
    assert any("changed since the save" in m for m in messages) == (case.restore == "warned")
    if case.check:
        assert execute(client, case.check).strip() == case.expect


@pytest.mark.parametrize("limit, refused", [(1 << 20, True), (8 << 20, False)],
                         ids=["over-the-ghost-limit", "within-a-raised-limit"])
def test_deleted_open_file_and_the_ghost_limit(
    limit: int, refused: bool, store: SnapshotStore, kernel: KernelHandle, tmp_path: Path,
    restored: RestoredTrees,
):
    kernel.execute(
        f"import os; f = open({str(tmp_path / 'ghost.bin')!r}, 'w+b'); "
        "f.write(b'g' * (3 << 20)); f.flush(); os.unlink(f.name)"
    )
    engine = SnapshotEngine(store, CriuRunner(ghost_limit=limit), [OpenFilesHook(limit)])
    if refused:
        with pytest.raises(NotReady) as err:
            run(engine.save(SaveTarget(pid=kernel.root_pid)))
        assert "deleted file of 3.0 MiB" in err.value.message
        assert "c.GPUSnapshot.ghost_limit" in err.value.message
        assert kernel.execute("f.seek(0); print(len(f.read()))").strip() == str(3 << 20)
        return
    snapshot = run(engine.save(SaveTarget(pid=kernel.root_pid), stop=True))
    back = run(engine.restore(snapshot))
    client = restored.connect(back.connection_info, back.pid)
    assert execute(client, "f.seek(0); print(len(f.read()))").strip() == str(3 << 20)


def test_the_magic_prints_the_warnings_of_a_save():
    from jupyter_gpu_snapshot.kernel.presentation import saved_line

    summary = {"id": "20260101T000000Z-00000000", "name": "n", "created": 0, "size_bytes": 1,
               "warnings": ["2 shared memory segments in /dev/shm (psm_*, ...)"]}
    lines = saved_line(summary, {}).splitlines()
    assert lines[0].startswith("Saved snapshot") and lines[1] == (
        "Warning: 2 shared memory segments in /dev/shm (psm_*, ...)"
    )


def test_anonymous_memory_files_are_no_ghosts(
    store: SnapshotStore, kernel: KernelHandle, restored: RestoredTrees
):
    """memfd files (the CUDA driver uses them) show as deleted, but criu dumps them whole."""
    kernel.execute("import os; fd = os.memfd_create('big'); os.write(fd, b'm' * (3 << 20))")
    engine = SnapshotEngine(store, CriuRunner(ghost_limit=1 << 20), [OpenFilesHook(1 << 20)])
    snapshot = run(engine.save(SaveTarget(pid=kernel.root_pid), stop=True))
    assert snapshot.manifest["open_files"] == [] and snapshot.manifest["warnings"] == []
    back = run(engine.restore(snapshot))
    client = restored.connect(back.connection_info, back.pid)
    assert execute(client, "print(os.fstat(fd).st_size)").strip() == str(3 << 20)


def test_the_checks_open_a_kernels_files_only_through_the_engines_file_access(tmp_path):
    """The node agent's checks read a user's files as that user: every file is opened by
    the engine's ``FileAccess`` (the agent's opens as the user), named as what it is, and
    what cannot be opened reads as gone; a FIFO there is never read."""
    from jupyter_gpu_snapshot.core.file_access import OwnFiles
    from jupyter_gpu_snapshot.core.open_files import changes, describe_file
    from jupyter_gpu_snapshot.core.user_paths import UserPath

    class Recording(OwnFiles):
        def __init__(self) -> None:
            self.asked: list[tuple[str, UserPath]] = []

        def open(self, path: str, flags: int, what: UserPath) -> int:
            self.asked.append((path, what))
            if path.endswith("refused"):
                raise PermissionError(13, "Permission denied", path)
            return super().open(path, flags, what)

    (tmp_path / "data").write_bytes(b"theirs")
    os.mkfifo(tmp_path / "fifo")
    files = Recording()
    found = describe_file(str(tmp_path / "data"), files)
    assert found is not None and found["size"] == 6
    assert describe_file(str(tmp_path / "refused"), files) is None
    fifo = describe_file(str(tmp_path / "fifo"), files)
    assert fifo is not None and "sha256" not in fifo
    assert changes([found], files) == []
    assert files.asked == [(str(tmp_path / name), UserPath.OPEN_FILE)
                           for name in ("data", "refused", "fifo", "data")]



def test_a_removed_executable_is_named_from_its_link_alone(tmp_path, monkeypatch):
    """A kernel's program, removed since it started: its path is a path of the kernel's
    user, so it is named from /proc's link and never looked up (psutil's ``exe`` stats it)."""
    import shutil
    import subprocess

    from jupyter_gpu_snapshot.core import procfs

    program = tmp_path / "program"
    shutil.copy("/bin/sleep", program)
    process = subprocess.Popen([str(program), "60"])
    try:
        program.unlink()
        looked_up: list[str] = []
        real_stat = os.stat

        def stat(path, *args, **kwargs):
            if not str(path).startswith("/proc/"):
                looked_up.append(str(path))
            return real_stat(path, *args, **kwargs)

        monkeypatch.setattr(os, "stat", stat)
        assert procfs.executable(process.pid) == f"{program} (deleted)"
        assert looked_up == []
    finally:
        process.kill()
        process.wait()
