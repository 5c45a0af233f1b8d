"""No server secret in a kernel: snapshot-ready kernels call the server with a credential
of their own, valid for what their kernel reaches (its own routes, its notebook's snapshots,
its jobs) and only while the launch that got it runs."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from tornado.httpclient import HTTPClientError

from jupyter_gpu_snapshot._constants import ENV_KERNEL_ID, ENV_TOKEN
from jupyter_gpu_snapshot.core import procfs

from .conftest import Api, KernelConnector

SNAPSHOTS = ("gpu-snapshot", "snapshots")


class KernelApi(Api):
    """The API as a kernel calls it: with the kernel's credential instead of the server's."""

    async def call(self, method: str, *parts: str, **kw: Any) -> tuple[int, Any]:
        kw["headers"] = {"Authorization": self.token}
        return await super().call(method, *parts, **kw)


def _kernel_env(jp_serverapp: Any, kernel_id: str) -> dict[str, str]:
    root = jp_serverapp.kernel_manager.get_kernel(kernel_id).provisioner.root_pid
    kernel = procfs.kernel_of(root)
    assert kernel is not None
    return dict(kernel.environ())


async def test_kernels_hold_only_their_own_scoped_credential(
    api: Api, jp_serverapp: Any, jp_ws_fetch: Any, kernel_socket: KernelConnector
) -> None:
    mine, other = await api.start_kernel(), await api.start_kernel()
    server_token = api.token.split(None, 1)[1]
    env = _kernel_env(jp_serverapp, mine)
    assert env[ENV_KERNEL_ID] == mine
    credential = env[ENV_TOKEN]
    assert credential.startswith(f"gpusnap-kernel.{mine}.")
    for kernel_id in (mine, other):
        assert not any(
            server_token in value for value in _kernel_env(jp_serverapp, kernel_id).values()
        ), "the server's token is in a kernel's environment"

    as_kernel = KernelApi(api.fetch, f"token {credential}")
    # The server's own API does not know the credential.
    for parts in (("api", "kernels"), ("api", "contents"), ("api", "sessions"),
                  ("api", "kernels", other)):
        code, _ = await as_kernel.call("GET", *parts)
        assert code == 403, parts
    with pytest.raises(HTTPClientError) as refused:
        await jp_ws_fetch("api", "kernels", other, "channels",
                          headers={"Authorization": f"token {credential}"})
    assert refused.value.code == 403
    # The extension accepts it for this kernel only.
    assert (await as_kernel.ok("GET", "gpu-snapshot", "kernels", mine, "status"))["ready"]
    assert (await as_kernel.ok("GET", "gpu-snapshot", "kernels", mine, "session")) == {
        "session": None}
    for method, parts in (
        ("GET", ("gpu-snapshot", "kernels", other, "status")),
        ("GET", ("gpu-snapshot", "kernels", other, "session")),
        ("POST", ("gpu-snapshot", "kernels", other, "snapshots")),
    ):
        code, _ = await as_kernel.call(method, *parts)
        assert code == 403, (method, parts)
    code, _ = await as_kernel.call("GET", "gpu-snapshot", "jobs", params={"kernel_id": other})
    assert code == 403
    job = await as_kernel.succeeded(await as_kernel.save(mine, name="by-itself"))
    assert [s["id"] for s in await as_kernel.snapshots()] == [job["snapshot_id"]]
    # A forged credential (another kernel's id with this MAC) opens nothing.
    forged = credential.replace(mine, other)
    code, _ = await KernelApi(api.fetch, f"token {forged}").call(
        "GET", "gpu-snapshot", "kernels", other, "status")
    assert code == 403
    # Nor may it switch another kernel's notebook to a restored kernel.
    theirs = await api.open_notebook("theirs.ipynb")
    for body in ({"session_id": theirs["id"]}, {"path": "theirs.ipynb"}):
        code, _ = await as_kernel.call(
            "POST", *SNAPSHOTS, job["snapshot_id"], "restore", body=body)
        assert code == 403, body
    ws = await kernel_socket(mine)
    assert (await ws.execute("print(1 + 1)")).strip() == "2"


def _as_kernel(api: Api, jp_serverapp: Any, kernel_id: str) -> KernelApi:
    """The API as kernel ``kernel_id`` calls it, with the credential in its environment."""
    return KernelApi(api.fetch, f"token {_kernel_env(jp_serverapp, kernel_id)[ENV_TOKEN]}")


async def _refused(as_kernel: KernelApi, method: str, *parts: str, **kw: Any) -> str:
    """The message of the 403 the kernel's credential gets."""
    code, data = await as_kernel.call(method, *parts, **kw)
    assert code == 403, (method, parts, code, data)
    return str(data["message"])


async def test_a_kernel_follows_its_own_jobs_only(api: Api, jp_serverapp: Any) -> None:
    mine = (await api.open_notebook("mine.ipynb"))["kernel"]["id"]
    theirs = (await api.open_notebook("theirs.ipynb"))["kernel"]["id"]
    as_mine = _as_kernel(api, jp_serverapp, mine)
    own_job = await as_mine.save(mine)
    their_job = await api.succeeded(await api.save(theirs))
    assert (await as_mine.succeeded(own_job))["kernel_id"] == mine
    message = await _refused(as_mine, "GET", "gpu-snapshot", "jobs", their_job["id"])
    assert f"job {their_job['id']} is a save of another kernel" in message, message
    await _refused(as_mine, "GET", "gpu-snapshot", "jobs", params={"kernel_id": theirs})


async def test_a_kernel_reaches_its_own_notebooks_snapshots_only(
    api: Api, jp_serverapp: Any
) -> None:
    mine = (await api.open_notebook("mine.ipynb"))["kernel"]["id"]
    theirs = (await api.open_notebook("theirs.ipynb"))["kernel"]["id"]
    own = (await api.succeeded(await api.save(mine, name="own")))["result"]
    their = (await api.succeeded(await api.save(theirs, name="theirs")))["result"]
    as_mine = _as_kernel(api, jp_serverapp, mine)

    assert [s["id"] for s in await as_mine.snapshots()] == [own["id"]]
    assert [s["id"] for s in await as_mine.snapshots(latest="true")] == [own["id"]]
    message = await _refused(as_mine, "GET", *SNAPSHOTS, params={"notebook_path": "theirs.ipynb"})
    assert "not the snapshots of theirs.ipynb" in message, message
    for ref in (their["id"], "theirs"):  # by id and by name
        message = await _refused(as_mine, "GET", *SNAPSHOTS, ref)
        assert f"the snapshots of its notebook (mine.ipynb) and of this kernel only; snapshot " \
            f"{their['id']} (theirs) is none of them" in message, message
        await _refused(as_mine, "PATCH", *SNAPSHOTS, ref, body={"name": "taken"})
        await _refused(as_mine, "DELETE", *SNAPSHOTS, ref)
        await _refused(as_mine, "GET", *SNAPSHOTS, ref, "gpus")
        await _refused(as_mine, "POST", *SNAPSHOTS, ref, "restore", body={})
    await _refused(as_mine, "GET", "gpu-snapshot", "usage")
    # Nothing of theirs changed; its own it renames and deletes.
    assert (await api.ok("GET", *SNAPSHOTS, their["id"]))["name"] == "theirs"
    renamed = await as_mine.ok("PATCH", *SNAPSHOTS, own["id"], body={"name": "own-2"})
    assert renamed["name"] == "own-2"
    await as_mine.ok("DELETE", *SNAPSHOTS, "own-2", expect=204)
    assert [s["id"] for s in await api.snapshots()] == [their["id"]]


async def test_a_kernel_restores_into_a_new_session_at_its_own_notebook_only(
    api: Api, jp_serverapp: Any
) -> None:
    """A restore into a new session at a path no session holds: whoever opens that
    notebook next would run in the restored kernel, its pickles loaded. Its own notebook
    only; the snapshot is still there after each refusal."""
    mine = (await api.open_notebook("mine.ipynb"))["kernel"]["id"]
    own = (await api.succeeded(await api.save(mine, name="own")))["result"]
    as_mine = _as_kernel(api, jp_serverapp, mine)
    for body in ({"path": "c.ipynb"}, {"path": "c.ipynb", "fallback": "portable"},
                 {"path": "sub/mine.ipynb"}):
        message = await _refused(as_mine, "POST", *SNAPSHOTS, own["id"], "restore", body=body)
        assert "mine.ipynb" in message, (body, message)
    assert (await api.ok("GET", *SNAPSHOTS, own["id"]))["name"] == "own"
    sessions = await api.ok("GET", "api", "sessions")
    assert [s["path"] for s in sessions] == ["mine.ipynb"], sessions


async def test_a_kernels_credential_ends_with_its_launch(
    api: Api, jp_serverapp: Any, kernel_socket: KernelConnector
) -> None:
    shut, restarted = await api.start_kernel(), await api.start_kernel()
    # Saved once it has run a cell, as a user saves one: a save of a kernel still starting
    # waits 30 s for its first answer, which a start on a loaded machine has outlasted.
    assert (await (await kernel_socket(shut)).execute("print(1)")).strip() == "1"
    as_shut = _as_kernel(api, jp_serverapp, shut)
    taken = (await api.succeeded(await as_shut.save(shut)))["result"]
    as_restarted = _as_kernel(api, jp_serverapp, restarted)
    assert (await as_restarted.ok("GET", "gpu-snapshot", "kernels", restarted, "status"))["ready"]

    await api.ok("DELETE", "api", "kernels", shut, expect=204)
    message = await _refused(as_shut, "GET", *SNAPSHOTS)
    assert f"the credential of kernel {shut} is no longer valid" in message, message
    await _refused(as_shut, "PATCH", *SNAPSHOTS, taken["id"], body={"name": "renamed"})
    assert (await api.ok("GET", *SNAPSHOTS, taken["id"]))["name"] == taken["name"]

    # A restart is a new launch, with a new credential; the old one ends with the old tree.
    await api.ok("POST", "api", "kernels", restarted, "restart")
    await _refused(as_restarted, "GET", "gpu-snapshot", "kernels", restarted, "status")
    ws = await kernel_socket(restarted)
    assert (await ws.execute("print(1)")).strip() == "1"
    as_new = _as_kernel(api, jp_serverapp, restarted)
    assert as_new.token != as_restarted.token
    assert (await as_new.ok("GET", "gpu-snapshot", "kernels", restarted, "status"))["ready"]


async def test_a_dead_kernels_credential_dies_with_it(api: Api, jp_serverapp: Any) -> None:
    kernel_id = await api.start_kernel()
    as_kernel = _as_kernel(api, jp_serverapp, kernel_id)
    assert (await as_kernel.ok("GET", "gpu-snapshot", "kernels", kernel_id, "status"))["ready"]
    root = jp_serverapp.kernel_manager.get_kernel(kernel_id).provisioner.root_pid
    await asyncio.to_thread(procfs.kill_tree, root)
    # The server's restarter finds it dead within seconds (and starts a blank kernel).
    deadline = time.monotonic() + 60
    while (code := (await as_kernel.call("GET", *SNAPSHOTS))[0]) == 200:
        assert time.monotonic() < deadline, "the dead kernel's credential still works"
        await asyncio.sleep(0.2)
    assert code == 403
    # The test ends once the blank kernel has started: the server's shutdown at teardown
    # fails on a kernel caught halfway through its restart.
    km = jp_serverapp.kernel_manager.get_kernel(kernel_id)
    while getattr(km.provisioner, "root_pid", None) in (None, root) or not km.ready.done():
        assert time.monotonic() < deadline, "the restarter started no new kernel"
        await asyncio.sleep(0.2)
