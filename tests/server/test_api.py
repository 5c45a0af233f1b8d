"""The REST API's rules: auth, XSRF, validation, one operation per kernel, status."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from jupyter_server.auth import Authorizer

from testkit.criu_fill import criu_fills_on_workers

from .conftest import Api, KernelConnector

SNAPSHOTS = ("gpu-snapshot", "snapshots")


async def _kernel_with_data(api: Api, kernel_socket: KernelConnector, mib: int = 100) -> str:
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    await ws.execute(f"blob = b'x' * ({mib} << 20); counter = 0")
    return kernel_id


async def test_ten_concurrent_saves_run_exactly_one(api: Api, kernel_socket: KernelConnector):
    kernel_id = await _kernel_with_data(api, kernel_socket)
    answers = await asyncio.gather(
        *(
            api.call("POST", "gpu-snapshot", "kernels", kernel_id, "snapshots", body={})
            for _ in range(10)
        )
    )
    codes = sorted(code for code, _ in answers)
    assert codes == [202] + [409] * 9, answers
    accepted = next(data for code, data in answers if code == 202)
    for code, data in answers:
        if code == 409:
            assert accepted["id"] in data["message"] and data["step"] == "preflight"
    job = await api.succeeded(accepted)
    assert [s["id"] for s in await api.snapshots()] == [job["snapshot_id"]]
    # The kernel is free again once the job ended.
    await api.succeeded(await api.save(kernel_id))
    assert len(await api.snapshots()) == 2


async def test_requests_without_a_token_are_refused(api: Api):
    kernel_id = await api.start_kernel()
    anonymous = {"Authorization": ""}
    for method, parts in [
        ("GET", SNAPSHOTS),
        ("GET", ("gpu-snapshot", "jobs")),
        ("GET", ("gpu-snapshot", "kernels", kernel_id, "status")),
        ("POST", ("gpu-snapshot", "kernels", kernel_id, "snapshots")),
        ("POST", (*SNAPSHOTS, "any-name", "restore")),
        ("DELETE", (*SNAPSHOTS, "any-name")),
    ]:
        code, _ = await api.call(method, *parts, headers=anonymous)
        assert code == 403, (method, parts)
    assert await api.snapshots() == []


async def test_cookie_auth_needs_xsrf_for_mutations(api: Api, jp_fetch: Any):
    kernel_id = await api.start_kernel()
    # A token request hands out the login cookie, as a browser would keep it.
    response = await jp_fetch(*SNAPSHOTS)
    login = [c.split(";")[0] for c in response.headers.get_list("Set-Cookie")]
    assert login, "no login cookie"
    page = await jp_fetch("login", headers={"Authorization": ""}, raise_error=False)
    xsrf = [
        c.split(";")[0] for c in page.headers.get_list("Set-Cookie") if c.startswith("_xsrf=")
    ]
    assert xsrf, "no XSRF cookie"
    cookie_only = {"Authorization": "", "Cookie": "; ".join(login)}

    code, _ = await api.call("GET", *SNAPSHOTS, headers=cookie_only)
    assert code == 200
    path = ("gpu-snapshot", "kernels", kernel_id, "snapshots")
    code, _ = await api.call("POST", *path, headers=cookie_only)
    assert code == 403
    code, _ = await api.call("DELETE", *SNAPSHOTS, "some-name", headers=cookie_only)
    assert code == 403
    assert await api.snapshots() == []

    token = xsrf[0].split("=", 1)[1]
    with_xsrf = {**cookie_only, "Cookie": "; ".join(login + xsrf), "X-XSRFToken": token}
    code, job = await api.call("POST", *path, headers=with_xsrf)
    assert code == 202, job
    await api.succeeded(job)


async def test_mutations_refuse_get_and_reads_refuse_post(api: Api):
    kernel_id = await api.start_kernel()
    job = await api.succeeded(await api.save(kernel_id, name="kept"))
    for method, parts in [
        ("GET", ("gpu-snapshot", "kernels", kernel_id, "snapshots")),
        ("GET", (*SNAPSHOTS, "kept", "restore")),
        ("POST", SNAPSHOTS),
        ("POST", (*SNAPSHOTS, "kept")),
        ("POST", ("gpu-snapshot", "jobs", job["id"])),
        ("DELETE", ("gpu-snapshot", "jobs", job["id"])),
    ]:
        code, _ = await api.call(method, *parts)
        assert code == 405, (method, parts)
    assert [s["name"] for s in await api.snapshots()] == ["kept"]
    assert await api.kernel_ids() == [kernel_id]


@pytest.mark.parametrize(
    "raw",
    ["..%2Fx", "..", "%2e%2e", "..%2F..%2Fetc%2Fpasswd", "a%00b", ".hidden", "x" * 65],
)
async def test_traversal_and_bad_names_are_refused(api: Api, http_server_client: Any, raw: str):
    kernel_id = await api.start_kernel()
    await api.succeeded(await api.save(kernel_id, name="x"))
    # Sent as is: the client must not re-encode the percent signs.
    base = "/a%40b/gpu-snapshot/snapshots/"
    token = {"Authorization": api.token}
    for method, suffix, body in [
        ("GET", "", None),
        ("DELETE", "", None),
        ("POST", "/restore", "{}"),
    ]:
        response = await http_server_client.fetch(
            base + raw + suffix, method=method, body=body, headers=token, raise_error=False
        )
        assert response.code in (400, 404), (method, raw, response.code)
        if response.code == 400:
            assert "invalid snapshot name" in json.loads(response.body)["message"]
    assert [s["name"] for s in await api.snapshots()] == ["x"]
    assert await api.kernel_ids() == [kernel_id]


@pytest.mark.parametrize(
    "path", ["../../../etc/passwd.ipynb", "/../etc/x.ipynb", "a/../../b.ipynb"]
)
async def test_restore_paths_outside_the_root_are_400(api: Api, path: str):
    kernel_id = await api.start_kernel()
    saved = await api.succeeded(await api.save(kernel_id, name="here"))
    code, body = await api.call(
        "POST", *SNAPSHOTS, saved["snapshot_id"], "restore", body={"path": path}
    )
    assert code == 400 and "is refused" in body["message"], body
    assert await api.ok("GET", "api", "sessions") == []
    assert await api.kernel_ids() == [kernel_id]


async def test_unknown_ids_are_404(api: Api):
    kernel_id = await api.start_kernel()
    missing_kernel = "01234567-89ab-cdef-0123-456789abcdef"
    for method, parts, body in [
        ("GET", (*SNAPSHOTS, "20260101T000000Z-deadbeef"), None),
        ("GET", (*SNAPSHOTS, "no-such-name"), None),
        ("DELETE", (*SNAPSHOTS, "20260101T000000Z-deadbeef"), None),
        ("POST", (*SNAPSHOTS, "no-such-name", "restore"), {}),
        ("GET", ("gpu-snapshot", "jobs", "0" * 32), None),
        ("GET", ("gpu-snapshot", "jobs", "not-a-job"), None),
        ("GET", ("gpu-snapshot", "kernels", missing_kernel, "status"), None),
        ("POST", ("gpu-snapshot", "kernels", missing_kernel, "snapshots"), {}),
        ("POST", ("gpu-snapshot", "kernels", "..", "snapshots"), {}),
    ]:
        code, _ = await api.call(method, *parts, body=body)
        assert code == 404, (method, parts)
    assert await api.kernel_ids() == [kernel_id]


async def test_bad_bodies_are_400_and_change_nothing(api: Api):
    kernel_id = await api.start_kernel()
    path = ("gpu-snapshot", "kernels", kernel_id, "snapshots")
    for body in [{"name": "../escape"}, {"name": 7}, {"stop": "yes"}, {"nmae": "typo"}]:
        code, error = await api.call("POST", *path, body=body)
        assert code == 400, body
        assert error["message"]
    await api.succeeded(await api.save(kernel_id, name="taken"))
    code, error = await api.call("POST", *path, body={"name": "taken"})
    assert code == 400 and "exists already" in error["message"]
    assert [s["name"] for s in await api.snapshots()] == ["taken"]


async def test_delete_then_gone(api: Api):
    kernel_id = await api.start_kernel()
    job = await api.succeeded(await api.save(kernel_id, name="short-lived"))
    await api.ok("GET", *SNAPSHOTS, job["snapshot_id"])
    await api.ok("DELETE", *SNAPSHOTS, "short-lived", expect=204)
    code, _ = await api.call("GET", *SNAPSHOTS, job["snapshot_id"])
    assert code == 404
    assert await api.snapshots() == []


async def test_status_and_lookup_of_a_ready_kernel(api: Api, kernel_socket: KernelConnector):
    kernel_id = await api.start_kernel()
    status = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "status")
    assert status["ready"] and status["reasons"] == []
    assert status["kernel_name"] == "python3-snapshot"
    assert status["cuda"] == {"state": "none", "memory_bytes": 0}
    assert status["last_snapshot"] is None and status["job"] is None
    # Which criu restores here, as the install's note says (ours, or stock and slower).
    assert status["criu"]["fast_fill"] is criu_fills_on_workers(), status["criu"]
    assert status["criu"]["detail"].startswith(
        "criu " if criu_fills_on_workers() else "stock criu "), status["criu"]

    job = await api.save(kernel_id)
    running = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "status")
    job = await api.succeeded(job)
    assert running["job"] is None or running["job"]["id"] == job["id"]
    status = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "status")
    assert status["last_snapshot"]["id"] == job["snapshot_id"]
    jobs = await api.ok("GET", "gpu-snapshot", "jobs", params={"kernel_id": kernel_id})
    assert [j["id"] for j in jobs["jobs"]] == [job["id"]]


async def test_plain_kernel_is_not_ready_and_its_save_fails_cleanly(
    api: Api, kernel_socket: KernelConnector
):
    kernel_id = await api.start_kernel("python3")
    status = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "status")
    assert not status["ready"]
    reasons = " ".join(status["reasons"])
    assert "PID namespace" in reasons and "JPY_PARENT_PID" in reasons

    job = await api.wait(await api.save(kernel_id))
    assert job["status"] == "failed" and job["error"]["step"] == "preflight"
    assert "not snapshot-ready" in job["error"]["message"]
    ws = await kernel_socket(kernel_id)
    assert (await ws.execute("print(6 * 7)")).strip() == "42"
    assert await api.snapshots() == []


class ReadOnlyAuthorizer(Authorizer):  # type: ignore[misc]
    """Lets users read kernels but not execute in them."""

    def is_authorized(self, handler: Any, user: Any, action: str, resource: str) -> bool:
        return not (resource == "kernels" and action in ("execute", "write"))


@pytest.fixture
def server_config() -> dict[str, Any]:
    return {}


class TestAuthorizer:
    @pytest.fixture
    def server_config(self) -> dict[str, Any]:
        return {"ServerApp": {"authorizer_class": ReadOnlyAuthorizer}}

    async def test_the_servers_authorizer_decides(self, api: Api, jp_serverapp: Any):
        # Kernels cannot be started through the API by this user; start one directly.
        kernel_id = await jp_serverapp.kernel_manager.start_kernel(kernel_name="python3-snapshot")
        code, _ = await api.call("GET", *SNAPSHOTS)
        assert code == 200
        code, _ = await api.call("GET", "gpu-snapshot", "kernels", kernel_id, "status")
        assert code == 200
        code, error = await api.call("POST", "gpu-snapshot", "kernels", kernel_id, "snapshots")
        assert code == 403 and "execute" in error["message"]
        code, _ = await api.call("DELETE", *SNAPSHOTS, "anything")
        assert code == 403
        assert await api.snapshots() == []


async def test_accepted_jobs_say_where_they_are(api: Api, jp_fetch: Any, jp_base_url: str):
    kernel_id = await api.start_kernel()
    response = await jp_fetch(
        "gpu-snapshot", "kernels", kernel_id, "snapshots", method="POST", body="{}"
    )
    assert response.code == 202
    job = json.loads(response.body)
    assert response.headers["Location"] == f"{jp_base_url}gpu-snapshot/jobs/{job['id']}"
    await api.succeeded(job)


async def test_job_events_reach_event_stream_subscribers(api: Api, jp_ws_fetch: Any):
    # What JupyterLab's event manager listens to.
    stream = await jp_ws_fetch("api", "events", "subscribe")
    kernel_id = await api.start_kernel()
    job = await api.save(kernel_id)
    phases: list[str] = []
    while True:
        raw = await asyncio.wait_for(stream.read_message(), 60)
        assert raw is not None
        event = json.loads(raw)
        if event.get("id") != job["id"]:
            continue
        assert event["schema_id"] == "https://events.jupyter.org/jupyter_gpu_snapshot/job/v1"
        phases.append(event["phase"])
        if event["status"] != "running":
            break
    stream.close()
    assert event["status"] == "succeeded" and event["result"]["id"] == event["snapshot_id"]
    assert phases[-1] == "done" and "dump" in phases


async def test_damaged_and_linked_snapshots_never_break_the_listing(
    api: Api, store_dir: Path, tmp_path: Path
):
    kernel_id = await api.start_kernel()
    good = (await api.succeeded(await api.save(kernel_id, name="good")))["snapshot_id"]
    bad = (await api.succeeded(await api.save(kernel_id, name="bad")))["snapshot_id"]
    manifest = store_dir / bad / "manifest.json"
    edited = json.loads(manifest.read_text())
    edited["kernel"]["connection_info"]["transport"] = "ipc"
    manifest.write_text(json.dumps(edited))
    (store_dir / "20250101T000000Z-0000abcd").symlink_to(tmp_path)
    listed = {s["id"]: s for s in await api.snapshots()}
    assert set(listed) == {good, bad}
    assert listed[good]["status"] == "ok" and listed[good]["problem"] is None
    assert listed[bad]["status"] == "damaged" and "altered" in listed[bad]["problem"]
    job = await api.wait(await api.restore(bad, path="bad.ipynb"))
    assert job["status"] == "failed" and "damaged" in job["error"]["cause"]
    code, _ = await api.call("DELETE", *SNAPSHOTS, "20250101T000000Z-0000abcd")
    assert code == 404 and (store_dir / "20250101T000000Z-0000abcd").is_symlink()
    await api.ok("DELETE", *SNAPSHOTS, bad, expect=204)
    assert [s["id"] for s in await api.snapshots()] == [good]
