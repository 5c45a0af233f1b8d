"""The page images read while criu writes them (``core/store/packs/follower.py``), so that a commit
only looks the pages up: the ids and digests it hands on must be those a commit computes
from the finished files, a follower that fails or falls behind must leave the commit to read
the images itself, and a save of a real kernel must restore through what it followed.

CI's machines have two cores, where the follower does not start (it needs cores to spare);
these tests start it with one worker wherever they run.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import blake3
import psutil
import pytest

from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.locks import snapshot_key
from jupyter_gpu_snapshot.core.store import SnapshotStore, packs
from jupyter_gpu_snapshot.core.store.packs import id_workers
from jupyter_gpu_snapshot.launch.liveness import kernel_answers
from tests.conftest import run
from tests.core.store.packs.test_page_store import (
    IMAGE,
    assembled,
    commit,
    make_store,
    manifest_of,
    pages,
)
from tests.core.store.test_streamer import STATE, _same_state, _save

# Small steps, so that a few MiB make many: the follower reads a step once criu wrote it.
STEP = 256 << 10


@pytest.fixture(autouse=True)
def small_steps_and_one_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(id_workers, "STEP", STEP)
    monkeypatch.setattr(id_workers, "MIN_CORES_FOR_WORKERS", 1)


def _image(shared: list[bytes], seed: int) -> bytes:
    """Pages a store has already (``shared``), new pages and pages of zeros, interleaved."""
    fresh = pages(len(shared), seed)
    out: list[bytes] = []
    for i, (old, new) in enumerate(zip(shared, fresh, strict=True)):
        out.append(old if i % 3 else new)
        if i % 5 == 0:
            out.append(bytes(packs.PAGE))
    return b"".join(out)


def _write_as_criu(path: Path, data: bytes, then: bytes | None = None) -> threading.Thread:
    """A thread that writes ``data`` into ``path`` from its start to its end, a few pages at
    a time, as criu writes a pages image; ``then``: what it leaves there at the end."""

    def write() -> None:
        with open(path, "wb", buffering=0) as f:
            for start in range(0, len(data), 37 * packs.PAGE):
                f.write(data[start:start + 37 * packs.PAGE])
                time.sleep(0.03)
        if then is not None:
            path.write_bytes(then)

    thread = threading.Thread(target=write)
    thread.start()
    return thread


def _dump_followed(store: SnapshotStore, files: dict[str, bytes],
                   then: dict[str, bytes] | None = None):
    """A save's partial directory filled as criu fills it while a follower reads it; the
    snapshot committed with what the follower handed on, and that."""
    from jupyter_gpu_snapshot.core.store.snapshot import new_snapshot_id

    snapshot_id = new_snapshot_id()
    partial = store.begin(snapshot_id)
    manifest = manifest_of(store, snapshot_id, f"n-{snapshot_id[-8:]}")
    store.write_draft(partial, manifest)
    follower = store.follow_dump(partial)
    assert follower is not None
    writers = [_write_as_criu(partial / name, data, (then or {}).get(name))
               for name, data in files.items()]
    for writer in writers:
        writer.join()
    # What it had read before criu ended: it follows, it does not wait for the end.
    read_while_written = {name: f.offset for name, f in follower.files.items()}
    followed = follower.finish()
    with store.locks.hold(snapshot_key(snapshot_id), "test", "test"):
        return store.commit(partial, manifest, followed=followed), followed, read_while_written


def test_what_the_follower_read_is_what_the_commit_would_have_computed(tmp_path: Path):
    store = make_store(tmp_path)
    shared = pages(300, seed=1)
    commit(store, {IMAGE: b"".join(shared)})
    before = sum(p.stat().st_size for p in (store.root / packs.CHUNKS_DIR).glob("*.pack"))
    data = _image(shared, seed=2)
    small = os.urandom(3 * packs.PAGE)

    snapshot, followed, read_while_written = _dump_followed(
        store, {IMAGE: data, "core-1.img": small})

    assert read_while_written[IMAGE] >= STEP, read_while_written
    assert set(followed) == {IMAGE}  # small files are digested whole by the commit
    key = store.key.derive(packs.ID_CONTEXT)
    ids, zero = packs.page_ids(data, key)
    assert followed[IMAGE].ids.tobytes() == ids.tobytes()
    assert followed[IMAGE].digest == blake3.blake3(data).hexdigest()
    assert snapshot.manifest["files"][IMAGE]["digest"] == followed[IMAGE].digest
    # Only the new pages went to the packs: a third of them, no zeros, none twice.
    after = sum(p.stat().st_size for p in (store.root / packs.CHUNKS_DIR).glob("*.pack"))
    new = {data[i:i + packs.PAGE] for i in range(0, len(data), packs.PAGE)} - set(shared)
    new.discard(bytes(packs.PAGE))
    assert after - before == len(new) * packs.PAGE
    assert snapshot.manifest["stored"]["zero_page_bytes"] == int(zero.sum()) * packs.PAGE
    # And the snapshot reads back as the bytes written.
    assert assembled(store, snapshot) == {IMAGE: data, "core-1.img": small}
    store.verify(store.reload(snapshot))


def test_a_file_that_changed_behind_the_follower_is_read_again_by_the_commit(
    tmp_path: Path,
):
    store = make_store(tmp_path)
    snapshot_id = "20261127T000000Z-0c0ffee0"
    partial = store.begin(snapshot_id)
    manifest = manifest_of(store, snapshot_id, "changed")
    store.write_draft(partial, manifest)
    follower = store.follow_dump(partial)
    assert follower is not None
    data = b"".join(pages(200, seed=3))
    _write_as_criu(partial / IMAGE, data).join()
    deadline = time.monotonic() + 30
    while IMAGE not in follower.files or follower.files[IMAGE].offset < len(data) - STEP:
        assert time.monotonic() < deadline, "the follower did not read the image"
        time.sleep(0.01)
    # Replaced by a shorter file once read: what the follower read no longer fits it.
    final = b"".join(pages(120, seed=4))
    (partial / IMAGE).write_bytes(final)
    followed = follower.finish()
    # Either it saw the file shrink (and handed nothing on) or what it hands on is too long.
    assert IMAGE not in followed or followed[IMAGE].size != len(final)
    with store.locks.hold(snapshot_key(snapshot_id), "test", "test"):
        snapshot = store.commit(partial, manifest, followed=followed)
    assert snapshot.manifest["files"][IMAGE]["digest"] == blake3.blake3(final).hexdigest()
    assert assembled(store, snapshot) == {IMAGE: final}


def test_a_follower_stopped_by_a_failed_dump_leaves_no_worker_behind(tmp_path: Path):
    store = make_store(tmp_path)
    partial = store.begin("20261127T000000Z-0badf00d")
    follower = store.follow_dump(partial)
    assert follower is not None
    writer = _write_as_criu(partial / IMAGE, b"".join(pages(100, seed=5)))
    writer.join()
    # Its workers, not multiprocessing's resource tracker, which lives as long as we do.
    workers = [p for p in psutil.Process().children(recursive=True)
               if "spawn_main" in " ".join(p.cmdline())]
    assert workers, "the follower starts its workers before the pause"
    follower.cancel()
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, alive


def test_a_real_kernel_saved_while_followed_restores_bitwise(tmp_path: Path, kernel, restored):
    store = SnapshotStore(tmp_path / "store")
    engine = SnapshotEngine(store, kernel_answers=kernel_answers)
    expected = kernel.execute(STATE).strip()
    snap = _save(engine, kernel, "followed")
    # The follower's end came after criu's; the commit used what it read.
    assert "follow_end" in snap.manifest["timings"]
    largest = max(snap.manifest["files"].items(), key=lambda item: item[1]["size"])
    assert "chunks" in largest[1] and largest[1]["size"] >= 96 << 20

    back = run(engine.restore(snap.id))
    _same_state(restored.connect(back.connection_info, back.pid), expected)


def test_the_follower_does_not_start_without_cores_to_spare(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(id_workers, "MIN_CORES_FOR_WORKERS", len(os.sched_getaffinity(0)) + 1)
    store = make_store(tmp_path)
    assert store.follow_dump(store.begin("20261127T000000Z-0badf00e")) is None
