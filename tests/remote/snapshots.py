"""Well-formed snapshot directories made by the real store (begin + commit), without a kernel."""

from __future__ import annotations

import os
import time
from pathlib import Path

from jupyter_gpu_snapshot.core.snapshot import Snapshot, new_snapshot_id
from jupyter_gpu_snapshot.core.store import SnapshotStore

from ..manifests import CONNECTION, kernel_section


def make_snapshot(
    store: SnapshotStore, files: dict[str, int | bytes], name: str | None = None
) -> Snapshot:
    """A committed snapshot; each file holds the bytes given, or that many random bytes."""
    snapshot_id = new_snapshot_id()
    partial = store.begin(snapshot_id)
    for file_name, content in files.items():
        with open(partial / file_name, "wb") as f:
            if isinstance(content, bytes):
                f.write(content)
                continue
            remaining = content
            while remaining:
                n = min(remaining, 4 << 20)
                f.write(os.urandom(n))
                remaining -= n
    manifest = {
        "id": snapshot_id,
        "name": name or f"snap-{snapshot_id[-8:]}",
        "created": time.time(),
        "host": "node-a",
        "kernel": kernel_section(connection_info=dict(CONNECTION, key="secret-hmac-key")),
    }
    return store.commit(partial, manifest)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}
