"""The snapshot index: every manifest read once, and in step with what any process commits
or deletes in the store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot.core.errors import NotFound
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.index import SnapshotIndex
from jupyter_gpu_snapshot.core.store.snapshot import new_snapshot_id
from testkit.manifests import commit_tiny
from tests.conftest import copy_many_snapshots


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(tmp_path / "store")


def counting_reads(monkeypatch: pytest.MonkeyPatch, store: SnapshotStore) -> list[str]:
    reads: list[str] = []
    real_get = store.get

    def get(ref: str) -> Any:
        reads.append(ref)
        return real_get(ref)

    monkeypatch.setattr(store, "get", get)
    return reads


def test_follows_commits_and_deletes_of_another_process(
    store: SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = SnapshotIndex(store)
    assert index.list() == []  # no store directory yet
    other = SnapshotStore(store.root)  # as the CLI would see it
    first = commit_tiny(other, "first", "a.ipynb")
    second = commit_tiny(other, "second", "b.ipynb")
    reads = counting_reads(monkeypatch, store)
    assert [s.id for s in index.list()] == [first, second]
    assert [s.id for s in index.list("b.ipynb")] == [second]
    assert index.get("first").id == first and index.find_name("second") is not None
    assert sorted(reads) == sorted([first, second])  # each manifest read once

    other.delete(first)
    assert [s.id for s in index.list()] == [second]
    with pytest.raises(NotFound, match="no snapshot 'first'"):
        index.get("first")
    third = commit_tiny(other, "third")
    assert [s.id for s in index.list()] == [second, third]
    assert reads.count(third) == 1 and reads.count(second) == 1


def test_a_directory_without_a_readable_manifest_is_listed_damaged(store: SnapshotStore) -> None:
    index = SnapshotIndex(store)
    kept = commit_tiny(store, "kept")
    broken = store.root / new_snapshot_id()
    broken.mkdir()
    (broken / "manifest.json").write_text("{not json")
    assert [s.id for s in index.list()] == [kept]  # what restores and retention act on
    assert {s.id: s.status for s in index.catalog()} == {kept: "ok", broken.name: "damaged"}
    assert index.get(broken.name).status == "damaged"
    with pytest.raises(NotFound):
        index.get(new_snapshot_id())


def test_listing_200_snapshots_again_reads_no_manifest(
    store: SnapshotStore, monkeypatch: pytest.MonkeyPatch, many_snapshots: Path
) -> None:
    """A listing costs a scandir and a stat per snapshot once the index holds them; how long
    that takes is measured by benchmarks/bench_event_loop.py."""
    copy_many_snapshots(many_snapshots, store.root)
    index = SnapshotIndex(store)
    reads = counting_reads(monkeypatch, store)
    assert len(index.list()) == 200  # the first listing reads the manifests
    assert len(reads) == 200
    for _ in range(20):
        assert len([s.summary() for s in index.list()]) == 200
    assert len(reads) == 200
