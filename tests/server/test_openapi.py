"""openapi.yaml documents exactly the routes and methods the handlers serve, and the
objects the API answers with."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from jupyter_gpu_snapshot.server import handlers
from jupyter_gpu_snapshot.server.handlers import SnapshotAPIHandler, routes
from jupyter_gpu_snapshot.server.jobs import Job

from .conftest import Api, KernelConnector

SPEC = yaml.safe_load(
    (Path(handlers.__file__).parent / "openapi.yaml").read_text()
)
METHODS = ("get", "post", "put", "patch", "delete")


def _documented_path(pattern: str) -> str:
    path = pattern.removeprefix(f"/{handlers.API_PREFIX}")
    return re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", path)


def test_every_route_and_method_is_documented_and_nothing_else() -> None:
    served: dict[str, set[str]] = {}
    for pattern, handler, _ in routes(service=None, autosave=None):  # type: ignore[arg-type]
        own = {
            m for m in METHODS
            if getattr(handler, m) is not getattr(SnapshotAPIHandler, m)
        }
        served[_documented_path(pattern)] = own
    documented = {
        path: {m for m in item if m in METHODS} for path, item in SPEC["paths"].items()
    }
    assert served == documented


def _required(name: str) -> set[str]:
    return set(SPEC["components"]["schemas"][name]["required"])


def _properties(name: str) -> set[str]:
    return set(SPEC["components"]["schemas"][name]["properties"])


def test_job_fields_match() -> None:
    fields = set(Job("save", None).to_dict())
    assert _required("Job") <= fields and fields == _properties("Job")


async def test_answers_carry_the_documented_fields(api: Api) -> None:
    kernel_id = await api.start_kernel()
    job = await api.succeeded(await api.save(kernel_id))
    summary: dict[str, Any] = job["result"]
    assert _required("Summary") <= set(summary) <= _properties("Summary")
    status = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "status")
    assert _required("KernelStatus") <= set(status) == _properties("KernelStatus")
    listing = await api.ok("GET", "gpu-snapshot", "snapshots")
    store = SPEC["paths"]["/snapshots"]["get"]["responses"]["200"]["content"][
        "application/json"]["schema"]["properties"]["store"]
    assert set(listing) == {"snapshots", "store", "remote"}
    assert set(listing["store"]) == set(store["properties"])
    assert listing["store"]["free_bytes"] > 0
    code, error = await api.call("GET", "gpu-snapshot", "snapshots", "no-such")
    assert code == 404
    assert _required("Error") <= set(error) == _properties("Error")
    autosave = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "autosave")
    assert _required("AutosaveState") <= set(autosave) == _properties("AutosaveState")
    assert set(autosave["policy"]) == _properties("AutosavePolicy")
    # That snapshot's kernel served no notebook: nothing offers it back.
    assert await api.snapshots(latest="true") == []


async def test_usage_says_what_a_second_save_shares_and_a_delete_frees(
    api: Api, kernel_socket: KernelConnector
) -> None:
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    await ws.execute("import os; blob = os.urandom(16 << 20)")
    first = (await api.succeeded(await api.save(kernel_id)))["result"]
    second = (await api.succeeded(await api.save(kernel_id)))["result"]
    # The same kernel a moment later: most of its pages are in the store already.
    assert second["new_bytes"] < second["size_bytes"] / 2 < first["new_bytes"]
    listing = await api.snapshots()
    assert [s["new_bytes"] for s in listing] == [first["new_bytes"], second["new_bytes"]]

    usage = await api.ok("GET", "gpu-snapshot", "usage")
    schema = SPEC["paths"]["/usage"]["get"]["responses"]["200"]["content"][
        "application/json"]["schema"]
    assert set(usage) == set(schema["properties"])
    rows = {s["id"]: s for s in usage["snapshots"]}
    assert list(rows) == [first["id"], second["id"]]
    for row in rows.values():
        assert _required("SnapshotUsage") <= set(row) == _properties("SnapshotUsage")
    assert usage["disk_bytes"] < first["size_bytes"] + second["size_bytes"]
    await api.ok("DELETE", "gpu-snapshot", "snapshots", first["id"], expect=204)
    after = await api.ok("GET", "gpu-snapshot", "usage")
    assert after["disk_bytes"] == usage["disk_bytes"] - rows[first["id"]]["frees_bytes"]
