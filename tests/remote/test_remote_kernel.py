"""A real kernel saved on node A comes back on node B through the bucket alone.

Node A: a real snapshot-ready kernel, saved by the engine with CRIU and stopped, then
uploaded. Node B: an empty cache, a second S3 client, its own engine; it lists, downloads
(checking every digest while streaming) and restores, and the kernel answers with its state.
"""

from __future__ import annotations

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.digest import TREE_CHUNK
from jupyter_gpu_snapshot.core.store.remote import RemoteStore

from ..conftest import execute, run

STATE = """
import hashlib
import numpy as np
weights = np.random.default_rng(7).random(12_000_000)      # ~96 MB: one image file > 64 MiB
digest = hashlib.sha256(weights.tobytes()).hexdigest()
counter = 41
"""


def test_saved_on_node_a_restored_on_node_b(kernel, tmp_path, restored, remote_url, s3_options):
    kernel.execute(STATE, timeout=120)
    expected = kernel.execute("print(digest)").strip()
    engine_a = SnapshotEngine(SnapshotStore(tmp_path / "node-a"))
    target = SaveTarget(
        pid=kernel.root_pid,
        connection_info=kernel.km.get_connection_info(),
        kernel_name="python3-snapshot",
    )
    snap = run(engine_a.save(target, name="moving", stop=True))
    kernel.km.provisioner.process.wait(timeout=10)
    assert any(int(f["size"]) > TREE_CHUNK for f in snap.manifest["files"].values())
    RemoteStore(remote_url, s3_options, part_bytes=8 << 20).upload(snap.path)

    node_b = RemoteStore(remote_url, s3_options)
    assert [s.name for s in node_b.list()] == ["moving"]
    store_b = SnapshotStore(tmp_path / "node-b")
    node_b.download(snap.id, store_b)
    # It came as a chunked snapshot: recipes over a pack of node B's store.
    assert any(p.name.endswith(".chunks") for p in (store_b.root / snap.id).iterdir())
    back = run(SnapshotEngine(store_b).restore("moving"))
    client = restored.connect(back.connection_info, back.pid)
    assert execute(client, "print(hashlib.sha256(weights.tobytes()).hexdigest())").strip() == (
        expected
    )
    assert execute(client, "counter += 1; print(counter)").strip() == "42"
    assert procfs.tree_alive(back.pid)
