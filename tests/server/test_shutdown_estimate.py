"""A kernel's status says whether its save at shutdown fits the server's budget, timed by
the rates its own past saves measured: a kernel grown too big is known before the server
stops, not only from the log after."""

from __future__ import annotations

import pytest

from .conftest import Api, Json, KernelConnector


@pytest.fixture
def snapshot_config() -> Json:
    return {"snapshot_on_shutdown": True, "shutdown_budget": 25.0}


async def test_the_status_times_the_shutdown_save_from_the_kernels_own_saves(
    api: Api, kernel_socket: KernelConnector
):
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    await ws.execute("import os; blob = os.urandom(300 << 20)")
    status = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "status")
    before = status["shutdown_save"]
    assert before["budget"] == 25.0 and before["fits"] is (before["seconds"] <= 25.0)

    job = await api.succeeded(await api.save(kernel_id))
    status = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "status")
    after = status["shutdown_save"]
    # Learned from that save: about as long as it took (its size, the kernel now).
    took = job["result"]["timings"]["total"]
    assert after["learned_from"] >= 1
    assert took * 0.5 < after["seconds"] < took * 3 + 2, (took, after)
