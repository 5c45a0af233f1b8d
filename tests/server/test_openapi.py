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

from .conftest import Api

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
