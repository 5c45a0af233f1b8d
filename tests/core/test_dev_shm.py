"""POSIX semaphores and shared memory in /dev/shm, as kernels using multiprocessing (and torch
DataLoader workers) hold them: what a save says about them and what a restore then does,
with real kernels and real CRIU.

- Semaphores of the 'fork' start method (DataLoader's default on Linux) are unlinked at
  once: criu carries them in the image, so the save warns of nothing and the restored
  kernel and worker go on sharing them, with no file in /dev/shm.
- Named segments (multiprocessing.shared_memory) are not in the image: one warning for
  all of them; the restore works while the files exist and fails once they are gone.
- Semaphores of the 'spawn' start method: criu cannot dump them; the save is refused
  before the kernel is touched, and works once the kernel lets go of them.
- An unlinked segment larger than the ghost limit (torch shares tensors so): refused before
  the kernel is touched; under a raised limit it is carried whole.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.criu import CriuRunner
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.errors import NotReady, SnapshotError
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.open_files import OpenFilesHook, inspect_files
from jupyter_gpu_snapshot.core.store import SnapshotStore
from tests.conftest import KernelHandle, RestoredTrees, execute, run

# A worker as a DataLoader's: it takes work from one queue, answers on another, and shares
# a semaphore and a lock with the kernel. Semaphore + Lock + two queues (3 each): 8.
FORK_WORKER = """
import multiprocessing as mp
ctx = mp.get_context("fork")
def work(sem, lock, todo, done):
    while (item := todo.get()) is not None:
        with lock:
            sem.acquire()
            done.put((item, sem.get_value()))
sem, lock, todo, done = ctx.Semaphore(5), ctx.Lock(), ctx.Queue(), ctx.Queue()
worker = ctx.Process(target=work, args=(sem, lock, todo, done), daemon=True)
worker.start()
todo.put(1)
print(done.get(timeout=60))
"""


def _engine(store: SnapshotStore) -> SnapshotEngine:
    return SnapshotEngine(store, hooks=[OpenFilesHook()])


def test_fork_semaphores_are_carried_in_the_image(
    store: SnapshotStore, kernel: KernelHandle, restored: RestoredTrees
):
    assert kernel.execute(FORK_WORKER).strip() == "(1, 4)"
    shm = inspect_files(kernel.root_pid).shared_memory
    assert len(shm.unlinked) == 8 and not shm.named and not shm.renamed
    assert all(len(f.pids) == 2 for f in shm.unlinked)  # the kernel and its worker

    snapshot = run(_engine(store).save(SaveTarget(pid=kernel.root_pid), stop=True))
    assert snapshot.manifest["warnings"] == []
    assert not procfs.tree_alive(kernel.root_pid)
    # Nothing of them is left in /dev/shm: what the restore gets is the image's copy.
    back = run(_engine(store).restore(snapshot))
    client = restored.connect(back.connection_info, back.pid)
    assert execute(client, "todo.put(2); print(done.get(timeout=60))").strip() == "(2, 3)"
    # The kernel sees what the worker did: the two still share the semaphore.
    assert execute(client, "print(sem.get_value(), worker.is_alive())").strip() == "3 True"


@pytest.fixture
def segments() -> Iterator[list[str]]:
    """Names of shared memory segments a test made; they outlive its kernels."""
    names: list[str] = []
    yield names
    for name in names:
        Path("/dev/shm", name).unlink(missing_ok=True)


def test_named_segments_warn_once_and_restore_only_while_they_exist(
    store: SnapshotStore, kernel: KernelHandle, restored: RestoredTrees, segments: list[str]
):
    names = kernel.execute("""
        import multiprocessing as mp
        from multiprocessing import shared_memory
        ctx = mp.get_context("fork")
        a = shared_memory.SharedMemory(create=True, size=4096)
        b = shared_memory.SharedMemory(create=True, size=1 << 20)
        a.buf[0] = 7
        def touch(todo, done):
            while (value := todo.get()) is not None:
                a.buf[1] = value
                done.put(bytes(a.buf[:2]))
        todo, done = ctx.Queue(), ctx.Queue()
        worker = ctx.Process(target=touch, args=(todo, done), daemon=True)
        worker.start()
        todo.put(1)
        assert done.get(timeout=60) == bytes([7, 1])
        print(a.name, b.name)
    """).split()
    segments.extend(names)

    snapshot = run(_engine(store).save(SaveTarget(pid=kernel.root_pid), stop=True))
    [warning] = snapshot.manifest["warnings"]
    assert warning.startswith(
        "2 shared memory segments in /dev/shm (psm_*, multiprocessing.shared_memory) held by "
        "2 processes: the snapshot holds their names, not their content."
    ), warning
    assert "fails while any is missing" in warning and all(n in warning for n in names)
    # They outlive the kernel that the stopping save ended.
    assert all(Path("/dev/shm", n).exists() for n in names)

    back = run(_engine(store).restore(snapshot))
    client = restored.connect(back.connection_info, back.pid)
    assert execute(client, "todo.put(9); print(list(done.get(timeout=60)), a.buf[1])").strip() \
        == "[7, 9] 9"
    client.stop_channels()
    procfs.kill_tree(back.pid)

    for name in names:
        os.unlink(Path("/dev/shm", name))
    with pytest.raises(SnapshotError) as err:
        run(_engine(store).restore(snapshot))
    assert err.value.step == "restore" and "missing" in err.value.message
    assert any(name in err.value.message for name in names), err.value.message


def test_spawn_semaphores_refuse_the_save_until_the_kernel_lets_go(
    store: SnapshotStore, kernel: KernelHandle
):
    names = kernel.execute("""
        import gc, multiprocessing as mp
        ctx = mp.get_context("spawn")
        sem, lock = ctx.Semaphore(2), ctx.Lock()
        print(sem._semlock.name, lock._semlock.name)
    """).split()
    files = [Path("/dev/shm", "sem." + name.lstrip("/")) for name in names]
    try:
        assert all(f.exists() for f in files)
        with pytest.raises(NotReady) as err:
            run(_engine(store).save(SaveTarget(pid=kernel.root_pid), stop=True))
        assert err.value.step == "preflight"
        assert err.value.cause.startswith(
            "2 POSIX semaphores in /dev/shm (sem.mp-*, multiprocessing, which torch "
            "DataLoader workers use) held by 1 process"
        ), err.value.cause
        assert "criu cannot dump" in err.value.cause and "'fork' start method" in str(err.value)
        assert kernel.execute("print(sem.get_value())").strip() == "2"

        # multiprocessing unlinks a spawn semaphore's name once the object is gone.
        kernel.execute("del sem, lock; gc.collect()")
        assert not any(f.exists() for f in files)
        snapshot = run(_engine(store).save(SaveTarget(pid=kernel.root_pid)))
        assert snapshot.manifest["warnings"] == []
    finally:
        for f in files:
            f.unlink(missing_ok=True)


@pytest.mark.parametrize("limit, refused", [(1 << 20, True), (8 << 20, False)],
                         ids=["over-the-ghost-limit", "within-a-raised-limit"])
def test_unlinked_segments_count_against_the_ghost_limit(
    limit: int, refused: bool, store: SnapshotStore, kernel: KernelHandle, tmp_path: Path,
    restored: RestoredTrees,
):
    """As torch shares a tensor by file descriptor: a segment written, then unlinked."""
    name = f"/dev/shm/torch_{tmp_path.name}"
    kernel.execute(f"""
        import mmap, os
        fd = os.open({name!r}, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, 3 << 20)
        m = mmap.mmap(fd, 3 << 20)
        m[:] = b"t" * (3 << 20)
        os.unlink({name!r})
    """)
    engine = SnapshotEngine(store, CriuRunner(ghost_limit=limit), [OpenFilesHook(limit)])
    if refused:
        with pytest.raises(NotReady) as err:
            run(engine.save(SaveTarget(pid=kernel.root_pid)))
        assert err.value.step == "preflight" and f"deleted file of 3.0 MiB ({name})" in \
            err.value.message and "c.GPUSnapshot.ghost_limit" in err.value.message
        assert kernel.execute("print(m[:1], m[-1:])").strip() == "b't' b't'"
        return
    snapshot = run(engine.save(SaveTarget(pid=kernel.root_pid), stop=True))
    assert snapshot.manifest["warnings"] == []
    back = run(engine.restore(snapshot))
    client = restored.connect(back.connection_info, back.pid)
    assert execute(client, "print(m[:] == b't' * (3 << 20))").strip() == "True"
