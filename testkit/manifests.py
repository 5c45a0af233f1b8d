"""What a save puts in a manifest's kernel section, for tests that commit snapshots by hand.

The store refuses to commit (or list as trusted) a manifest that fails its schema, so a
hand-made snapshot needs every field a real save writes.
"""

from __future__ import annotations

import time
from typing import Any

from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.snapshot import new_snapshot_id

CONNECTION = {
    "transport": "tcp", "ip": "127.0.0.1", "key": "k" * 36, "signature_scheme": "hmac-sha256",
    "shell_port": 50001, "iopub_port": 50002, "stdin_port": 50003, "control_port": 50004,
    "hb_port": 50005,
}


def kernel_section(**fields: Any) -> dict[str, Any]:
    """A valid kernel section; ``fields`` add to it or replace its parts."""
    return {"name": "python3-snapshot", "connection_info": dict(CONNECTION), "log_files": [],
            **fields}


def commit_tiny(store: SnapshotStore, name: str, notebook: str | None = None) -> str:
    """A small but complete snapshot, committed as a save commits it; returns its id."""
    snapshot_id = new_snapshot_id()
    partial = store.begin(snapshot_id)
    (partial / "pages-1.img").write_bytes(b"p" * 4096)
    store.commit(partial, {
        "id": snapshot_id, "name": name, "created": time.time(), "reason": "user",
        "kernel": kernel_section(notebook_path=notebook),
    })
    return snapshot_id


def move_to_another_node(store: SnapshotStore, snapshot_id: str) -> None:
    """Sign the snapshot again as if another Linux series had saved it: this node's
    compatibility check then refuses its image, as after an upgrade of the node."""
    with store.opened_root() as root_fd:
        assert root_fd is not None
        current = store.get(snapshot_id)
        assert current.trusted, (current.status, current.problem)
        node = dict(current.manifest["node"])
        node["kernel"] = {**node["kernel"], "release": "2.6.32-another-node"}
        store._resign(root_fd, current, {"node": node}, "commit")
