"""An open notebook continues where it was: restores switch its session to the new kernel."""

from __future__ import annotations

from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME

from .conftest import Api, KernelConnector


async def _notebook_session(api: Api, path: str) -> dict:
    return await api.ok(
        "POST",
        "api",
        "sessions",
        body={"path": path, "type": "notebook", "name": path, "kernel": {"name": KERNEL_NAME}},
        expect=201,
    )


async def test_restore_switches_the_given_session(api: Api, kernel_socket: KernelConnector):
    first = await _notebook_session(api, "work/analysis.ipynb")
    kernel_id = first["kernel"]["id"]
    ws = await kernel_socket(kernel_id)
    await ws.execute("result = sum(range(10))")
    job = await api.succeeded(await api.save(kernel_id))
    # The snapshot knows its notebook, so it is listed for it.
    assert job["result"]["notebook_path"] == "work/analysis.ipynb"
    listed = await api.snapshots(notebook_path="work/analysis.ipynb")
    assert [s["id"] for s in listed] == [job["snapshot_id"]]
    assert await api.snapshots(notebook_path="other.ipynb") == []

    # As after a reboot: the notebook's kernel is gone, the reopened notebook got a fresh one.
    await api.ok("DELETE", "api", "sessions", first["id"], expect=204)
    second = await _notebook_session(api, "work/analysis.ipynb")
    fresh_id = second["kernel"]["id"]

    restore = await api.succeeded(await api.restore(job["snapshot_id"], session_id=second["id"]))
    new_id = restore["result"]["kernel_id"]
    assert restore["result"]["session_id"] == second["id"]
    session = await api.ok("GET", "api", "sessions", second["id"])
    assert session["kernel"]["id"] == new_id
    # The fresh kernel it replaced was shut down, as a kernel change in JupyterLab does.
    kernels = await api.kernel_ids()
    assert new_id in kernels and fresh_id not in kernels
    restored = await kernel_socket(new_id)
    assert (await restored.execute("print(result)")).strip() == "45"


async def test_restore_by_path_creates_the_notebook_session(
    api: Api, kernel_socket: KernelConnector
):
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    await ws.execute("answer = 42")
    job = await api.succeeded(await api.save(kernel_id, stop=True))
    # A stopping save ends the kernel and frees its slot.
    assert kernel_id not in await api.kernel_ids()

    restore = await api.succeeded(await api.restore(job["snapshot_id"], path="notes.ipynb"))
    session_id = restore["result"]["session_id"]
    assert session_id
    session = await api.ok("GET", "api", "sessions", session_id)
    assert session["path"] == "notes.ipynb" and session["type"] == "notebook"
    assert session["kernel"]["id"] == restore["result"]["kernel_id"]
    # JupyterLab opening notes.ipynb asks for a session for that path and gets this one.
    again = await _notebook_session(api, "notes.ipynb")
    assert again["id"] == session_id
    restored = await kernel_socket(session["kernel"]["id"])
    assert (await restored.execute("print(answer)")).strip() == "42"


async def test_unknown_session_is_refused_before_anything_runs(api: Api):
    kernel_id = await api.start_kernel()
    job = await api.succeeded(await api.save(kernel_id))
    code, error = await api.call(
        "POST", "gpu-snapshot", "snapshots", job["snapshot_id"], "restore",
        body={"session_id": "no-such-session"},
    )
    assert code == 404 and "no-such-session" in error["message"]
    assert await api.kernel_ids() == [kernel_id]
