"""Scenarios for the ``%gpu_snapshot widget`` panel, without a browser.

The panel runs in a real python3-snapshot kernel of a real ``jupyter server``. The tests
see it the way a frontend does, through its comm messages on IOPub, click its buttons the
way a frontend does (a ``custom`` click message on the button's comm) or by calling the
click handlers inside the kernel, and check the effects through the server's REST API.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.blocking import BlockingKernelClient

from jupyter_gpu_snapshot.core.store.manifest import ManifestPolicy
from jupyter_gpu_snapshot.core.store.store import KERNEL_LOG_SUBDIR, SnapshotStore
from testkit import stored_pages
from testkit.criu_wrappers import install, pauses_after_the_dump
from testkit.magic_fixtures import (
    Cell,
    JupyterServer,
    NotebookKernel,
    jupyter_server,
    notebook,
    ok,
)
from testkit.manifests import move_to_another_node

__all__ = ["jupyter_server", "notebook"]  # the fixtures, imported for pytest

PANEL = "p = get_ipython().magics_manager.registry['GPUSnapshotMagics'].panel"


def show_panel(notebook: NotebookKernel) -> Cell:
    """``%gpu_snapshot widget``, then wait for the panel's first poll of the server."""
    cell = notebook.run("%gpu_snapshot widget")
    assert cell.status == "ok", cell
    assert any(
        "application/vnd.jupyter.widget-view+json" in d.get("data", {}) for d in cell.displays
    ), cell.displays
    notebook.ok(
        f"""
        import time
        {PANEL}
        deadline = time.monotonic() + 20
        while p.refreshes < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert p.refreshes >= 1
        """
    )
    return cell


def panel_state(notebook: NotebookKernel) -> dict[str, Any]:
    return dict(json.loads(notebook.ok(
        f"""
        import json
        {PANEL}
        print(json.dumps({{
            "readiness": p.readiness.value, "cuda": p.cuda.value, "last": p.last.value,
            "autosave": p.autosave.value, "message": p.message.value, "error": p.error.value,
            "rows": list(p.snapshots), "listing": p.snapshot_list.value,
            "choices": [value for _, value in p.snapshot_choice.options],
            "chosen": p.snapshot_choice.value, "confirming": p.confirming_delete,
            "delete_label": p.delete_button.description,
            "buttons_disabled": [p.restore_button.disabled, p.delete_button.disabled],
            "save_disabled": p.save_button.disabled,
        }}))
        """
    )))


def wait_panel(notebook: NotebookKernel, condition: str, timeout: float = 30) -> None:
    """Wait inside the kernel until a condition on the panel ``p`` holds."""
    notebook.ok(
        f"""
        {PANEL}
        deadline = time.monotonic() + {timeout}
        while not ({condition}) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {condition}, ({condition!r}, p.error.value, p.message.value)
        """,
        timeout=timeout + 10,
    )


def comm_ids(cell: Cell) -> dict[tuple[str, str], str]:
    """(model name, description) -> comm id, from the comm_open messages a display sent."""
    found = {}
    for msg in cell.iopub:
        if msg["msg_type"] == "comm_open":
            state = msg["content"]["data"]["state"]
            key = (state.get("_model_name", ""), str(state.get("description", "")))
            found[key] = msg["content"]["comm_id"]
    return found


def click_through_comm(client: BlockingKernelClient, comm_id: str) -> None:
    """What JupyterLab sends when a user clicks a button."""
    content = {"comm_id": comm_id, "data": {"method": "custom", "content": {"event": "click"}}}
    client.shell_channel.send(client.session.msg("comm_msg", content))



def test_panel_shows_the_kernel_and_saves_on_a_click(
    jupyter_server: JupyterServer, notebook: NotebookKernel
) -> None:
    cell = show_panel(notebook)
    state = panel_state(notebook)
    assert "Snapshot-ready" in state["readiness"]
    assert "CUDA: not in use by this kernel." in state["cuda"]
    assert "A snapshot now would hold about" in state["cuda"]
    assert "No snapshot yet" in state["last"]
    # Cells ran in this kernel: the server's policy, and an autosave planned.
    assert "Autosave: every 15 min; next in 1" in state["autosave"], state["autosave"]
    assert state["rows"] == [] and state["error"] == ""
    assert state["choices"] == [] and state["buttons_disabled"] == [True, True]

    notebook.ok(f"{PANEL}; p.name_input.value = 'clicked'")
    click_through_comm(notebook.client, comm_ids(cell)[("ButtonModel", "Save")])
    job = jupyter_server.wait_kernel_job(notebook.kernel_id)
    assert job["status"] == "succeeded", job
    snapshot_id = job["result"]["id"]
    assert job["result"]["name"] == "clicked"
    assert [s["id"] for s in jupyter_server.snapshots(notebook.path)] == [snapshot_id]

    wait_panel(notebook, f"{snapshot_id!r} in p.snapshots and 'Saved' in p.message.value")
    state = panel_state(notebook)
    assert "Saved clicked: " in state["message"] and "B" in state["message"]
    assert f"Last snapshot: clicked ({snapshot_id})" in state["last"]
    assert "<b>clicked</b>" in state["listing"] and snapshot_id in state["listing"]
    assert state["choices"] == [snapshot_id] and state["chosen"] == snapshot_id
    assert state["buttons_disabled"] == [False, False]
    assert state["error"] == ""

    # The panel's close button stops the polling and closes every widget's comm.
    closing = notebook.run(f"{PANEL}; p.close_button.click(); p._thread.join(10)")
    assert closing.status == "ok", closing
    closed = {m["content"]["comm_id"] for m in closing.iopub if m["msg_type"] == "comm_close"}
    assert set(comm_ids(cell).values()) <= closed
    out = notebook.ok(
        f"{PANEL}; n = p.refreshes; time.sleep(1.5); print(p._thread.is_alive(), p.refreshes - n)"
    )
    assert out == "False 0\n"


@pytest.fixture
def server_with_a_slow_save(tmp_path: Path) -> Iterator[JupyterServer]:
    """A server whose saves stay under way for 2 s after criu has let the kernel run again,
    so that a panel polling from the kernel surely sees the save running, however fast the
    machine writes (a save of a few hundred MiB can otherwise end between two polls)."""
    criu = install(tmp_path, pauses_after_the_dump(2.0), "criu-pauses-after-the-dump")
    server = JupyterServer(tmp_path / "server", options=[f"--GPUSnapshot.criu_path={criu}"])
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_panel_follows_a_save_started_elsewhere_while_the_kernel_is_busy(
    server_with_a_slow_save: JupyterServer,
) -> None:
    server = server_with_a_slow_save
    notebook = server.open_notebook("busy.ipynb")
    cell = show_panel(notebook)
    ids = comm_ids(cell)
    progress_id = ids[("FloatProgressModel", "")]
    notebook.ok(f"import os; blob = os.urandom(64 << 20); {PANEL}; p.idle_poll = 0.05")

    # A long cell keeps the kernel busy until its panel has shown the save's result (and a
    # second more, since the panel's thread and the cell send on IOPub independently);
    # meanwhile the save comes from elsewhere (the toolbar uses the same REST call).
    msg_id = notebook.client.execute(
        "deadline = time.monotonic() + 90\n"
        "while 'Saved from-elsewhere' not in p.message.value and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "time.sleep(1)\n"
    )
    updates: list[tuple[str, dict[str, Any]]] = []
    busy = saved_at = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        msg = notebook.client.get_iopub_msg(timeout=100)
        content = msg["content"]
        if msg["msg_type"] == "status" and msg["parent_header"].get("msg_id") == msg_id:
            if content["execution_state"] == "busy":
                busy = True
                job = server.start_save(notebook.kernel_id, "from-elsewhere")
            elif content["execution_state"] == "idle":
                break
        elif msg["msg_type"] == "comm_msg" and busy:
            state = content["data"].get("state", {})
            updates.append((content["comm_id"], state))
            if "Saved from-elsewhere" in str(state.get("value", "")):
                saved_at = len(updates)
    assert busy, "the long cell never started"
    done = server.wait_job(job["id"])
    assert done["status"] == "succeeded", done

    phases = [s["value"] for _, s in updates if str(s.get("value", "")).startswith("save: ")]
    fractions = [s["value"] for cid, s in updates if cid == progress_id and "value" in s]
    # While the kernel ran the long cell, the panel showed the save's phases with bytes...
    assert any(
        p.startswith(("save: writing memory: ", "save: committing: ")) and " of " in p
        for p in phases
    ), phases
    assert any(0 < f <= 1 for f in fractions), fractions
    # ... and then its result, all while the cell ran.
    assert saved_at is not None, updates
    wait_panel(notebook, f"{done['result']['id']!r} in p.snapshots")


def test_delete_and_restore_buttons(jupyter_server: JupyterServer) -> None:
    path = "buttons.ipynb"
    first = jupyter_server.open_notebook(path)
    first.ok("origin = 'the first kernel'")
    for name in ("keep", "damaged", "drop"):
        assert first.ok(f"%gpu_snapshot save {name}").startswith("Saved snapshot")
    by_name = {s["name"]: s["id"] for s in jupyter_server.snapshots(path)}
    jupyter_server.shutdown_kernel(first.kernel_id)  # as after a reboot: only snapshots left

    second = jupyter_server.open_notebook(path)
    second.ok("origin = 'the second kernel'")
    show_panel(second)
    state = panel_state(second)
    newest_first = [by_name["drop"], by_name["damaged"], by_name["keep"]]
    assert state["rows"] == state["choices"] == newest_first
    assert state["chosen"] == by_name["drop"]  # the newest, until one is chosen

    def choose(snapshot_id: str) -> None:
        second.ok(f"{PANEL}; p.snapshot_choice.value = {snapshot_id!r}")

    # Delete asks first; the second click deletes. Choosing another asks again.
    delete = f"{PANEL}; p.delete_button.click()"
    second.ok(delete)
    state = panel_state(second)
    assert state["confirming"] == by_name["drop"] and state["delete_label"] == "Really delete?"
    choose(by_name["keep"])
    assert panel_state(second)["confirming"] is None
    choose(by_name["drop"])
    second.ok(delete)
    assert by_name["drop"] in [s["id"] for s in jupyter_server.snapshots(path)]
    second.ok(delete)
    assert [s["id"] for s in jupyter_server.snapshots(path)] == [
        by_name["keep"], by_name["damaged"]
    ]
    state = panel_state(second)
    assert state["rows"] == state["choices"] == [by_name["damaged"], by_name["keep"]]
    assert state["chosen"] == by_name["damaged"] and state["delete_label"] == "Delete"

    # Restores that cannot work show their error in the panel; the kernel is unharmed.
    # A damaged image (one of its pages, in the store's pack): the server's restore job
    # fails when it checks the files.
    damaged_dir = jupyter_server.store / by_name["damaged"]
    image = stored_pages.largest_chunked(damaged_dir)
    stored_pages.flip_page_byte(jupyter_server.store, damaged_dir, image)
    restore = f"{PANEL}; p.restore_button.click()"
    second.ok(restore)
    wait_panel(second, "'restore:' in p.error.value")
    error = panel_state(second)["error"]
    assert f"restore: verify failed: image file {image} of {by_name['damaged']} does " \
        "not match its" in error, error
    # A snapshot of this very kernel: refused before any job, since this kernel holds the
    # ports the restored one would listen on.
    assert second.ok("%gpu_snapshot save mine").startswith("Saved snapshot")
    mine = next(s["id"] for s in jupyter_server.snapshots(path) if s["name"] == "mine")
    wait_panel(second, f"{mine!r} in p.snapshots", timeout=20)
    # The deleted choice gave way to the newest, and the newest is followed from then on.
    assert panel_state(second)["chosen"] == mine
    second.ok(restore)
    error = panel_state(second)["error"]
    assert "restore: preflight failed: snapshot " in error, error
    assert "this kernel holds the ports" in error, error
    assert [j for j in jupyter_server.get("gpu-snapshot/jobs")["jobs"]
            if j["kind"] == "restore" and j["snapshot_id"] == mine] == []
    assert second.ok("print(origin)") == "the second kernel\n"
    assert jupyter_server.session(second.session_id)["kernel"]["id"] == second.kernel_id

    # Restoring the first kernel's snapshot switches the notebook to a new kernel with the
    # first kernel's state; the second kernel is retired, as when one changes kernels.
    choose(by_name["keep"])
    second.ok(restore)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        session = jupyter_server.session(second.session_id)
        if session["kernel"]["id"] != second.kernel_id:
            break
        time.sleep(0.1)
    new_kernel = session["kernel"]["id"]
    assert new_kernel != second.kernel_id
    restored = jupyter_server.connect(new_kernel)
    assert ok(restored, "print(origin)") == "the first kernel\n"
    assert second.kernel_id not in jupyter_server.kernel_ids()
    # The restored kernel knows its slot, and its own panel works.
    assert f"Kernel {new_kernel}: ready" in ok(restored, "%gpu_snapshot status")


def test_a_job_the_server_forgot_stops_no_poll(
    jupyter_server: JupyterServer, notebook: NotebookKernel
) -> None:
    """A copy saved while its panel followed a job, restored after the server restarted,
    follows a job id the server no longer knows: the panel drops it and goes on."""
    show_panel(notebook)
    notebook.ok(f"{PANEL}; p._tracked['no-such-job'] = {{'id': 'no-such-job'}}; p.refresh(True)")
    state = panel_state(notebook)
    assert state["error"] == "", state["error"]
    assert "Snapshot-ready" in state["readiness"]
    assert notebook.ok(f"{PANEL}; print(sorted(p._tracked))").strip() == "[]"


@pytest.fixture(autouse=True)
def _no_leftover_jobs(jupyter_server: JupyterServer) -> Iterator[None]:
    yield
    running = [
        j for j in jupyter_server.get("gpu-snapshot/jobs")["jobs"] if j["status"] == "running"
    ]
    assert running == []


def test_sizes_say_what_the_save_wrote_when_pages_were_shared() -> None:
    from jupyter_gpu_snapshot.kernel.presentation import snapshot_size_text

    gib, mib = 1 << 30, 1 << 20
    assert snapshot_size_text({"size_bytes": int(1.2 * gib), "new_bytes": 45 * mib}) == (
        "1.2 GiB (45.0 MiB new)")
    # All of it written (a first save, a snapshot from before chunking): said once.
    assert snapshot_size_text({"size_bytes": 3 * mib, "new_bytes": 3 * mib + 768}) == "3.0 MiB"
    assert snapshot_size_text({"size_bytes": 3 * mib}) == "3.0 MiB"


def _hibernation_state(server: JupyterServer, kernel_id: str) -> str | None:
    listed = {k["kernel_id"]: k for k in server.get("gpu-snapshot/hibernation")["kernels"]}
    return (listed.get(kernel_id) or {}).get("state")


def test_the_panel_sets_the_notebooks_hibernation_and_hibernates_the_kernel(
    jupyter_server: JupyterServer,
) -> None:
    notebook = jupyter_server.open_notebook("idle-panel.ipynb")
    notebook.ok("kept = 'by the panel'")
    show_panel(notebook)
    wait_panel(notebook, "'never by itself (the server' in p.hibernation.value")
    notebook.ok(f"{PANEL}; p.hibernate_mode.value = 'after'; p.hibernate_minutes.value = 45;"
                " p.hibernate_apply.click()")
    wait_panel(notebook, "'after 45 min idle (this notebook' in p.hibernation.value")
    policy = jupyter_server.get(f"gpu-snapshot/kernels/{notebook.kernel_id}/autosave")
    assert policy["override"] == {"hibernate_after_minutes": 45}
    # The gpu tier's time is the notebook's own as well, beside the process tier's.
    assert "GPU released: after 10 min idle (the server" in notebook.ok(
        f"{PANEL}; print(p.hibernation.value)")
    notebook.ok(f"{PANEL}; p.hibernate_tier.value = 'gpu'; p.hibernate_mode.value = 'never';"
                " p.hibernate_apply.click()")
    wait_panel(notebook, "'GPU released: never by itself (this notebook' in p.hibernation.value")
    policy = jupyter_server.get(f"gpu-snapshot/kernels/{notebook.kernel_id}/autosave")
    assert policy["override"] == {"hibernate_after_minutes": 45, "release_gpu_after_minutes": 0}

    # Hibernate now: once the click's handling has ended, the kernel's process ends.
    notebook.ok(f"{PANEL}; p.hibernate_button.click(); print(p.message.value)")
    deadline = time.monotonic() + 60
    while _hibernation_state(jupyter_server, notebook.kernel_id) != "hibernated":
        assert time.monotonic() < deadline, "the kernel did not hibernate"
        time.sleep(0.2)
    # This test's client talks to the kernel's ports directly, past the server's websocket:
    # it wakes the kernel through the API, then finds its state.
    code, _ = jupyter_server.request(
        "POST", f"gpu-snapshot/kernels/{notebook.kernel_id}/wake")
    assert code == 202
    while _hibernation_state(jupyter_server, notebook.kernel_id) is not None:
        assert time.monotonic() < deadline, "the kernel did not wake"
        time.sleep(0.2)
    # Its IOPub subscription reaches the woken kernel a moment after the kernel answers
    # (JupyterLab's websocket is re-joined by the server); until then a cell's output is lost.
    for _ in range(10):
        with contextlib.suppress(TimeoutError):
            said = notebook.ok("print(kept)", timeout=5)
            if said == "":  # the reply came, its output went out before the re-join
                continue
            assert said == "by the panel\n"
            break
    else:
        raise AssertionError("the woken kernel's output never arrived")


class _FallbackClient:
    """The server as the panel sees it, for a restore whose image was refused: jobs the
    test ends by hand, and every call the panel made."""

    kernel_id = "k-panel"

    def __init__(self) -> None:
        self.jobs_by_id: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, Any]] = []

    def session(self) -> dict[str, Any]:
        return {"id": "s-1", "path": "work/a.ipynb"}

    def status(self) -> dict[str, Any]:
        return {"ready": True, "reasons": [], "cuda": None, "last_snapshot": None}

    def autosave(self, changes: Any = None) -> dict[str, Any]:
        return {"policy": {"enabled": False}, "override": {}}

    def snapshots(self, notebook_path: str | None = None) -> list[dict[str, Any]]:
        return [{"id": "s1", "name": "before-upgrade", "created": time.time(),
                 "size_bytes": 1 << 20, "fallback": ["portable", "replay", "both"]}]

    def jobs(self, kernel_id: str | None = None) -> list[dict[str, Any]]:
        return []

    def job(self, job_id: str, *, timeout: float | None = None) -> dict[str, Any]:
        return dict(self.jobs_by_id[job_id])

    def start_save(self, name: str | None = None, stop: bool = False, *,
                   portable: bool = False) -> dict[str, Any]:
        self.calls.append(("save", {"name": name, "portable": portable}))
        return self._job("save", None)

    def start_restore(self, ref: str, path: str | None = None, session_id: str | None = None,
                      *, fallback: str | None = None) -> dict[str, Any]:
        self.calls.append(("restore", {"ref": ref, "path": path, "session_id": session_id,
                                       "fallback": fallback}))
        return self._job("restore", ref)

    def _job(self, kind: str, snapshot_id: str | None) -> dict[str, Any]:
        job = {"id": f"j{len(self.jobs_by_id) + 1}", "kind": kind, "status": "running",
               "phase": "preflight", "snapshot_id": snapshot_id, "done": 0, "total": 0}
        self.jobs_by_id[str(job["id"])] = job
        return dict(job)

    def end(self, job_id: str, **fields: Any) -> None:
        self.jobs_by_id[job_id].update(fields)


REFUSED = {
    "code": "failed", "step": "compatibility",
    "cause": "this node runs Linux 6.1, the snapshot was saved on 2.6.32",
    "message": "compatibility failed: this node runs Linux 6.1, the snapshot was saved on "
    "2.6.32",
}


def test_a_refused_restore_offers_the_ways_back_and_shows_their_report() -> None:
    from jupyter_gpu_snapshot.kernel.widget import SnapshotPanel

    client = _FallbackClient()
    panel = SnapshotPanel(client, start=False)  # type: ignore[arg-type]
    panel.refresh(full=True)
    assert "portable copy" in panel.snapshot_list.value
    assert panel.fallback_box.layout.display == "none"

    # The save asks for a portable copy when its box is ticked.
    panel.portable_check.value = True
    panel.save()
    assert client.calls[-1] == ("save", {"name": None, "portable": True})
    client.end("j1", status="succeeded", result={"name": "x", "size_bytes": 1})

    panel.restore_chosen()
    assert client.calls[-1] == ("restore", {"ref": "s1", "path": "work/a.ipynb",
                                            "session_id": "s-1", "fallback": None})
    client.end("j2", status="failed", error={**REFUSED, "details": {
        "fallback": ["replay", "both", "someday"]}})
    panel.refresh()
    assert "restore: compatibility failed: this node runs Linux 6.1" in panel.error.value
    # Only the ways the snapshot offers, each saying what it keeps.
    assert panel.fallback_box.layout.display == "flex"
    shown = [mode for mode, b in panel.fallback_buttons.items() if b.layout.display != "none"]
    assert shown == ["replay", "both"]
    assert "Re-run the cells: runs again the cells the kernel ran" in panel.fallback_note.value
    assert "Load the portable copy" not in panel.fallback_note.value

    panel.fallback_buttons["replay"].click()
    assert client.calls[-1] == ("restore", {"ref": "s1", "path": "work/a.ipynb",
                                            "session_id": "s-1", "fallback": "replay"})
    assert panel.fallback_box.layout.display == "none"
    assert "Restoring into a fresh kernel (re-run the cells)" in panel.message.value
    client.end("j3", status="succeeded", result={
        "kernel_id": "k-fresh", "session_id": "s-1", "fallback": {
            "mode": "replay", "loaded": [], "not_loaded": [{"name": "log", "reason":
                                                             "an open file"}],
            "replayed": [{"count": 1, "status": "ok"},
                         {"count": 4, "status": "error", "error": "NameError: x"}],
            "notes": ["the 2 oldest cells were not recorded"],
        }})
    panel.refresh()
    assert "Restored into a fresh kernel k-fresh: this notebook now uses it" in (
        panel.message.value)
    report = panel.report.value
    assert "0 names loaded, 1 not; 2 cells re-run, 1 failed" in report, report
    assert "<code>log</code>: an open file" in report
    assert "In [1]: ran" in report and "In [4]: failed: NameError: x" in report
    assert "the 2 oldest cells were not recorded" in report
    assert panel.error.value == ""

    # A way back that fails says so, and offers no way back again.
    panel.restore_chosen()
    client.end("j4", status="failed", error={**REFUSED, "details": {"fallback": ["both"]}})
    panel.refresh()
    panel.fallback_buttons["both"].click()
    client.end("j5", status="failed", error={
        "step": "load", "cause": "x", "message": "load failed: the fresh kernel died",
        "details": {"fallback": ["both"]}})
    panel.refresh()
    assert "restore into a fresh kernel: load failed" in panel.error.value
    assert panel.fallback_box.layout.display == "none"
    panel.close()


def _server_store(server: JupyterServer) -> SnapshotStore:
    """The server's store, read with its key (the Jupyter data dir's: the server is given
    no key file of its own) and its kernel-log directory."""
    from jupyter_core.paths import jupyter_data_dir

    logs = Path(os.path.realpath(server.runtime / KERNEL_LOG_SUBDIR))
    return SnapshotStore(
        server.store, Path(jupyter_data_dir()) / "gpu_snapshot_signing.key",
        ManifestPolicy(kernel_log_dir=lambda: logs),
    )


def test_the_panel_saves_a_portable_copy_and_brings_a_refused_image_back_by_it(
    jupyter_server: JupyterServer,
) -> None:
    path = "portable-panel.ipynb"
    first = jupyter_server.open_notebook(path)
    first.ok("import numpy as np\nweights = np.arange(12.0).reshape(3, 4)\nlabel = 'run-7'")
    show_panel(first)
    first.ok(f"{PANEL}; p.name_input.value = 'portable-one'; p.portable_check.value = True;"
             " p.save_button.click()")
    saved = jupyter_server.wait_kernel_job(first.kernel_id, timeout=120)
    assert saved["status"] == "succeeded", saved
    snapshot_id = saved["result"]["id"]
    assert "portable" in saved["result"]["fallback"], saved["result"]
    # Its image now claims another node's Linux: this node refuses it. The kernel it was
    # taken of is gone (as after a move to a new machine): no port of it is taken.
    move_to_another_node(_server_store(jupyter_server), snapshot_id)
    jupyter_server.shutdown_kernel(first.kernel_id)

    second = jupyter_server.open_notebook(path)
    show_panel(second)
    wait_panel(second, f"{snapshot_id!r} in p.snapshots")
    assert "portable copy" in panel_state(second)["listing"]
    second.ok(f"{PANEL}; p.snapshot_choice.value = {snapshot_id!r}; p.restore_button.click()")
    wait_panel(second, "p.fallback_box.layout.display == 'flex'", timeout=60)
    offered = json.loads(second.ok(
        f"{PANEL}; print(json.dumps([m for m, b in p.fallback_buttons.items()"
        " if b.layout.display != 'none']))"))
    assert offered == ["portable", "replay", "both"]
    assert "restore: compatibility failed" in panel_state(second)["error"]

    second.ok(f"{PANEL}; p.fallback_buttons['portable'].click()")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        session = jupyter_server.session(second.session_id)
        if session["kernel"]["id"] != second.kernel_id:
            break
        time.sleep(0.2)
    fresh = session["kernel"]["id"]
    assert fresh != second.kernel_id, "the notebook was not switched to a fresh kernel"
    assert ok(jupyter_server.connect(fresh), "print(float(weights.sum()), label)") == (
        "66.0 run-7\n")
    job = next(j for j in jupyter_server.get("gpu-snapshot/jobs")["jobs"]
               if j["kind"] == "restore" and j["kernel_id"] == fresh)
    loaded = {item["name"] for item in job["result"]["fallback"]["loaded"]}
    assert {"weights", "label"} <= loaded, job["result"]["fallback"]
