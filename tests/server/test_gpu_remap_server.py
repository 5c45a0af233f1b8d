"""A GPU remap through the server, with the CUDA driver played by the fake (a real kernel,
real CRIU): the restore result says where the GPUs went, and the restored kernel says it
first, in the notebook. The same runs for real on the GPU machine (tests/gpu)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from testkit.fake_driver import GIB, UUID0, FakeCudaDriver, FakeGpus

from .conftest import Api, KernelConnector, serve_with_fake_cuda

SNAPSHOTS = ("gpu-snapshot", "snapshots")
MODEL = "NVIDIA Fake H100 80GB HBM3"
UUID1 = "GPU-11111111-1111-2222-3333-444444444444"


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> FakeGpus:
    """Two fake GPUs of one model; the server's kernels hold 2 GiB on the first."""
    fake = FakeCudaDriver()
    gpus = FakeGpus(fake, devices=[(MODEL, UUID0, 80 * GIB), (MODEL, UUID1, 80 * GIB)])
    serve_with_fake_cuda(monkeypatch, gpus, 2 * GIB)
    return gpus


@pytest.fixture
def snapshot_config(fake_gpus: FakeGpus) -> dict[str, Any]:
    return {}  # requested so that the engine is patched before the server starts


async def test_a_remapped_restore_reports_it_and_the_kernel_says_so_first(
    api: Api, kernel_socket: KernelConnector, fake_gpus: FakeGpus
):
    session = await api.open_notebook("remap.ipynb")
    ws = await kernel_socket(session["kernel"]["id"])
    await ws.execute("data = list(range(1000))")
    saved = await api.succeeded(await api.save(session["kernel"]["id"], stop=True))
    assert saved["result"]["gpu"]["visible"] == [UUID0, UUID1]
    fake_gpus.free_on[UUID0] = GIB  # another process filled GPU 0 meanwhile
    # Asked beforehand, the server says what a restore would do, and checks a choice.
    route = (*SNAPSHOTS, saved["snapshot_id"], "gpus")
    ahead = await api.ok("GET", *route)
    assert [d["uuid"] for d in ahead["node"]] == [UUID0, UUID1] and ahead["remap_supported"]
    assert [(d["device"], d["bytes"]) for d in ahead["devices"]] == [
        ("cuda:0", 2 * GIB), ("cuda:1", 0)]
    assert [d["to"]["index"] for d in ahead["plan"]["devices"]] == [1, 0]
    assert ahead["problem"] is None
    checked = await api.ok("GET", *route, params={"gpus": "0,1"})
    assert checked["plan"] is None and checked["problem"]["code"] == "not_ready"
    assert "GPU 0 chosen for cuda:0 has 1.0 GiB free" in checked["problem"]["message"]
    code, error = await api.call("GET", *route, params={"gpus": "cuda:1"})
    assert code == 400 and "neither a GPU index" in error["message"]
    job = await api.succeeded(await api.restore(saved["snapshot_id"], path="remap.ipynb"))
    remap = job["result"]["gpu_remap"]
    assert remap["remapped"] and not remap["chosen"]
    assert remap["notice"].startswith("This kernel was restored onto other GPUs: cuda:0 from")
    assert [(d["device"], d["to"]["uuid"]) for d in remap["devices"]] == [
        ("cuda:0", UUID1), ("cuda:1", UUID0)]
    assert fake_gpus.driver.restore_pairs[-1] == [(UUID0, UUID1), (UUID1, UUID0)]
    new_id = job["result"]["kernel_id"]
    ws = await kernel_socket(new_id)
    # The notice comes with the server's refresh of the kernel's environment; until that
    # has arrived, cells run without it. It is shown once, before the cell's own output.
    outputs = []
    for _ in range(50):
        outputs.append(await ws.execute(
            "import os; print(os.environ['JUPYTER_GPU_SNAPSHOT_KERNEL_ID'], sum(data))"))
        if outputs[-1].endswith(f"{new_id} 499500\n"):
            break
        await asyncio.sleep(0.1)
    shown = "".join(outputs)
    assert shown.count("This kernel was restored onto other GPUs") == 1, shown
    assert f"cuda:0 from GPU 0 ({UUID0}) to GPU 1 ({UUID1})" in shown
    assert (await ws.execute("print(sum(data))")) == "499500\n"
