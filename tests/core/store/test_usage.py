"""What a store takes on disk and what deleting a snapshot frees: real snapshots committed
through the store, their pages shared, then deleted to see the collector agree."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jupyter_gpu_snapshot.core.store import SnapshotStore, packs
from jupyter_gpu_snapshot.core.store.manifest import ManifestPolicy
from jupyter_gpu_snapshot.core.store.snapshot import new_snapshot_id
from jupyter_gpu_snapshot.core.store.usage import StoreUsage, store_usage
from tests.core.store.test_store import CONNECTION

PAGE = packs.PAGE
SMALL = b"c" * 1000  # kept whole: below packs.MIN_CHUNKED_BYTES


def _pages(*numbers: int) -> bytes:
    """One distinct 4 KiB page per number; 0 is a page of zeros."""
    out = np.zeros((len(numbers), PAGE // 8), np.uint64)
    out[:, 0] = numbers
    out[:, 1:] = np.array(numbers, np.uint64)[:, None] * 7 + 1
    out[np.array(numbers) == 0] = 0
    return out.tobytes()


def _store(tmp_path: Path) -> SnapshotStore:
    logs = tmp_path / "runtime" / "gpu_snapshot"
    return SnapshotStore(tmp_path / "s", tmp_path / "keys" / "signing.key",
                         ManifestPolicy(lambda: logs))


def _save(store: SnapshotStore, name: str, pages: bytes) -> str:
    """A save as the engine makes one: begin, draft, images, commit."""
    snapshot_id = new_snapshot_id()
    log = str(store.policy.kernel_log_dir()) + "/kernel-abc.log"  # type: ignore[misc]
    kernel = {"name": "python3-snapshot", "connection_info": dict(CONNECTION),
              "log_files": [log], "notebook_path": "work/n.ipynb"}
    manifest = {"id": snapshot_id, "name": name, "created": float(len(store.list()) + 1),
                "kernel": kernel}
    partial = store.begin(snapshot_id)
    store.write_draft(partial, manifest)
    (partial / "pages-1.img").write_bytes(pages)
    (partial / "core-1.img").write_bytes(SMALL)
    store.commit(partial, manifest)
    return snapshot_id


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _by_name(usage: StoreUsage) -> dict[str, dict[str, int]]:
    return {s.name: {"size": s.size_bytes, "new": s.new_bytes, "own": s.own_bytes,
                     "sole": s.sole_page_bytes, "frees": s.frees_bytes}
            for s in usage.snapshots}


def test_a_second_save_of_the_same_kernel_writes_only_its_changed_pages(tmp_path: Path):
    store = _store(tmp_path)
    first = _pages(*range(1, 301), *[0] * 100)  # 300 distinct pages, 100 of zeros
    second = _pages(*range(1, 201), *range(1001, 1101), *[0] * 100)
    a, b = _save(store, "a", first), _save(store, "b", second)

    summaries = {s["name"]: s for s in (store.get(a).summary(), store.get(b).summary())}
    recipe = 400 * packs.ID_BYTES
    assert summaries["a"]["size_bytes"] == len(first) + len(SMALL)
    assert summaries["a"]["new_bytes"] == len(SMALL) + 300 * PAGE + recipe
    assert summaries["b"]["new_bytes"] == len(SMALL) + 100 * PAGE + recipe

    usage = store_usage(store)
    chunks_dir = store.root / packs.CHUNKS_DIR
    assert usage.chunks_bytes == _dir_bytes(chunks_dir) == 400 * (PAGE + packs.ID_BYTES)
    assert usage.disk_bytes == usage.chunks_bytes + _dir_bytes(store.root / a) + _dir_bytes(
        store.root / b)
    rows = _by_name(usage)
    assert [s.id for s in usage.snapshots] == [a, b]
    assert rows["a"]["own"] == _dir_bytes(store.root / a)
    assert rows["a"]["sole"] == rows["b"]["sole"] == 100 * PAGE
    # b's own pack holds only the pages b alone needs: deleting b empties it.
    assert rows["b"]["frees"] == rows["b"]["own"] + 100 * (PAGE + packs.ID_BYTES)
    # a's 100 pages share a pack with the 200 that b needs: that pack stays for now.
    assert rows["a"]["frees"] == rows["a"]["own"]

    before = usage.disk_bytes
    store.delete(a)
    assert store_usage(store).disk_bytes == before - rows["a"]["frees"]


def test_a_pack_mostly_dead_after_a_delete_is_counted_as_freed(tmp_path: Path):
    store = _store(tmp_path)
    a = _save(store, "a", _pages(*range(1, 301)))
    _save(store, "b", _pages(*range(1, 101), *range(501, 701)))  # a third of a's pages
    rows = _by_name(store_usage(store))
    # Without a, a's pack keeps 100 of 300 pages: the collector rewrites it with those.
    assert rows["a"]["sole"] == 200 * PAGE
    assert rows["a"]["frees"] == rows["a"]["own"] + 200 * (PAGE + packs.ID_BYTES)
    before = store_usage(store).disk_bytes
    store.delete(a)
    assert store_usage(store).disk_bytes == before - rows["a"]["frees"]


def test_pages_a_save_in_progress_needs_are_not_counted_as_freed(tmp_path: Path):
    store = _store(tmp_path)
    a = _save(store, "a", _pages(*range(1, 301)))
    # A partial whose recipe names a's pages: a commit between its chunking and its rename.
    partial = store.begin(new_snapshot_id())
    recipe = (store.root / a / "pages-1.img.chunks").read_bytes()
    (partial / "pages-1.img.chunks").write_bytes(recipe)
    usage = store_usage(store)
    [row] = usage.snapshots
    assert row.sole_page_bytes == 0 and row.frees_bytes == row.own_bytes
    # The partial is no snapshot: not listed, not in the snapshots' bytes.
    assert usage.disk_bytes == usage.chunks_bytes + _dir_bytes(store.root / a)


def test_snapshots_kept_whole_free_their_own_files(tmp_path: Path):
    store = SnapshotStore(tmp_path / "s", tmp_path / "keys" / "signing.key",
                          ManifestPolicy(lambda: tmp_path / "runtime" / "gpu_snapshot"),
                          chunk_images=False)
    a = _save(store, "whole", _pages(*range(1, 301)))
    summary = store.get(a).summary()
    assert summary["new_bytes"] == summary["size_bytes"] == 300 * PAGE + len(SMALL)
    usage = store_usage(store)
    [row] = usage.snapshots
    assert row.frees_bytes == row.own_bytes == _dir_bytes(store.root / a)
    assert usage.chunks_bytes == 0 and usage.disk_bytes == row.own_bytes


def test_a_snapshot_from_before_chunking_counts_all_of_itself_as_new(tmp_path: Path):
    from tests.core.store.test_store import _manifest, _rewrite

    store = _store(tmp_path)
    a = _save(store, "old", _pages(1, 2, 3))  # small: kept whole
    manifest = _manifest(store, a)
    del manifest["stored"], manifest["signature"]
    manifest["format"] = 3
    _rewrite(store, a, manifest, sign=True)
    summary = store.get(a).summary()
    assert summary["status"] == "ok"
    assert summary["new_bytes"] == summary["size_bytes"] == 3 * PAGE + len(SMALL)


def test_no_store_yet_is_empty(tmp_path: Path):
    usage = store_usage(_store(tmp_path))
    assert usage.to_dict() == {"path": str(tmp_path / "s"), "disk_bytes": 0,
                               "chunks_bytes": 0, "snapshots": []}
