"""Page ids of large image files come from worker processes; they must be the ids one
process computes, and a commit must go on when the workers cannot."""

from __future__ import annotations

import os
from concurrent.futures import BrokenExecutor
from pathlib import Path

import numpy as np
import pytest

from jupyter_gpu_snapshot.core.locks import StoreLocks
from jupyter_gpu_snapshot.core.store import packs
from jupyter_gpu_snapshot.core.store.packs import id_workers

KEY = bytes(range(32))


@pytest.fixture
def image(tmp_path: Path) -> Path:
    pages = np.frombuffer(os.urandom(3 << 20), np.uint8).reshape(-1, packs.PAGE).copy()
    pages[::3] = 0
    path = tmp_path / "pages-1.img"
    path.write_bytes(pages.tobytes())
    return path


def test_worker_ids_equal_the_ids_computed_in_one_process(image: Path) -> None:
    data = image.read_bytes()
    fd = os.open(image, os.O_RDONLY)
    try:
        opened = f"/proc/{os.getpid()}/fd/{fd}"
        middle = len(data) // 2
        parts = [packs.ids_of_range(opened, 0, middle, KEY),
                 packs.ids_of_range(opened, middle, len(data), KEY)]
    finally:
        os.close(fd)
    ids, zero = packs.page_ids(data, KEY)
    assert b"".join(p[0] for p in parts) == ids.tobytes()
    assert b"".join(p[1] for p in parts) == zero.tobytes()
    assert zero[::3].all() and not zero[1::3].any()
    assert not ids[zero].any()


def _chunk(image: Path, monkeypatch: pytest.MonkeyPatch, workers: bool) -> bytes:
    store_root = image.parent / ("with" if workers else "without")
    store_root.mkdir()
    if workers:
        monkeypatch.setattr(id_workers, "PARALLEL_IDS_BYTES", 1 << 20)
        monkeypatch.setattr(id_workers, "MIN_CORES_FOR_WORKERS", 1)
    root_fd = os.open(store_root, os.O_RDONLY | os.O_DIRECTORY)
    dfd = os.open(image.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        store = packs.PageStore(root_fd, StoreLocks(store_root), KEY)
        results, _ = store.chunk_files(dfd, [image.name], lambda n: None)
    finally:
        os.close(dfd)
        os.close(root_fd)
    os.unlink(image.parent / packs.recipe_name(image.name))
    return results[image.name].recipe


def test_a_commit_with_workers_writes_the_recipe_of_one_without(
    image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone = _chunk(image, monkeypatch, workers=False)
    assert _chunk(image, monkeypatch, workers=True) == alone


def test_a_commit_goes_on_when_the_workers_die(
    image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone = _chunk(image, monkeypatch, workers=False)

    def broken(*args: object) -> tuple[bytes, bytes]:
        raise BrokenExecutor("a worker died")

    monkeypatch.setattr(id_workers, "decode_ids", broken)
    assert _chunk(image, monkeypatch, workers=True) == alone
