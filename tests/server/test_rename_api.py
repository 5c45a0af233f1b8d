"""PATCH gpu-snapshot/snapshots/{id}: rename through the REST API."""

from __future__ import annotations

from .conftest import Api

SNAPSHOTS = ("gpu-snapshot", "snapshots")


async def test_rename_then_listed_and_found_by_the_new_name(api: Api):
    kernel_id = await api.start_kernel()
    job = await api.succeeded(await api.save(kernel_id, name="first-name"))
    snapshot_id = job["snapshot_id"]

    summary = await api.ok("PATCH", *SNAPSHOTS, snapshot_id, body={"name": "second-name"})

    assert summary["id"] == snapshot_id and summary["name"] == "second-name"
    assert [s["name"] for s in await api.snapshots()] == ["second-name"]
    assert (await api.ok("GET", *SNAPSHOTS, "second-name"))["id"] == snapshot_id
    code, _ = await api.call("GET", *SNAPSHOTS, "first-name")
    assert code == 404


async def test_rename_refusals_are_400_404_and_change_nothing(api: Api):
    kernel_id = await api.start_kernel()
    first = (await api.succeeded(await api.save(kernel_id, name="one")))["snapshot_id"]
    await api.succeeded(await api.save(kernel_id, name="two"))
    for body, message in [
        ({"name": "../escape"}, "invalid snapshot name"),
        ({"name": "two"}, "exists already"),
        ({}, "names no new name"),
        ({"name": 5}, "wrong type"),
        ({"name": "x", "size": 1}, "unknown field"),
    ]:
        code, error = await api.call("PATCH", *SNAPSHOTS, first, body=body)
        assert code == 400 and message in error["message"], (body, code, error)
        assert error["code"] == "invalid_request"
    code, error = await api.call(
        "PATCH", *SNAPSHOTS, "20260101T000000Z-deadbeef", body={"name": "x"}
    )
    assert code == 404
    assert sorted(s["name"] for s in await api.snapshots()) == ["one", "two"]
