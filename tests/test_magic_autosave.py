"""``%gpu_snapshot autosave`` and ``%gpu_snapshot list --latest`` in a real notebook kernel of a
real ``jupyter server`` subprocess, with real CRIU."""

from __future__ import annotations

import re

from .magic_fixtures import JupyterServer, NotebookKernel, jupyter_server, notebook

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
