"""Node compatibility on a real GPU: a snapshot that claims another GPU model is refused
before criu runs, and the same snapshot, unaltered, passes the checks against the real
inventory and restores with its tensor intact. Also measures what the mapped-file digests
cost for a kernel with torch loaded (libtorch_cuda is over 1 GB), cold and cached.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from jupyter_gpu_snapshot.config import GPUSnapshot
from jupyter_gpu_snapshot.core.errors import Incompatible
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.node.local_engine import make_engine
from tests.core.test_engine import CriuCalls

from ..conftest import RestoredTrees, execute, run, start_kernel, stop_kernel

pytestmark = pytest.mark.gpu

CLAIMED = "NVIDIA A100-SXM4-80GB (claimed by the test)"
TENSOR = """
import torch
t = torch.arange(4_000_000, device="cuda", dtype=torch.float64)
expected = float(t.sum())
print(expected)
"""


def _mapped(manifest: dict[str, Any]) -> dict[str, Any]:
    files = manifest["node"]["mapped_files"]["files"]
    return {"count": len(files), "bytes": sum(f["size"] for f in files),
            "seconds": manifest["node"]["mapped_files"]["seconds"]}


def test_another_gpu_model_is_refused_before_criu_and_the_same_node_restores(
        store, restored: RestoredTrees, figures):
    engine = make_engine(GPUSnapshot(store_dir=str(store.root)))
    k = start_kernel()
    try:
        k.execute(TENSOR, timeout=300)
        target = SaveTarget(pid=k.root_pid, connection_info=k.km.get_connection_info(),
                            kernel_name="python3-snapshot")
        cold = run(engine.save(target, name="cold"))  # the engine's digest cache is empty
        snap = run(engine.save(target, name="gpu-compat", stop=True))
        k.km.provisioner.process.wait(timeout=60)
    finally:
        stop_kernel(k)
    assert snap.manifest["gpu"]["processes"], "the kernel's CUDA state was not recorded"
    assert any("libtorch_cuda" in f["path"]
               for f in snap.manifest["node"]["mapped_files"]["files"])
    real_model = snap.manifest["gpu"]["devices"][0]["name"]

    path = snap.path / "manifest.json"
    original = path.read_bytes()
    manifest = json.loads(original)
    manifest["gpu"]["devices"][0]["name"] = CLAIMED
    manifest["signature"] = engine.store.key.sign(manifest)
    path.write_text(json.dumps(manifest))
    calls = CriuCalls(engine)
    try:
        with pytest.raises(Incompatible) as err:
            run(engine.restore(snap.id))
    finally:
        del engine.criu.run
        path.write_bytes(original)
    assert err.value.step == "compatibility"
    assert f"GPU 0 is a {real_model}, it was a {CLAIMED}" in err.value.message, err.value.message
    assert "same GPU models" in err.value.message
    assert calls.argvs == [], "criu ran for a snapshot of another GPU model"

    back = run(engine.restore(snap.id))
    client = restored.connect(back.connection_info, back.pid)
    assert execute(client, "print(float(t.sum()) == expected, t.device)").split() == [
        "True", "cuda:0"]
    figures["mapped_files"] = {
        "cold_save": {**_mapped(cold.manifest),
                      "commit_waited_s": cold.manifest["timings"].get("environment_wait")},
        "cached_save": {**_mapped(snap.manifest),
                        "commit_waited_s": snap.manifest["timings"].get("environment_wait")},
        "restore_check_s": back.timings["compatibility"],
    }
