"""A snapshot stays its notebook's when the notebook is renamed.

JupyterLab makes every new notebook as ``Untitled.ipynb`` and renames it at its first save;
the file browser renames notebooks and their folders. The server follows each rename it
sees (jupyter_server's contents events): the snapshots taken before it list under the new
path everywhere (the listing, ``latest``, a kernel's status, what the notebook's own kernel
reaches), the notebook's own settings go along, and the next notebook made at the old path
is a new one with no snapshot. Scenarios with a real server, real kernels and CRIU.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.snapshot import is_default_name
from jupyter_gpu_snapshot.node.local_engine import LocalEngine
from jupyter_gpu_snapshot.node.notebook_moves import MOVES_FILE, Move, NotebookMoves, carried
from jupyter_gpu_snapshot.node.snapshots import NodeSnapshots
from testkit.manifests import commit_tiny

from .conftest import Api, recorded_events

SNAPSHOTS_EVENT = "https://events.jupyter.org/jupyter_gpu_snapshot/snapshots/v1"


async def new_notebook(api: Api, path: str) -> dict[str, Any]:
    """A notebook file at ``path`` and its session with a new kernel, as JupyterLab's
    File, New, Notebook makes them."""
    await api.ok("PUT", "api", "contents", path, expect=201,
                 body={"type": "notebook", "content": {
                     "cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}})
    return await api.open_notebook(path)


async def first_save_rename(
    api: Api, session: dict[str, Any], path: str, events: list[dict[str, Any]]
) -> None:
    """What JupyterLab's first save does: rename the file, then move the session to it;
    returns once the server said that the snapshots moved (its snapshots/v1 event)."""
    await renamed(api, session["path"], path, events)
    await api.ok("PATCH", "api", "sessions", session["id"], body={"path": path})


async def renamed(api: Api, source: str, dest: str, events: list[dict[str, Any]]) -> None:
    """Rename through the contents API; returns once the server followed the rename."""
    seen = len(events)
    await api.ok("PATCH", "api", "contents", source, body={"path": dest})
    deadline = time.monotonic() + 30
    while not any(e.get("notebook_path") == dest for e in events[seen:]):
        assert time.monotonic() < deadline, f"the rename of {source} was not followed"
        await asyncio.sleep(0.01)


async def test_a_snapshot_follows_its_notebook_across_the_first_save_rename(
    api: Api, jp_serverapp: Any
):
    events = recorded_events(jp_serverapp, SNAPSHOTS_EVENT)
    session = await new_notebook(api, "Untitled.ipynb")
    kernel_id = session["kernel"]["id"]
    job = await api.succeeded(await api.save(kernel_id))
    snapshot_id = job["snapshot_id"]
    # Nobody named it: it is named from its notebook and the local time.
    name = job["result"]["name"]
    assert name.startswith("Untitled-") and is_default_name(name, job["result"]["created"])

    await first_save_rename(api, session, "demo.ipynb", events)

    [listed] = await api.snapshots()
    assert (listed["notebook_path"], listed["saved_notebook_path"]) == (
        "demo.ipynb", "Untitled.ipynb")
    assert [s["id"] for s in await api.snapshots(notebook_path="demo.ipynb")] == [snapshot_id]
    assert await api.snapshots(notebook_path="Untitled.ipynb") == []
    assert [s["id"] for s in await api.snapshots(latest="true")] == [snapshot_id]
    status = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "status")
    assert status["last_snapshot"]["id"] == snapshot_id
    assert status["last_snapshot"]["notebook_path"] == "demo.ipynb"
    assert (await api.ok("GET", "gpu-snapshot", "snapshots", snapshot_id))[
        "notebook_path"] == "demo.ipynb"
    assert {"action": "notebook_moved", "source_path": "Untitled.ipynb",
            "notebook_path": "demo.ipynb"}.items() <= events[-1].items()

    # The next new notebook gets the old name, and nothing of the one before.
    fresh = await new_notebook(api, "Untitled.ipynb")
    status = await api.ok("GET", "gpu-snapshot", "kernels", fresh["kernel"]["id"], "status")
    assert status["last_snapshot"] is None
    assert await api.snapshots(notebook_path="Untitled.ipynb", latest="true") == []
    # Its own snapshot stays its own: the rename came before it was taken.
    second = await api.succeeded(await api.save(fresh["kernel"]["id"]))
    assert [s["id"] for s in await api.snapshots(notebook_path="Untitled.ipynb")] == [
        second["snapshot_id"]]
    assert [s["id"] for s in await api.snapshots(notebook_path="demo.ipynb")] == [snapshot_id]


async def test_a_folder_rename_moves_its_notebooks_snapshots_and_their_settings(
    api: Api, jp_serverapp: Any
):
    events = recorded_events(jp_serverapp, SNAPSHOTS_EVENT)
    await api.ok("PUT", "api", "contents", "work", body={"type": "directory"}, expect=201)
    session = await new_notebook(api, "work/train.ipynb")
    kernel_id = session["kernel"]["id"]
    await api.ok("PUT", "gpu-snapshot", "kernels", kernel_id, "autosave",
                 body={"enabled": False})
    job = await api.succeeded(await api.save(kernel_id))

    await renamed(api, "work", "done", events)
    await api.ok("PATCH", "api", "sessions", session["id"], body={"path": "done/train.ipynb"})

    assert [s["id"] for s in await api.snapshots(notebook_path="done/train.ipynb")] == [
        job["snapshot_id"]]
    autosave = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "autosave")
    assert autosave["override"] == {"enabled": False}
    assert autosave["policy"]["enabled"] is False


def test_the_renames_are_kept_privately_beside_the_snapshots(tmp_path: Path):
    """Renames outlive the server in the user's own directory, never through a link; the
    CLI's listing places snapshots with them as the server's does."""
    store = SnapshotStore(tmp_path / "store", tmp_path / "key")
    before = commit_tiny(store, "before", notebook="Untitled.ipynb")
    moves = NotebookMoves(store.root)
    moves.record("/Untitled.ipynb", "demo.ipynb")
    time.sleep(0.01)  # the next snapshot is taken after the rename
    after = commit_tiny(store, "after", notebook="Untitled.ipynb")

    written = store.root / MOVES_FILE
    assert written.stat().st_mode & 0o777 == 0o600
    node = NodeSnapshots(LocalEngine(store), moves=NotebookMoves(store.root))
    placed = {s["id"]: s["notebook_path"] for s in node.summaries({})}
    assert placed == {before: "demo.ipynb", after: "Untitled.ipynb"}
    assert [s.id for s in node.list("demo.ipynb")] == [before]

    # A link planted in its place is not followed: it reads as no renames.
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"moves": [
        {"source": "Untitled.ipynb", "dest": "stolen.ipynb", "at": time.time() + 60}]}))
    written.unlink()
    written.symlink_to(outside)
    assert NotebookMoves(store.root).moves() == []


def test_a_path_is_carried_through_the_renames_after_its_snapshot_in_order():
    moves = [Move("a.ipynb", "b.ipynb", 10.0), Move("dir", "other", 20.0),
             Move("b.ipynb", "dir/c.ipynb", 30.0)]
    assert carried("a.ipynb", 5.0, moves) == "dir/c.ipynb"
    assert carried("a.ipynb", 15.0, moves) == "a.ipynb"  # taken after its notebook moved
    assert carried("dir/x.ipynb", 5.0, moves) == "other/x.ipynb"
    assert carried("directory/x.ipynb", 5.0, moves) == "directory/x.ipynb"  # not in dir/
