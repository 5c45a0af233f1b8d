"""The pages a chunked snapshot moves through the remote store: those an upload sends (no
usable remote pack holds them) and those a download fetches (the local store lacks them).
The remote side's layout is ``packs.py``; the local side's is ``core/store/packs/``. Called
by ``upload.py`` and ``download.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .. import packs
from ..store import SnapshotStore
from .objects import RemoteObjects, RemoteStoreError
from .packs import RemotePacks

FETCHED_PAGES = ".fetched-pages"  # in the partial directory, until it becomes a pack


class PageUpload:
    """The pages of a chunked snapshot that go up: those no usable remote pack holds.

    Made by ``upload.upload_snapshot`` (it reads the remote packs' ids); ``_Upload.run``
    sends them before any file of the snapshot, checks the packs right before the remote
    manifest, puts ``describe()`` in it, and calls ``undo`` when the upload fails."""

    def __init__(self, store: RemoteObjects, local: SnapshotStore,
                 recipes: dict[str, bytes]) -> None:
        self.packs = RemotePacks(store)
        self.local = local
        self.recipes = recipes
        ids = packs.ids_in_order(recipes.values())
        index = self.packs.index(self.packs.usable(self.packs.listing()))
        where = index.find(ids)
        self.lacking = ids[where < 0]
        self.stems = {index.packs[int(p)] for p in np.unique(index.pack_of[where[where >= 0]])}
        self.new_stem: str | None = None

    @property
    def new_bytes(self) -> int:
        return len(self.lacking) * packs.PAGE

    def send(self, advance: Callable[[int], None]) -> None:
        """The new pack, before anything else of the snapshot."""
        if not len(self.lacking):
            return
        with self.local.chunk_store(keyed=False) as store, store.reading(self.lacking) as read:
            self.new_stem = self.packs.put(self.lacking, read, advance)
        self.stems.add(self.new_stem)

    def check(self, snapshot_id: str) -> None:
        """Right before the remote manifest and right after it: every pack it names is
        still there. The remote collector removes only packs no manifest names, past a
        grace, and lists the manifests again before it removes; this catches a reused old
        pack that went while this upload ran."""
        gone = sorted(self.stems - set(self.packs.usable(self.packs.listing())))
        if gone:
            raise RemoteStoreError(
                "upload", f"the remote pack {gone[0]} that {snapshot_id} needs was removed "
                "while it was uploaded", hint="the local snapshot is intact; try the upload again",
            )

    def describe(self) -> dict[str, Any]:
        """What the remote manifest says of the pages."""
        return {
            "packs": sorted(self.stems),
            "chunked": {name: {"size": len(r) // packs.ID_BYTES * packs.PAGE,
                               "recipe": packs.recipe_name(name)}
                        for name, r in sorted(self.recipes.items())},
            "new_page_bytes": self.new_bytes,
        }

    def undo(self) -> None:
        if self.new_stem:
            self.packs.remove(self.new_stem)


class PageDownload:
    """The pages of a chunked remote snapshot that the local store lacks.

    Made by ``download.download_snapshot`` once the recipes are in its partial directory,
    where they keep alive the pages this store has (the collector reads them there), so
    those found here stay found; ``fetch`` runs after the snapshot's small files came."""

    def __init__(self, store: RemoteObjects, snapshot_id: str, remote: dict[str, Any],
                 recipes: dict[str, bytes], local: SnapshotStore) -> None:
        self.snapshot_id = snapshot_id
        self.packs = RemotePacks(store)
        self.stems = [str(s) for s in remote.get("packs", [])]
        self.packs.require(snapshot_id, self.stems)
        self.local = local
        ids = packs.ids_in_order(recipes.values())
        with local.chunk_store() as chunk_store:
            self.id_key = chunk_store.id_key
            self.lacking = ids[chunk_store.lacking(ids)] if len(ids) else ids

    @property
    def lacking_bytes(self) -> int:
        return len(self.lacking) * packs.PAGE

    def fetch(self, partial: Path, advance: Callable[[int], None]) -> None:
        """Fetch the lacking pages into the partial directory, then make them a pack."""
        if not len(self.lacking):
            return
        index = self.packs.index(self.stems)
        fd = os.open(partial / FETCHED_PAGES, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                     0o600)
        try:
            os.ftruncate(fd, self.lacking_bytes)
            self.packs.fetch(self.snapshot_id, index, self.lacking, fd, self.id_key, advance)
        finally:
            os.close(fd)
        dfd = os.open(partial, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            with self.local.chunk_store() as chunk_store, chunk_store.hold("download"):
                chunk_store.adopt_pack(dfd, FETCHED_PAGES, self.lacking.tobytes())
        finally:
            os.close(dfd)
