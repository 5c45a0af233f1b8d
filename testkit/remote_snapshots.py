"""Well-formed snapshot directories made by the real store (begin + commit), without a kernel."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.snapshot import Snapshot, new_snapshot_id
from testkit.manifests import CONNECTION, kernel_section


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


REPO_ROOT = Path(__file__).resolve().parents[1]
# An upload in a process of its own, one worker and 5 MiB parts, printing its progress.
UPLOADER = textwrap.dedent(
    """
    import sys, json
    from jupyter_gpu_snapshot.core.store import RemoteStore
    url, options, path, key = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
    store = RemoteStore(url, options, key=bytes.fromhex(key) if key else None,
                        part_bytes=5 << 20, workers=1)
    def progress(done, total):
        print(done, total, flush=True)
    store.upload(path, progress=progress)
    print("finished", flush=True)
    """
)


def kill_upload_midway(
    remote_url: str, s3_options: dict[str, Any], snapshot_dir: Path, key: bytes | None = None
) -> None:
    """Upload ``snapshot_dir`` in another process and SIGKILL it once it has sent part of
    the snapshot and before it finished."""
    with subprocess.Popen(
        [sys.executable, "-c", UPLOADER, remote_url, json.dumps(s3_options), str(snapshot_dir),
         key.hex() if key else ""],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    ) as uploader:  # fmt: skip
        assert uploader.stdout is not None
        done, total = (int(x) for x in uploader.stdout.readline().split())
        assert 0 < done < total, "the uploader finished before it could be killed"
        os.kill(uploader.pid, signal.SIGKILL)
        uploader.wait(timeout=10)
