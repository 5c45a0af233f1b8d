"""The REST round trip with CUDA state, for real on the GPU machine: a torch kernel is
saved through the server, its status shows the CUDA state, and the restored kernel in the
notebook's session still has its tensors on the GPU."""

from __future__ import annotations

import pytest

from testkit.gpu_check import no_gpu_reason

from .conftest import Api, KernelConnector

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(no_gpu_reason() is not None, reason=f"GPU test: {no_gpu_reason()}"),
]

TENSORS = """
import torch
x = torch.arange(50_000_000, device="cuda", dtype=torch.float32)
scratch = torch.empty(250_000_000, device="cuda"); del scratch  # cached, not live
total = float(x.sum())
"""


async def test_torch_kernel_round_trip_through_the_server(
    api: Api, kernel_socket: KernelConnector
) -> None:
    session = await api.open_notebook("gpu.ipynb")
    kernel_id = session["kernel"]["id"]
    ws = await kernel_socket(kernel_id)
    await ws.execute(TENSORS, timeout=300)
    status = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "status")
    assert status["ready"], status["reasons"]
    assert status["cuda"]["state"] == "running"
    assert status["cuda"]["memory_bytes"] >= 200_000_000

    job = await api.succeeded(await api.save(kernel_id, stop=True))
    gpu = job["result"]["gpu"]
    assert gpu["moved_bytes"] > 0 and gpu["allocator_caches"]["released"], gpu

    restore = await api.succeeded(await api.restore(job["snapshot_id"], path="gpu.ipynb"))
    new_id = restore["result"]["kernel_id"]
    ws = await kernel_socket(new_id)
    out = await ws.execute("print(float(x.sum()) == total, x.device)", timeout=120)
    assert out.split() == ["True", "cuda:0"]
    status = await api.ok("GET", "gpu-snapshot", "kernels", new_id, "status")
    assert status["cuda"]["state"] == "running", status["cuda"]
    session = await api.ok("GET", "api", "sessions", restore["result"]["session_id"])
    assert session["path"] == "gpu.ipynb" and session["kernel"]["id"] == new_id
