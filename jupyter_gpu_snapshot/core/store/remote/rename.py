"""A local rename carried to the remote copy: the re-signed manifest goes up under a new
object name, then the remote manifest that points to it replaces the old one.

A reader holds either the old remote manifest (whose manifest object is still there) or the
new one, so the remote copy never shows half a rename. The manifest object before the
previous one is removed; older readers are long done with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from ...errors import NotFound, SnapshotError
from ..manifest import MANIFEST
from .objects import REMOTE_MANIFEST, RemoteObjects, RemoteSnapshot, RemoteStoreError, describe


def rename_remote_copy(store: RemoteObjects, snapshot_dir: Path) -> RemoteSnapshot | None:
    """Give the remote copy of a local snapshot its (renamed, re-signed) manifest.

    Called after ``SnapshotStore.rename`` by the server and the CLI. Returns the remote
    snapshot as it is now, or None when there is no remote copy. Raises one
    RemoteStoreError when the remote store cannot be reached; the local side is untouched.
    """
    snapshot_id = snapshot_dir.name
    try:
        fd = os.open(snapshot_dir / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            manifest_bytes = f.read()
        remote = store.read_remote_manifest(snapshot_id)
        if remote is None:
            return None
        entry = remote.get("objects", {}).get(MANIFEST)
        if not isinstance(entry, dict):
            raise RemoteStoreError(
                "rename", f"the remote manifest of {snapshot_id} does not list {MANIFEST}",
                hint="delete the remote copy and upload the snapshot again",
            )
        current = json.loads(store.read_manifest(snapshot_id, remote))
        if current.get("name") == json.loads(manifest_bytes).get("name"):
            return store.get(snapshot_id)
        sealer = store.check_key(snapshot_id, remote)
        stored = (
            sealer.seal_run(MANIFEST, 0, len(manifest_bytes), manifest_bytes)
            if sealer else manifest_bytes
        )
        new_object = f"manifest.{uuid.uuid4().hex[:12]}.json"
        store.retry(
            f"put {new_object}",
            lambda: store.fs.pipe_file(store.path(snapshot_id, new_object), stored),
        )
        objects = dict(remote["objects"])
        objects[MANIFEST] = {
            "size": len(manifest_bytes),
            "stored_size": len(stored),
            "sha256": hashlib.sha256(manifest_bytes).hexdigest(),
            "object": new_object,
            "replaces": entry.get("object") or MANIFEST,
        }
        renamed: dict[str, Any] = dict(remote, objects=objects, renamed=time.time())
        body = json.dumps(renamed, indent=2, sort_keys=True).encode()
        # One PUT replaces the remote manifest whole: the moment the rename takes effect.
        store.retry(
            "put remote manifest",
            lambda: store.fs.pipe_file(store.path(snapshot_id, REMOTE_MANIFEST), body),
        )
    except NotFound:
        return None
    except SnapshotError:
        raise
    except Exception as e:
        raise RemoteStoreError(
            "rename",
            f"renaming the remote copy of {snapshot_id} in {store.url} failed: {describe(e)}",
            hint="the local snapshot is renamed; rename it again once the remote store "
            "answers, and its remote copy takes the new name",
        ) from e
    older = entry.get("replaces")
    if older:
        with contextlib.suppress(Exception):  # leftovers cost bytes, not correctness
            store.fs.rm_file(store.path(snapshot_id, str(older)))
    return store.get(snapshot_id)
