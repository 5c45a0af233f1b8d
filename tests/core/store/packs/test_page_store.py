"""Images kept by content (``core/store/packs/``), on real files in a real store: what a commit
writes to the packs, what a restore assembles, what the store refuses, and what the
collector frees. No kernel: the images are bytes the tests choose, committed as a save does.
"""

from __future__ import annotations

import itertools
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest

from jupyter_gpu_snapshot.core import safe_fs
from jupyter_gpu_snapshot.core.errors import SnapshotError
from jupyter_gpu_snapshot.core.locks import snapshot_key
from jupyter_gpu_snapshot.core.recovery import recover_store
from jupyter_gpu_snapshot.core.store import SnapshotStore, digest, staging
from jupyter_gpu_snapshot.core.store.manifest import FORMAT_VERSION, ManifestPolicy
from jupyter_gpu_snapshot.core.store.packs import (
    CHUNKS_DIR,
    ID_BYTES,
    PAGE,
    PLAN_SUFFIX,
    ZERO_ID,
    PackIndex,
    PageStore,
    RememberedPlan,
    id_workers,
    layout,
    recipe_name,
)
from jupyter_gpu_snapshot.core.store.snapshot import Snapshot, new_snapshot_id

IMAGE = "pages-1.img"
CONNECTION = {
    "transport": "tcp", "ip": "127.0.0.1", "key": "k" * 36, "signature_scheme": "hmac-sha256",
    "shell_port": 50001, "iopub_port": 50002, "stdin_port": 50003, "control_port": 50004,
    "hb_port": 50005,
}


# -- helpers -------------------------------------------------------------------------------
def make_store(tmp_path: Path, name: str = "s", key: str = "signing.key") -> SnapshotStore:
    logs = tmp_path / "runtime" / "gpu_snapshot"
    return SnapshotStore(tmp_path / name, tmp_path / "keys" / key, ManifestPolicy(lambda: logs))


def pages(n: int, seed: int) -> list[bytes]:
    """``n`` distinct random pages."""
    rng = random.Random(seed)
    return [rng.randbytes(PAGE) for _ in range(n)]


def manifest_of(store: SnapshotStore, snapshot_id: str, name: str) -> dict[str, object]:
    log = str(store.policy.kernel_log_dir()) + "/kernel-abc.log"  # type: ignore[misc]
    kernel = {"name": "python3-snapshot", "connection_info": dict(CONNECTION),
              "log_files": [log]}
    return {"id": snapshot_id, "name": name, "created": 1.0, "kernel": kernel}


def partial_with(store: SnapshotStore, files: dict[str, bytes]) -> tuple[str, Path]:
    """A save's partial directory holding ``files``, its draft written, as criu leaves it."""
    snapshot_id = new_snapshot_id()
    partial = store.begin(snapshot_id)
    store.write_draft(partial, manifest_of(store, snapshot_id, f"n-{snapshot_id[-8:]}"))
    for name, data in files.items():
        (partial / name).write_bytes(data)
    return snapshot_id, partial


def commit(store: SnapshotStore, files: dict[str, bytes], name: str | None = None) -> Snapshot:
    snapshot_id, partial = partial_with(store, files)
    manifest = manifest_of(store, snapshot_id, name or f"n-{snapshot_id[-8:]}")
    with store.locks.hold(snapshot_key(snapshot_id), "test", "test"):
        return store.commit(partial, manifest)


def packs(store: SnapshotStore) -> dict[str, int]:
    """Each complete pack's name and size in bytes."""
    directory = store.root / CHUNKS_DIR
    return {p.stem: p.stat().st_size for p in directory.glob("*.pack")
            if (directory / f"{p.stem}.ids").exists()}


def pack_bytes(store: SnapshotStore) -> int:
    return sum(packs(store).values())


def stored_pages(store: SnapshotStore) -> set[bytes]:
    """The content of every page in the store's packs."""
    directory = store.root / CHUNKS_DIR
    found = set()
    for name in packs(store):
        data = (directory / f"{name}.pack").read_bytes()
        found |= {data[i:i + PAGE] for i in range(0, len(data), PAGE)}
    return found


def recipe(snapshot: Snapshot, name: str = IMAGE) -> bytes:
    return (snapshot.path / recipe_name(name)).read_bytes()


def assembled(store: SnapshotStore, snapshot: Snapshot) -> dict[str, bytes]:
    """The whole image files ``opened_images`` gives, read through its fds."""
    got = {}
    with store.opened_images(store.reload(snapshot)) as (_, opened):
        for name, (fd, size) in zip(sorted(snapshot.manifest["files"]), opened, strict=True):
            got[name] = os.pread(fd, size + 1, 0)
    return got


def verify_fails(store: SnapshotStore, snapshot: Snapshot, names: str) -> SnapshotError:
    with pytest.raises(SnapshotError) as err:
        store.verify(snapshot)
    assert names in err.value.message, err.value.message
    return err.value


# -- saving --------------------------------------------------------------------------------
def test_large_images_become_recipes_and_small_ones_stay_whole(tmp_path):
    store = make_store(tmp_path)
    big = b"".join(pages(300, 1))  # 1.2 MiB: chunked
    odd = big[:-1]  # not a whole number of pages: kept whole
    small = b"".join(pages(10, 2))
    snapshot = commit(store, {IMAGE: big, "pages-2.img": odd, "core-1.img": small})

    on_disk = sorted(p.name for p in snapshot.path.iterdir())
    assert on_disk == ["core-1.img", "manifest.json", "pages-1.img.chunks", "pages-2.img"]
    files = snapshot.manifest["files"]
    assert "chunks" in files[IMAGE] and "chunks" not in files["pages-2.img"]
    assert files[IMAGE]["size"] == len(big)
    assert snapshot.manifest["stored"]["new_page_bytes"] == len(big)
    assert len(recipe(snapshot)) == len(big) // PAGE * ID_BYTES
    assert assembled(store, snapshot) == {IMAGE: big, "pages-2.img": odd, "core-1.img": small}


def test_a_second_save_writes_only_the_pages_that_changed(tmp_path):
    store = make_store(tmp_path)
    first = pages(400, 1)
    commit(store, {IMAGE: b"".join(first)})
    assert pack_bytes(store) == 400 * PAGE
    before = packs(store)

    # The same memory, moved around in the image, three pages written since.
    second = list(first)
    random.Random(7).shuffle(second)
    changed = pages(3, 99)
    for i, page in zip((5, 200, 399), changed, strict=True):
        second[i] = page
    snapshot = commit(store, {IMAGE: b"".join(second)})

    new = {name: size for name, size in packs(store).items() if name not in before}
    assert list(new.values()) == [3 * PAGE]
    (name,) = new
    written = (store.root / "chunks" / f"{name}.pack").read_bytes()
    assert {written[i:i + PAGE] for i in range(0, len(written), PAGE)} == set(changed)
    assert snapshot.manifest["stored"]["new_page_bytes"] == 3 * PAGE
    assert assembled(store, snapshot)[IMAGE] == b"".join(second)


def test_a_save_with_no_new_page_writes_no_pack(tmp_path):
    store = make_store(tmp_path)
    data = b"".join(pages(300, 1))
    commit(store, {IMAGE: data})
    before = sorted(os.listdir(store.root / "chunks"))
    snapshot = commit(store, {IMAGE: data, "pages-2.img": data})
    assert sorted(os.listdir(store.root / "chunks")) == before
    assert snapshot.manifest["stored"]["new_page_bytes"] == 0


@pytest.mark.parametrize("step_pages", [None, 16])
def test_pages_repeated_in_one_save_are_written_once(tmp_path, monkeypatch, step_pages):
    """In two files, and (with a step of 16 pages) in two steps of one file."""
    if step_pages:
        monkeypatch.setattr(id_workers, "STEP", step_pages * PAGE)
    store = make_store(tmp_path)
    page, other = pages(2, 3)
    snapshot = commit(store, {IMAGE: (page + other) * 150, "pages-2.img": page * 300})
    assert pack_bytes(store) == 2 * PAGE
    assert assembled(store, snapshot)[IMAGE] == (page + other) * 150


def test_each_range_of_a_new_pack_goes_to_the_disk_as_it_is_appended(tmp_path, monkeypatch):
    """Write-behind: every byte of the pack is handed to the disk once, in order, a step at
    a time, before the commit's final fsync (so the disk works while the rest is read)."""
    monkeypatch.setattr(id_workers, "STEP", 64 * PAGE)
    started: list[tuple[int, int]] = []

    def start_writeback(fd: int, offset: int, length: int) -> None:
        started.append((offset, length))
        real_start_writeback(fd, offset, length)

    real_start_writeback = layout.start_writeback
    monkeypatch.setattr(layout, "start_writeback", start_writeback)
    store = make_store(tmp_path)
    data = b"".join(pages(300, 1))  # 1.2 MiB: chunked
    snapshot = commit(store, {IMAGE: data})

    (size,) = packs(store).values()
    assert size == len(data)
    assert len(started) == 5  # 300 pages in steps of 64
    assert [offset for offset, _ in started] == list(
        itertools.accumulate([0] + [length for _, length in started[:-1]]))
    assert sum(length for _, length in started) == size
    assert assembled(store, snapshot)[IMAGE] == data


def test_zero_pages_are_never_written(tmp_path):
    store = make_store(tmp_path)
    real = pages(100, 1)
    zero = bytes(PAGE)
    layout = [real[i // 3] if i % 3 == 0 else zero for i in range(300)]
    data = b"".join(layout)
    snapshot = commit(store, {IMAGE: data, "pages-2.img": bytes(300 * PAGE)})

    assert pack_bytes(store) == 100 * PAGE
    assert zero not in stored_pages(store)
    ids = recipe(snapshot)
    zero_ids = [ids[i:i + ID_BYTES] == ZERO_ID for i in range(0, len(ids), ID_BYTES)]
    assert zero_ids == [page == zero for page in layout]
    assert set(recipe(snapshot, "pages-2.img")) == {0}
    assert snapshot.manifest["stored"]["zero_page_bytes"] == (200 + 300) * PAGE
    assert assembled(store, snapshot) == {IMAGE: data, "pages-2.img": bytes(300 * PAGE)}


def test_page_ids_are_keyed_by_the_store(tmp_path):
    """Two stores of two keys name the same page differently, and neither by its plain
    digest: the ids say nothing about which pages two users share."""
    import blake3

    data = b"".join(pages(300, 1))
    ours = commit(make_store(tmp_path, "ours", "ours.key"), {IMAGE: data})
    theirs = commit(make_store(tmp_path, "theirs", "theirs.key"), {IMAGE: data})
    ours_ids, theirs_ids = recipe(ours), recipe(theirs)

    assert len(ours_ids) == len(theirs_ids) == 300 * ID_BYTES
    first = slice(0, ID_BYTES)
    assert ours_ids[first] != theirs_ids[first]
    assert not set(_split(ours_ids)) & set(_split(theirs_ids))
    plain = blake3.blake3(data[:PAGE]).digest(ID_BYTES)
    assert plain not in (ours_ids[first], theirs_ids[first])
    # One key, one name: a second store of the same key agrees.
    again = commit(make_store(tmp_path, "again", "ours.key"), {IMAGE: data})
    assert recipe(again) == ours_ids


def _split(ids: bytes) -> list[bytes]:
    return [ids[i:i + ID_BYTES] for i in range(0, len(ids), ID_BYTES)]


# -- restoring -----------------------------------------------------------------------------
@pytest.mark.parametrize("in_memory", [True, False], ids=["in memory", "beside the store"])
def test_assembled_images_equal_the_originals_with_zero_pages_as_holes(
    tmp_path, monkeypatch, in_memory
):
    store = make_store(tmp_path)
    real = pages(64, 1)
    data = bytes(200 * PAGE) + b"".join(real) + bytes(200 * PAGE)
    snapshot = commit(store, {IMAGE: data})
    store.verify(snapshot)
    if not in_memory:  # as on a machine whose memory cannot hold the files
        monkeypatch.setattr(staging, "memory_for_assembly", lambda needed: None)

    with store.opened_images(store.reload(snapshot)) as (directory, opened):
        if in_memory:
            assert directory.parent.parent == staging.MEMORY_DIR
            assert directory.parent.name.startswith(staging.MEMORY_ASSEMBLY_PREFIX)
        else:
            assert directory.parent.name.startswith(".assembled-")
        ((fd, size),) = opened
        assert size == len(data) and os.pread(fd, size, 0) == data
        assert os.fstat(fd).st_blocks * 512 < len(data) // 2  # the zero pages take no disk
        assert os.lseek(fd, 0, os.SEEK_DATA) == 200 * PAGE
        (on_disk,) = [p for p in directory.iterdir() if p.name == IMAGE]
        assert on_disk.read_bytes() == data
        assert (directory / "manifest.json").is_file()
    assert not [p for p in store.root.iterdir() if p.name.startswith(".assembled-")]
    assert not directory.exists()


def test_an_altered_recipe_is_refused_by_name(tmp_path):
    store = make_store(tmp_path)
    original = b"".join(pages(300, 1))
    snapshot = commit(store, {IMAGE: original})
    path = snapshot.path / recipe_name(IMAGE)
    ids = bytearray(path.read_bytes())

    # Two pages swapped: every id still names a page of the store.
    ids[:ID_BYTES], ids[ID_BYTES:2 * ID_BYTES] = ids[ID_BYTES:2 * ID_BYTES], ids[:ID_BYTES]
    path.write_bytes(ids)
    err = verify_fails(store, snapshot, IMAGE)
    assert "recipe" in err.message
    with pytest.raises(SnapshotError), store.opened_images(store.reload(snapshot)):
        pytest.fail("altered pages were handed out")

    path.write_bytes(bytes(ids[:-ID_BYTES]))  # shortened
    verify_fails(store, snapshot, IMAGE)
    path.unlink()
    verify_fails(store, snapshot, IMAGE)


def test_an_altered_page_in_a_pack_is_refused_by_name(tmp_path):
    store = make_store(tmp_path)
    original = b"".join(pages(300, 1))
    snapshot = commit(store, {IMAGE: original, "core-1.img": b"small"})
    (name,) = packs(store)
    pack = store.root / "chunks" / f"{name}.pack"
    with open(pack, "r+b") as f:
        f.seek(150 * PAGE + 9)
        f.write(b"\xff" if original[150 * PAGE + 9] != 0xFF else b"\x00")
    err = verify_fails(store, snapshot, IMAGE)
    assert "digest" in err.message

    # A page that is gone from its pack: an error, never a shorter file.
    os.truncate(pack, 100 * PAGE)
    verify_fails(store, snapshot, snapshot.id)
    # A page that no pack names any more.
    ids_file = store.root / "chunks" / f"{name}.ids"
    ids_file.write_bytes(ids_file.read_bytes()[:-ID_BYTES])
    verify_fails(store, snapshot, IMAGE)
    assert not [p for p in store.root.iterdir() if p.name.startswith(".assembled-")]


def test_a_whole_file_beside_its_recipe_is_ignored(tmp_path):
    """A commit cut off after its rename, before it removed the whole files, leaves both;
    the recipe, the one made durable, wins."""
    store = make_store(tmp_path)
    original = b"".join(pages(300, 1))
    snapshot = commit(store, {IMAGE: original})
    leftover = bytearray(original)
    leftover[5] ^= 1
    (snapshot.path / IMAGE).write_bytes(leftover)

    store.verify(snapshot)
    assert assembled(store, snapshot)[IMAGE] == original

    # A recovery drops the whole file, which only takes room.
    report = recover_store(store)
    assert report.removed == [snapshot.path / IMAGE]
    assert sorted(p.name for p in snapshot.path.iterdir()) == ["manifest.json",
                                                                recipe_name(IMAGE)]
    store.verify(snapshot)
    store.delete(snapshot.id)
    assert pack_bytes(store) == 0 and not snapshot.path.exists()


# -- links ---------------------------------------------------------------------------------
def test_a_linked_chunks_directory_is_never_followed(tmp_path):
    store = make_store(tmp_path)
    data = b"".join(pages(300, 1))
    snapshot = commit(store, {IMAGE: data})
    real = store.root / "chunks"
    elsewhere = tmp_path / "elsewhere"
    real.rename(elsewhere)
    real.symlink_to(elsewhere)
    before = sorted(os.listdir(elsewhere))

    verify_fails(store, snapshot, snapshot.id)
    with pytest.raises(OSError):
        commit(store, {IMAGE: b"".join(pages(300, 2))})
    assert store.collect_garbage().removed == 0
    assert sorted(os.listdir(elsewhere)) == before
    assert real.is_symlink()


def test_a_linked_pack_is_never_followed(tmp_path):
    store = make_store(tmp_path)
    data = b"".join(pages(300, 1))
    snapshot = commit(store, {IMAGE: data})
    (name,) = packs(store)
    pack = store.root / "chunks" / f"{name}.pack"
    copy = tmp_path / "copy.pack"
    pack.rename(copy)
    pack.symlink_to(copy)
    verify_fails(store, snapshot, snapshot.id)

    # A linked pack without ids is a leftover: the link goes, never what it names.
    planted = store.root / "chunks" / f"{'a' * 32}.pack"
    planted.symlink_to(copy)
    dot = store.root / "chunks" / ".stray"
    dot.symlink_to(tmp_path)
    store.collect_garbage()
    assert not os.path.lexists(planted) and not os.path.lexists(dot)
    assert copy.stat().st_size == 300 * PAGE and tmp_path.is_dir()


# -- collecting ----------------------------------------------------------------------------
def test_a_delete_frees_only_the_pages_no_other_snapshot_needs(tmp_path):
    store = make_store(tmp_path)
    shared, only_a, only_b = pages(300, 1), pages(300, 2), pages(300, 3)
    a = commit(store, {IMAGE: b"".join(shared + only_a)})
    b = commit(store, {IMAGE: b"".join(only_b + shared)})
    assert pack_bytes(store) == 900 * PAGE

    report = store.delete(a.id)
    assert report.id == a.id
    # a's pack held its own pages and the shared ones, half of it live: kept as it is.
    assert pack_bytes(store) == 900 * PAGE
    assert stored_pages(store) == set(shared + only_a + only_b)

    c = commit(store, {IMAGE: b"".join(only_b)})
    store.delete(b.id)
    # a's pack: only the shared pages were live, and no more; b's pack: c needs all of it.
    assert stored_pages(store) == set(only_b)
    assert pack_bytes(store) == 300 * PAGE
    store.verify(c)
    assert assembled(store, c)[IMAGE] == b"".join(only_b)


def test_a_mostly_dead_pack_is_rewritten_with_its_live_pages(tmp_path):
    store = make_store(tmp_path)
    kept, dropped = pages(100, 1), pages(300, 2)
    old = commit(store, {IMAGE: b"".join(dropped + kept)})
    (first_pack,) = packs(store)
    young = commit(store, {IMAGE: b"".join(kept + pages(300, 3))})

    store.delete(old.id)
    assert first_pack not in packs(store)
    assert stored_pages(store) == set(kept + pages(300, 3))
    assert pack_bytes(store) == 400 * PAGE
    suffixes = sorted(p.suffix for p in (store.root / "chunks").iterdir())
    assert suffixes == [".ids"] * 2 + [".pack"] * 2
    store.verify(young)


def test_the_collector_removes_packs_without_ids_and_stray_files(tmp_path):
    store = make_store(tmp_path)
    snapshot = commit(store, {IMAGE: b"".join(pages(300, 1))})
    directory = store.root / "chunks"
    unfinished = directory / f"{'b' * 32}.pack"  # a commit died while it wrote this
    unfinished.write_bytes(b"x" * PAGE * 3)
    (directory / f".{'c' * 32}.ids.new").write_bytes(b"y" * 32)
    (directory / ".leftover").mkdir()
    other = directory / "notes.txt"  # no name of the store's: left as it is
    other.write_text("?")

    report = store.collect_garbage()
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [f"{name}{suffix}" for name in packs(store) for suffix in (".pack", ".ids")]
        + ["notes.txt"]
    )
    assert report.freed_bytes >= 3 * PAGE + 32
    store.verify(snapshot)


def test_the_collector_keeps_the_pages_of_saves_in_progress(tmp_path):
    """A commit cut off after its recipes, before its rename (or one kept aside for a
    person), has pages only its partial names: a delete of anything else must keep them."""
    store = make_store(tmp_path)
    doomed = commit(store, {IMAGE: b"".join(pages(300, 1))})
    theirs = b"".join(pages(300, 2))
    snapshot_id, partial = partial_with(store, {IMAGE: theirs})
    with store._root_fd() as root_fd, safe_fs.opened_dir(partial.name, root_fd) as dfd:
        assert root_fd is not None
        chunker = store._chunks(root_fd)
        with chunker.hold("test"):
            chunker.chunk_files(dfd, [IMAGE], lambda n: None)
    (partial / IMAGE).unlink()  # only the recipe names its pages now
    aside = store.root / f".unfinished-{new_snapshot_id()}"
    aside.mkdir()
    for name in os.listdir(partial):
        if name.endswith(".chunks"):
            (aside / name).write_bytes((partial / name).read_bytes())

    store.delete(doomed.id)
    assert stored_pages(store) == set(pages(300, 2))
    (aside / recipe_name(IMAGE)).unlink()
    store.collect_garbage()
    assert stored_pages(store) == set(pages(300, 2))

    # Its recovery commits it from the recipe it left: no page is written again.
    (partial / recipe_name(IMAGE)).unlink()
    (partial / IMAGE).write_bytes(theirs)
    with store.locks.hold(snapshot_key(snapshot_id), "test", "test"):
        done = store.commit(partial, manifest_of(store, snapshot_id, "recovered"))
    assert done.manifest["stored"]["new_page_bytes"] == 0
    assert assembled(store, done)[IMAGE] == theirs


def test_deleting_every_snapshot_empties_the_packs(tmp_path):
    store = make_store(tmp_path)
    made = [commit(store, {IMAGE: b"".join(pages(300, i))}) for i in range(3)]
    for snapshot in made:
        store.delete(snapshot.id)
    assert os.listdir(store.root / "chunks") == []


def test_the_manifest_says_what_the_store_keeps(tmp_path):
    store = make_store(tmp_path)
    snapshot = commit(store, {IMAGE: b"".join(pages(300, 1)), "core-1.img": b"c" * 100})
    manifest = json.loads((snapshot.path / "manifest.json").read_text())
    assert manifest["format"] == FORMAT_VERSION == 5
    assert manifest["stored"] == {"whole_bytes": 100, "new_page_bytes": 300 * PAGE,
                                  "recipe_bytes": 300 * ID_BYTES, "zero_page_bytes": 0}
    digests = np.frombuffer(recipe(snapshot), np.uint8).reshape(-1, ID_BYTES)
    assert len(np.unique(digests, axis=0)) == 300


# -- finding the pages: remembered plans ---------------------------------------------------
def served_bytes(store: SnapshotStore, snapshot: Snapshot, name: str = IMAGE) -> bytes:
    """The bytes a restore would hand criu for ``name``, read through its plan."""
    with store.served_images(store.reload(snapshot)) as served:
        image = served[name]
        data = bytearray(image.size)
        image.read_into(memoryview(data), 0)
    return bytes(data)


def plan_file(store: SnapshotStore, snapshot: Snapshot, name: str = IMAGE) -> Path:
    key = digest.blake3_hex(recipe(snapshot, name))
    return store.root / CHUNKS_DIR / f"{key}{PLAN_SUFFIX}"


def no_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sorting the store's ids fails from here on: only a remembered plan finds pages."""
    def refused(self: PageStore, dfd: int) -> PackIndex:
        raise AssertionError("the pages were looked up in the store's index")
    monkeypatch.setattr(PageStore, "index", refused)


def test_a_restore_finds_the_pages_where_the_save_remembered_them(tmp_path, monkeypatch):
    store = make_store(tmp_path)
    first = pages(300, 1)
    commit(store, {IMAGE: b"".join(first)})
    # Two packs and pages of zeros: runs from both packs, and holes.
    image = b"".join(first[:200] + [bytes(PAGE)] * 5 + pages(50, 2) + first[100:])
    snapshot = commit(store, {IMAGE: image})
    assert not plan_file(store, snapshot).exists()
    store.find_pages(snapshot)
    assert plan_file(store, snapshot).is_file()

    no_index(monkeypatch)
    assert served_bytes(store, snapshot) == image


def _forged_runs(plan: RememberedPlan) -> RememberedPlan:
    runs = plan.runs.copy()
    runs[0, 1] += 1  # the first run one page further on in its pack
    return RememberedPlan(plan.packs, runs)


def _zeros_claimed(plan: RememberedPlan) -> RememberedPlan:
    return RememberedPlan(plan.packs, plan.runs[1:])  # the first run's pages left out


def _pack_outside(plan: RememberedPlan) -> RememberedPlan:
    return RememberedPlan(["../" + plan.packs[0][3:], *plan.packs[1:]], plan.runs)


def _past_the_pack(plan: RememberedPlan) -> RememberedPlan:
    runs = plan.runs.copy()
    runs[-1, 3] += 10_000
    return RememberedPlan(plan.packs, runs)


FORGED_PLANS = {
    "a run shifted within its pack": _forged_runs,
    "pages of the image said to be zeros": _zeros_claimed,
    "a pack named outside the store": _pack_outside,
    "a run past the end of its pack and of the image": _past_the_pack,
}


@pytest.mark.parametrize("forge", FORGED_PLANS.values(), ids=FORGED_PLANS.keys())
def test_a_plan_that_does_not_hold_is_never_used(tmp_path, forge):
    """A plan is a cache nobody signed: one that names other pages than the recipe's is
    found again from the store's ids, and written again right."""
    store = make_store(tmp_path)
    image = b"".join(pages(300, 1) + [bytes(PAGE)] * 3 + pages(20, 2))
    snapshot = commit(store, {IMAGE: image})
    store.find_pages(snapshot)
    path = plan_file(store, snapshot)
    with store._root_fd() as root_fd, safe_fs.opened_dir(CHUNKS_DIR, root_fd) as dfd:
        good = RememberedPlan._parsed(path.read_bytes())
        assert good is not None
        path.unlink()
        forge(good).write(dfd, path.name.removesuffix(PLAN_SUFFIX))
    forged = path.read_bytes()

    assert served_bytes(store, snapshot) == image
    assert path.read_bytes() != forged
    again = RememberedPlan._parsed(path.read_bytes())
    assert again is not None and again.packs == good.packs
    assert np.array_equal(again.runs, good.runs)


def test_a_plan_is_found_again_after_the_collector_rewrote_its_pack(tmp_path, monkeypatch):
    store = make_store(tmp_path)
    kept = pages(100, 1)
    old = commit(store, {IMAGE: b"".join(pages(300, 2) + kept)})
    young = commit(store, {IMAGE: b"".join(kept + pages(300, 3))})
    store.find_pages(young)
    stale = plan_file(store, young).read_bytes()
    store.delete(old.id)  # the first pack, mostly dead, is rewritten with the kept pages

    assert served_bytes(store, young) == b"".join(kept + pages(300, 3))
    assert plan_file(store, young).read_bytes() != stale
    no_index(monkeypatch)
    assert served_bytes(store, young) == b"".join(kept + pages(300, 3))


def test_plans_go_with_the_last_snapshot_of_their_recipe(tmp_path):
    store = make_store(tmp_path)
    gone = commit(store, {IMAGE: b"".join(pages(300, 1))})
    kept = commit(store, {IMAGE: b"".join(pages(300, 2))})
    for snapshot in (gone, kept):
        store.find_pages(snapshot)
    gone_plan, kept_plan = plan_file(store, gone), plan_file(store, kept)
    store.delete(gone.id)
    assert not gone_plan.exists()
    assert kept_plan.is_file()
    store.delete(kept.id)
    assert os.listdir(store.root / "chunks") == []
