"""No server secret in a kernel: snapshot-ready kernels call the server with a credential
of their own, valid for their own kernel's routes and the snapshot API only."""

from __future__ import annotations

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
