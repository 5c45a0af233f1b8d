"""``%gpu_snapshot autosave``, the notebook's idle times of ``%gpu_snapshot hibernate`` and
``%gpu_snapshot list --latest`` in a real notebook kernel of a real ``jupyter server``
subprocess, with real CRIU."""

from __future__ import annotations

import re
from typing import Any

from testkit.magic_fixtures import JupyterServer, NotebookKernel, jupyter_server, notebook

__all__ = ["jupyter_server", "notebook"]  # the fixtures, imported for pytest


def test_autosave_policy_from_a_cell(
    jupyter_server: JupyterServer, notebook: NotebookKernel
) -> None:
    out = notebook.ok("%gpu_snapshot autosave")
    assert out.splitlines()[0] == (
        f"Autosave of {notebook.path}: every 15 min when cells ran, and after any cell of "
        "10 min or more, between cells."
    ), out
    # This cell ran, so an autosave is planned.
    assert "Next autosave: in 1" in notebook.ok("%gpu_snapshot autosave status")

    out = notebook.ok("%gpu_snapshot autosave every 90s")
    assert out.splitlines()[0].startswith(
        f"Autosave of {notebook.path}: every 1.5 min when cells ran"
    ), out
    assert "(set for this notebook)" in out
    state = jupyter_server.get(f"gpu-snapshot/kernels/{notebook.kernel_id}/autosave")
    assert state["override"] == {"enabled": True, "interval_minutes": 1.5}

    out = notebook.ok("%gpu_snapshot autosave off")
    assert out.splitlines()[0] == f"Autosave of {notebook.path}: off. (set for this notebook)"
    out = notebook.ok("%gpu_snapshot autosave on")
    assert "every 1.5 min" in out

    for line, expected in [
        ("autosave every 0m", "the autosave interval must be more than 0"),
        ("autosave every soon", "cannot read 'soon' as an interval"),
        ("autosave sometimes", "usage: %gpu_snapshot autosave [on|off|every 10m|status]"),
        ("status --latest", "--latest only applies to %gpu_snapshot list"),
    ]:
        cell = notebook.run(f"%gpu_snapshot {line}")
        assert cell.ename == "UsageError" and expected in cell.stderr, (line, cell)
    notebook.ok("%gpu_snapshot autosave default")
    state = jupyter_server.get(f"gpu-snapshot/kernels/{notebook.kernel_id}/autosave")
    assert state["override"] == {} and state["policy"]["interval_minutes"] == 15


def test_the_notebook_chooses_when_its_idle_kernel_sleeps_in_each_tier(
    jupyter_server: JupyterServer, notebook: NotebookKernel
) -> None:
    def autosave_state() -> dict[str, Any]:
        return jupyter_server.get(f"gpu-snapshot/kernels/{notebook.kernel_id}/autosave")

    # The server's settings first: the GPU after 10 minutes, never the process.
    policy = autosave_state()["policy"]
    assert (policy["release_gpu_after_minutes"], policy["hibernate_after_minutes"]) == (10, 0)
    out = notebook.ok("%gpu_snapshot hibernate gpu after 90s")
    assert out == "This notebook's kernel gives its GPU back after 1.5 min idle.\n"
    out = notebook.ok("%gpu_snapshot hibernate process after 2h")
    assert out == "This notebook's kernel hibernates after 120 min idle.\n"
    state = autosave_state()
    assert state["override"] == {"release_gpu_after_minutes": 1.5, "hibernate_after_minutes": 120}
    assert state["policy"]["release_gpu_after_minutes"] == 1.5

    out = notebook.ok("%gpu_snapshot hibernate gpu never")
    assert out == "This notebook's kernel never gives its GPU back by itself.\n"
    assert autosave_state()["override"]["release_gpu_after_minutes"] == 0
    out = notebook.ok("%gpu_snapshot hibernate gpu default")
    assert out == "This notebook's kernel gives its GPU back after 10 min idle.\n"
    assert autosave_state()["override"] == {"hibernate_after_minutes": 120}
    notebook.ok("%gpu_snapshot hibernate default")
    assert autosave_state()["override"] == {}

    usage = "usage: %gpu_snapshot hibernate [gpu|process] [after 30m|never|default]"
    for line, expected in [
        ("hibernate gpu after 0m", "the idle time must be more than 0; use 'hibernate gpu never'"),
        ("hibernate after 0", "the idle time must be more than 0; use 'hibernate never'"),
        ("hibernate gpu after soon", "cannot read 'soon' as an interval"),
        ("hibernate gpu later", usage),
        ("hibernate gpu after", usage),
        ("hibernate never gpu", usage),
    ]:
        cell = notebook.run(f"%gpu_snapshot {line}")
        assert cell.ename == "UsageError" and expected in cell.stderr, (line, cell)
    assert autosave_state()["override"] == {}


def test_list_latest_names_the_newest_snapshot_and_its_reason(
    jupyter_server: JupyterServer, notebook: NotebookKernel
) -> None:
    assert notebook.ok("%gpu_snapshot list --latest") == f"No snapshots of {notebook.path}.\n"
    notebook.ok("x = 1")
    notebook.ok("%gpu_snapshot save older")
    notebook.ok("%gpu_snapshot save newer")
    out = notebook.ok("%gpu_snapshot list --latest").splitlines()
    assert out[0] == f"Newest snapshot of {notebook.path}:"
    assert out[1].split()[:4] == ["NAME", "ID", "CREATED", "REASON"]
    assert len(out) == 3 and out[2].startswith("newer") and " user " in out[2], out
    # --all would list every notebook's, which this kernel's own credential does not reach.
    cell = notebook.run("%gpu_snapshot list --latest --all")
    assert cell.status == "error" and re.sub(r"\x1b\[[0-9;]*m", "", cell.error_text).startswith(
        "%gpu_snapshot list: --all lists every notebook's snapshots, and this kernel's own "
        "credential reaches its own notebook's only."), cell
