"""Scenarios for ``%gpu_snapshot``: real server extension, real python3-snapshot kernels, CRIU.

Every kernel here is started the way JupyterLab starts one (a session on a ``jupyter
server`` subprocess), so it finds its server through the environment the provisioner gave
it, and every snapshot is a real CRIU dump.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.manifest import ManifestPolicy
from testkit.criu_wrappers import install, waits_after_the_dump_for
from testkit.magic_fixtures import (
    Cell,
    JupyterServer,
    NotebookKernel,
    jupyter_server,
    notebook,
    ok,
    run_cell,
)
from testkit.manifests import move_to_another_node
from tests.conftest import start_kernel, stop_kernel

__all__ = ["jupyter_server", "notebook"]  # the fixtures, imported for pytest

SAVED = re.compile(
    r"Saved snapshot (?P<id>\d{8}T\d{6}Z-[0-9a-f]{8}) \((?P<name>[^)]+)\) at [\d-]+ [\d:]+: "
    r"(?P<size>[\d.]+ (?:B|KiB|MiB|GiB))(?: \((?P<new>[\d.]+ (?:B|KiB|MiB|GiB)) new\))? "
    r"in (?P<secs>[\d.]+) s \(kernel paused [\d.]+ s\)\."
)


def one_line_error(cell: Cell) -> str:
    """The failure the user sees: one line, no traceback."""
    assert cell.status == "error", cell
    assert len(cell.traceback) == 1, cell.traceback
    return re.sub(r"\x1b\[[0-9;]*m", "", cell.traceback[0])


def test_outside_a_server_the_magic_says_so() -> None:
    # A python3-snapshot kernel started by jupyter_client directly: the extension loads
    # (its kernelspec asks for it) but no server gave it a URL.
    handle = start_kernel()
    try:
        for command in ("status", "save", "list", "widget"):
            line = one_line_error(run_cell(handle.client, f"%gpu_snapshot {command}"))
            assert line == (
                f"%gpu_snapshot {command}: no Jupyter server to talk to: this kernel was not "
                "started by a Jupyter server with jupyter_gpu_snapshot "
                "(JUPYTER_GPU_SNAPSHOT_URL is not set). Open the notebook in JupyterLab with "
                "the 'Python 3 (snapshots)' kernel, or use the 'jupyter gpu-snapshot' "
                "command line"
            ), line
        # The kernel is fine and answers the next cell; loading pulled in no ipywidgets.
        out = ok(handle.client, "import sys; print(6 * 7, 'ipywidgets' in sys.modules)")
        assert out == "42 False\n"
    finally:
        stop_kernel(handle)


def test_in_a_plain_python3_notebook_status_says_it_is_not_snapshot_ready(
    jupyter_server: JupyterServer,
) -> None:
    # Started by the server for a notebook, only on the plain kernel, with %load_ext.
    notebook = jupyter_server.open_notebook("plain-python3.ipynb", kernel_name="python3")
    client = notebook.client
    ok(client, "%load_ext jupyter_gpu_snapshot")
    line = one_line_error(run_cell(client, "%gpu_snapshot status"))
    assert line.startswith(
        "%gpu_snapshot status: this kernel is not snapshot-ready: it runs a kernel other "
        "than 'Python 3 (snapshots)'"
    ), line
    assert "Change Kernel" in line and "no Jupyter server" not in line, line
    jupyter_server.shutdown_kernel(notebook.kernel_id)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("", "the following arguments are required: command"),
        ("frob", "invalid choice: 'frob'"),
        ("rm", "%gpu_snapshot rm needs a snapshot name or id"),
        ("restore", "%gpu_snapshot restore needs a snapshot name or id"),
        ("list extra", "%gpu_snapshot list takes no name"),
        ("status --stop", "--stop only applies to %gpu_snapshot save"),
        ("save --all", "--all only applies to %gpu_snapshot list"),
        ("save a b", "unrecognized arguments: b"),
    ],
)
def test_bad_arguments_are_usage_errors(
    jupyter_server: JupyterServer, usage_kernel: NotebookKernel, line: str, expected: str
) -> None:
    cell = usage_kernel.run(f"%gpu_snapshot {line}")
    assert cell.status == "error"
    assert cell.ename == "UsageError", cell
    assert f"UsageError: {expected}" in cell.stderr or expected in cell.stderr, cell.stderr
    # Nothing was saved by a refused command.
    assert jupyter_server.snapshots(usage_kernel.path) == []


@pytest.fixture(scope="module")
def usage_kernel(jupyter_server: JupyterServer) -> Iterator[NotebookKernel]:
    yield jupyter_server.open_notebook("usage.ipynb")


def test_save_list_status_rm(jupyter_server: JupyterServer, notebook: NotebookKernel) -> None:
    notebook.ok("state = {'answer': 42}")
    status = notebook.ok("%gpu_snapshot status")
    assert f"Kernel {notebook.kernel_id}: ready to snapshot." in status
    assert "CUDA: not in use by this kernel." in status
    assert "No snapshot of this notebook yet." in status

    estimate = re.search(r"A snapshot now would hold about ([\d.]+) MiB\.", status)
    assert estimate, status

    out = notebook.ok("%gpu_snapshot save first")
    saved = SAVED.search(out)
    assert saved, out
    # The estimate (the namespace's resident memory) is what the image turned out to be.
    size_mib = float(saved["size"].split()[0]) * (1024 if saved["size"].endswith("GiB") else 1)
    assert 0.5 < float(estimate[1]) / size_mib < 2, (estimate[0], saved["size"])
    assert saved["name"] == "first"
    listed = jupyter_server.snapshots(notebook.path)
    assert [s["id"] for s in listed] == [saved["id"]]
    assert listed[0]["kernel"]["kernel_id"] == notebook.kernel_id
    # The kernel kept running with its state.
    assert notebook.ok("print(state['answer'])") == "42\n"

    out = notebook.ok("%gpu_snapshot save")  # an unnamed one, too
    second = SAVED.search(out)
    assert second, out

    listing = notebook.ok("%gpu_snapshot list")
    assert listing.startswith(f"2 snapshot(s) of {notebook.path}:")
    lines = listing.splitlines()
    assert lines[1].split()[:2] == ["NAME", "ID"]
    assert second["id"] in lines[2] and saved["id"] in lines[3]  # newest first
    assert "first" in lines[3]

    status = notebook.ok("%gpu_snapshot status")
    assert f"Last snapshot: {second['name']} ({second['id']})" in status

    assert notebook.ok("%gpu_snapshot rm first") == f"Deleted snapshot {saved['id']} (first).\n"
    assert [s["id"] for s in jupyter_server.snapshots(notebook.path)] == [second["id"]]
    assert notebook.ok(f"%gpu_snapshot rm {second['id']}").startswith("Deleted snapshot")
    assert jupyter_server.snapshots(notebook.path) == []
    assert notebook.ok("%gpu_snapshot list") == f"No snapshots of {notebook.path}.\n"

    line = one_line_error(notebook.run("%gpu_snapshot rm first"))
    assert line.startswith("%gpu_snapshot rm: lookup failed: no snapshot 'first'"), line


def test_a_checkpoint_cell_saves_the_kernel_first_then_runs(
    jupyter_server: JupyterServer, usage_kernel: NotebookKernel
) -> None:
    usage_kernel.ok("risky = 'before'")
    out = usage_kernel.ok("%%gpu_snapshot checkpoint\nrisky = 'after'\nprint('ran', risky)")
    saved = SAVED.search(out)
    assert saved, out
    # Named after the cell it protects; the cell ran once the snapshot existed.
    assert re.fullmatch(r"before-cell-\d+", saved["name"]), saved["name"]
    assert out.rstrip().endswith("ran after"), out
    assert [s["id"] for s in jupyter_server.snapshots(usage_kernel.path)] == [saved["id"]]
    named = usage_kernel.ok("%%gpu_snapshot checkpoint risky-one\nrisky = 'again'")
    assert SAVED.search(named) and "(risky-one)" in named, named

    refused = usage_kernel.run("%%gpu_snapshot save\nrisky = 'never'")
    assert refused.ename == "UsageError", refused
    assert "%%gpu_snapshot checkpoint [NAME]" in refused.stderr
    assert usage_kernel.ok("print(risky)") == "again\n"
    for snapshot in jupyter_server.snapshots(usage_kernel.path):
        usage_kernel.ok(f"%gpu_snapshot rm {snapshot['id']}")


def test_failures_are_one_line_and_leave_the_kernel_running(
    jupyter_server: JupyterServer, notebook: NotebookKernel
) -> None:
    line = one_line_error(notebook.run("%gpu_snapshot save ../escape"))
    # A refused request, not a failed step.
    assert line.startswith("%gpu_snapshot save: invalid snapshot name"), line

    notebook.ok('%gpu_snapshot save "taken"')  # quoted, as people write names
    line = one_line_error(notebook.run("%gpu_snapshot save taken"))
    assert "a snapshot named 'taken' exists already" in line
    assert [s["name"] for s in jupyter_server.snapshots(notebook.path)] == ["taken"]
    line = one_line_error(notebook.run('%gpu_snapshot save "my snapshot"'))
    assert "invalid snapshot name 'my snapshot'" in line, line

    line = one_line_error(notebook.run("%gpu_snapshot restore no-such-snapshot"))
    assert line.startswith("%gpu_snapshot restore: lookup failed: no snapshot"), line
    # Its own snapshot cannot come back while this kernel holds the ports: said at once,
    # before the notebook is told it will switch, and no job is started.
    cell = notebook.run("%gpu_snapshot restore taken")
    line = one_line_error(cell)
    assert line.startswith("%gpu_snapshot restore: preflight failed: snapshot "), line
    assert "(taken) was taken from this kernel" in line and "restore dialog" in line
    assert cell.stdout == ""
    taken = jupyter_server.get("gpu-snapshot/snapshots/taken")["id"]
    jobs = jupyter_server.get("gpu-snapshot/jobs")["jobs"]
    assert [j for j in jobs if j["kind"] == "restore" and j["snapshot_id"] == taken] == []

    # A server that went away: the magic names the step and the cause, and returns.
    notebook.ok("import os; _url = os.environ['JUPYTER_GPU_SNAPSHOT_URL']")
    notebook.ok("os.environ['JUPYTER_GPU_SNAPSHOT_URL'] = 'http://127.0.0.1:9/'")
    started = time.monotonic()
    line = one_line_error(notebook.run("%gpu_snapshot status"))
    assert time.monotonic() - started < 10
    assert line.startswith(
        "%gpu_snapshot status: connect failed: cannot reach the Jupyter server at "
        "http://127.0.0.1:9/"
    ), line
    notebook.ok("os.environ['JUPYTER_GPU_SNAPSHOT_URL'] = _url")
    assert notebook.ok("print('alive')") == "alive\n"


SAVE_IN_A_CELL = """
import time
from IPython.utils.capture import capture_output
with capture_output() as cap:
    get_ipython().run_line_magic("gpu_snapshot", "save {args}")
woke = time.time()
# In a restored copy the server finishes adopting the kernel once this cell has ended.
try:
    get_ipython().run_line_magic("gpu_snapshot", "status")
    then = "answered"
except Exception as exc:
    then = str(exc)
cell_finished = True
print(cap.stdout, end="")
"""


def _restore_alone(server: JupyterServer, snapshot_id: str) -> dict[str, Any]:
    """Restore into a new slot attached to no notebook; the finished job."""
    status, job = server.request("POST", f"gpu-snapshot/snapshots/{snapshot_id}/restore", {})
    assert status == 202, (status, job)
    done = server.wait_job(str(job["id"]))
    assert done["status"] == "succeeded", done
    return done


@pytest.mark.parametrize("stop", [False, True], ids=["keep-running", "stop"])
def test_save_from_a_running_cell_and_its_restored_copy(
    jupyter_server: JupyterServer, notebook: NotebookKernel, stop: bool
) -> None:
    notebook.ok("import os; state = [1, 2, 3]; cell_finished = False")
    name = "mid-cell-stop" if stop else "mid-cell"
    code = SAVE_IN_A_CELL.format(args=f"{name} --stop" if stop else name)
    if stop:
        # The dump ends this kernel, so its cell never answers; follow the job instead.
        notebook.client.execute(code)
        job = jupyter_server.wait_kernel_job(notebook.kernel_id)
        assert job["status"] == "succeeded", job
        snapshot_id = str(job["result"]["id"])
        assert _gone(jupyter_server, notebook.kernel_id)
    else:
        cell = notebook.run(code)
        assert cell.status == "ok", cell
        saved = SAVED.search(cell.stdout)
        assert saved, cell.stdout
        assert "restored" not in cell.stdout
        snapshot_id = saved["id"]
        assert notebook.ok("print(cell_finished, state, then)") == "True [1, 2, 3] answered\n"
        # The copy needs the ports the original holds.
        jupyter_server.shutdown_kernel(notebook.kernel_id)

    job = _restore_alone(jupyter_server, snapshot_id)
    new_kernel = str(job["result"]["kernel_id"])
    assert new_kernel != notebook.kernel_id
    copy = jupyter_server.connect(new_kernel)
    # Runs after the restored cell has finished: it was frozen inside the magic's wait.
    seen = json.loads(ok(copy, "import json; print(json.dumps([cell_finished, state, "
                               "cap.stdout.splitlines(), woke, then]))"))
    assert seen[:2] == [True, [1, 2, 3]]
    printed, woke, status_then = seen[2], float(seen[3]), seen[4]
    # Until then the magic says so instead of addressing the kernel it was saved from.
    assert status_then == (
        "%gpu_snapshot status: find this kernel failed: this kernel was restored from a "
        "snapshot, and the server has not yet told it which kernel it is now. The server "
        "does so as soon as the running cell ends; try again then"
    ), status_then
    assert printed[-1] == (
        f"This kernel was restored from snapshot {snapshot_id} ({name}), "
        "taken while this cell waited for it."
    )
    assert not any(line.startswith("Saved snapshot") for line in printed), printed
    # The copy noticed at once: its cell ended before the restore job did (the job also
    # waits for the kernel to answer), or within a second of it.
    assert float(job["started"]) <= woke <= float(job["finished"]) + 1.0
    outcome = ok(
        copy,
        "o = get_ipython().magics_manager.registry['GPUSnapshotMagics'].last_outcome; "
        "print(o.restored, o.snapshot_id)",
    )
    assert outcome == f"True {snapshot_id}\n"

    # The copy knows which kernel it is now, and snapshots itself under that id.
    status = ok(copy, "%gpu_snapshot status")
    assert f"Kernel {new_kernel}: ready to snapshot." in status
    assert f"restored from a snapshot of kernel {notebook.kernel_id}" in status
    again = SAVED.search(ok(copy, f"%gpu_snapshot save {name}-again"))
    assert again, status
    summary = jupyter_server.get(f"gpu-snapshot/snapshots/{again['id']}")
    assert summary["kernel"]["kernel_id"] == new_kernel



def _gone(server: JupyterServer, kernel_id: str, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if kernel_id not in server.kernel_ids():
            return True
        time.sleep(0.1)
    return False


def test_restore_switches_the_notebook_to_the_restored_kernel(
    jupyter_server: JupyterServer,
) -> None:
    first = jupyter_server.open_notebook("restore-switch.ipynb")
    first.ok("origin = 'first kernel'")
    assert SAVED.search(first.ok("%gpu_snapshot save first-kernel"))
    # The notebook changes kernel (Kernel > Change Kernel): the second kernel starts while
    # the first still holds its ports, so its own can never be the ones the first frees,
    # and the server then shuts the first down, which frees the ports the restore needs.
    status, session = jupyter_server.request(
        "PATCH", f"api/sessions/{first.session_id}", {"kernel": {"name": "python3-snapshot"}})
    assert status == 200, (status, session)
    second_id = session["kernel"]["id"]
    assert _gone(jupyter_server, first.kernel_id)
    second = jupyter_server.connect(second_id)
    ok(second, "origin = 'second kernel'")
    # Another notebook's kernel does not reach this notebook's snapshots.
    other = jupyter_server.open_notebook("restore-other.ipynb")
    line = one_line_error(other.run("%gpu_snapshot restore first-kernel"))
    assert line.startswith(
        f"%gpu_snapshot restore: kernel {other.kernel_id}'s own credential reaches the "
        "snapshots of its notebook (restore-other.ipynb) and of this kernel only"), line
    jupyter_server.shutdown_kernel(other.kernel_id)
    # The server retires the second kernel once the notebook is switched, so this cell
    # never answers; its announcement comes first.
    said: list[str] = []
    second.execute("%gpu_snapshot restore first-kernel")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not said:
        msg = second.get_iopub_msg(timeout=60)
        if msg["msg_type"] == "stream":
            said.append(msg["content"]["text"])
    assert said and said[0].startswith("Restoring snapshot "), said
    assert "restore-switch.ipynb switches to it and this kernel shuts down." in said[0]

    assert _gone(jupyter_server, second_id)
    session = jupyter_server.session(first.session_id)
    new_kernel = session["kernel"]["id"]
    assert new_kernel not in (first.kernel_id, second_id)
    restored = jupyter_server.connect(new_kernel)
    assert ok(restored, "print(origin)") == "first kernel\n"


def _server_store(server: JupyterServer) -> SnapshotStore:
    """The store as the server process reads it: with its signing key (in the Jupyter
    data dir of its environment) and its kernel-log directory (in its runtime dir)."""
    assert server.process is not None
    env = psutil.Process(server.process.pid).environ()
    data_dir = Path(env.get("JUPYTER_DATA_DIR") or Path.home() / ".local/share/jupyter")
    return SnapshotStore(server.store, data_dir / "gpu_snapshot_signing.key",
                         ManifestPolicy(lambda: server.runtime / "gpu_snapshot"))


def test_a_refused_image_offers_its_fallback_and_the_notebook_gets_its_work_back(
    jupyter_server: JupyterServer,
) -> None:
    first = jupyter_server.open_notebook("fallback.ipynb")
    first.ok("import numpy as np\nsteps = np.arange(12, dtype=np.int32) * 3")
    said = first.ok("%gpu_snapshot save upgraded --portable")
    assert SAVED.search(said), said
    (summary,) = [s for s in jupyter_server.snapshots() if s["name"] == "upgraded"]
    assert summary["fallback"] == ["portable", "replay", "both"]
    # The node comes back with another Linux: the image is refused, the work is offered.
    move_to_another_node(_server_store(jupyter_server), summary["id"])
    jupyter_server.shutdown_kernel(first.kernel_id)  # the image needs its ports back
    second = jupyter_server.open_notebook("fallback.ipynb")
    line = one_line_error(second.run("%gpu_snapshot restore upgraded"))
    assert line.startswith("%gpu_snapshot restore: compatibility failed: "), line
    assert line.endswith("Its work can still come back in a fresh kernel: %gpu_snapshot "
                         "restore upgraded --fallback portable or --fallback replay or "
                         "--fallback both"), line
    # As the message says: the notebook switches to a fresh kernel, which says what came
    # back at its first cell.
    said_before: list[str] = []
    second.client.execute("%gpu_snapshot restore upgraded --fallback both")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not said_before:
        msg = second.client.get_iopub_msg(timeout=60)
        if msg["msg_type"] == "stream":
            said_before.append(msg["content"]["text"])
    assert "into a fresh kernel by its both fallback" in said_before[0], said_before
    assert _gone(jupyter_server, second.kernel_id)
    fresh = jupyter_server.connect(jupyter_server.session(second.session_id)["kernel"]["id"])
    first_cell = run_cell(fresh, "print(int(steps.sum()), steps.dtype)")
    assert first_cell.status == "ok", first_cell
    assert "its work did (both):" in first_cell.stderr, first_cell
    assert first_cell.stdout == "198 int32\n", first_cell


def test_loading_the_extension_never_waits_for_a_server(tmp_path: Path) -> None:
    # A server that would swallow packets (a non-routed address) and one that is gone: the
    # extension loads at once either way, because loading makes no request: no socket of
    # the process so much as tries to connect while it loads.
    script = (
        "import socket\n"
        "tried = []\n"
        "connect = socket.socket.connect\n"
        "def noted(self, address):\n"
        "    tried.append(address)\n"
        "    return connect(self, address)\n"
        "socket.socket.connect = noted\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "shell = InteractiveShell.instance()\n"
        "shell.run_line_magic('load_ext', 'jupyter_gpu_snapshot')\n"
        "print(len(tried), 'gpu_snapshot' in shell.magics_manager.magics['line'])\n"
    )
    for url in ("http://10.255.255.1:9/", "http://127.0.0.1:9/"):
        env = dict(os.environ, JUPYTER_GPU_SNAPSHOT_URL=url,
                   JUPYTER_GPU_SNAPSHOT_KERNEL_ID="0" * 8 + "-0000-0000-0000-" + "0" * 12,
                   IPYTHONDIR=str(tmp_path))
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True,
            check=True, timeout=60,
        ).stdout.split()
        assert out == ["0", "True"], out


def test_interrupting_a_save_only_stops_waiting(tmp_path: Path) -> None:
    # The save stays under way until the cell has answered the interrupt (criu reports only
    # once the gate exists), however slow a loaded machine delivers it.
    gate = tmp_path / "the-cell-stopped-waiting"
    criu = install(tmp_path, waits_after_the_dump_for(str(gate)), "criu-waits-after-the-dump")
    server = JupyterServer(
        tmp_path / "server", options=[f"--GPUSnapshot.criu_path={criu}"]
    )
    server.start()
    try:
        _interrupt_a_save(server, gate)
    finally:
        gate.touch()
        server.stop()


def _interrupt_a_save(server: JupyterServer, gate: Path) -> None:
    notebook = server.open_notebook("interrupted.ipynb")
    notebook.ok("import os; blob = os.urandom(64 << 20)")
    interrupted: list[float] = []

    def interrupt_once_waiting(msg: dict[str, Any]) -> None:
        # The progress line appears once the cell is in the magic's wait loop.
        text = str(msg["content"].get("data", {}).get("text/plain", ""))
        if text.startswith("Saving: ") and not interrupted:
            status, _ = server.request(
                "POST", f"api/kernels/{notebook.kernel_id}/interrupt"
            )
            assert status == 204
            interrupted.append(time.monotonic())

    cell = notebook.run("%gpu_snapshot save interrupted", on_message=interrupt_once_waiting)
    assert interrupted, "the save never showed progress"
    assert cell.status == "ok", cell
    job_id = re.search(r"\(job ([0-9a-f]{32})\)", cell.stdout)
    assert cell.stdout.startswith("Stopped waiting; the save goes on in the server"), cell.stdout
    assert job_id, cell.stdout
    # The save itself went on and succeeded; the kernel is fine.
    gate.touch()
    job = server.wait_job(job_id[1])
    assert job["status"] == "succeeded", job
    assert [s["name"] for s in server.snapshots(notebook.path)] == ["interrupted"]
    assert notebook.ok("print(len(blob) >> 20)") == "64\n"


def test_a_server_on_a_unix_socket(tmp_path_factory: pytest.TempPathFactory) -> None:
    server = JupyterServer(tmp_path_factory.mktemp("sock"), unix_socket=True)
    server.start()
    try:
        nb = server.open_notebook("socket.ipynb")
        url = nb.ok("import os; print(os.environ['JUPYTER_GPU_SNAPSHOT_URL'])").strip()
        assert url.startswith("http+unix://"), url
        saved = SAVED.search(nb.ok("%gpu_snapshot save over-a-socket"))
        assert saved
        assert [s["id"] for s in server.snapshots("socket.ipynb")] == [saved["id"]]
        assert nb.ok("%gpu_snapshot rm over-a-socket").startswith("Deleted snapshot")
        assert server.snapshots() == []
    finally:
        server.stop()
