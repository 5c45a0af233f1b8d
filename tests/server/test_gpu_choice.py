"""``gpus`` in a restore request: its shape is checked at once (400, no job), and a snapshot
without CUDA state refuses it in the job's preflight, leaving no kernel slot behind. Placing
GPUs is tested in test_gpu_remap_server.py (fake driver) and tests/gpu/test_remap_gpu.py."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import Api

SNAPSHOTS = ("gpu-snapshot", "snapshots")


@pytest.mark.parametrize("gpus,says", [
    ("1,0", "field 'gpus' has the wrong type"),
    ([], "gpus must be a non-empty list"),
    ([True], "gpus entry True is neither a GPU index nor a GPU UUID"),
    (["cuda:1"], "gpus entry 'cuda:1' is neither"),
    ([0.5], "gpus entry 0.5 is neither"),
])
async def test_a_malformed_gpus_is_400_before_any_job(api: Api, gpus: Any, says: str):
    kernel_id = await api.start_kernel()
    saved = await api.succeeded(await api.save(kernel_id, name="cpu"))
    code, error = await api.call(
        "POST", *SNAPSHOTS, saved["snapshot_id"], "restore", body={"gpus": gpus}
    )
    assert code == 400 and says in error["message"], error
    assert error["code"] == "invalid_request"
    jobs = (await api.ok("GET", "gpu-snapshot", "jobs"))["jobs"]
    assert [j["kind"] for j in jobs] == ["save"]
    assert await api.kernel_ids() == [kernel_id]


async def test_gpus_for_a_snapshot_without_cuda_fails_at_preflight(api: Api):
    kernel_id = await api.start_kernel()
    saved = await api.succeeded(await api.save(kernel_id, name="cpu", stop=True))
    job = await api.wait(await api.restore(saved["snapshot_id"], gpus=[0]))
    assert job["status"] == "failed" and job["error"]["code"] == "invalid_request"
    assert "holds no CUDA state" in job["error"]["message"]
    assert await api.kernel_ids() == []
    ahead = await api.ok("GET", *SNAPSHOTS, saved["snapshot_id"], "gpus")
    assert ahead["devices"] == [] and ahead["plan"] is None and ahead["problem"] is None
    checked = await api.ok("GET", *SNAPSHOTS, saved["snapshot_id"], "gpus",
                           params={"gpus": "0"})
    assert "holds no CUDA state" in checked["problem"]["message"]
    done = await api.succeeded(await api.restore(saved["snapshot_id"]))
    assert done["result"]["gpu_remap"] is None
