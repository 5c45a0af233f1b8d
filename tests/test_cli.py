"""``jupyter gpu-snapshot`` on real kernels: save by pid and by kernel id, list, restore
standalone into a kernel that `jupyter console --existing` can reach, rm, check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from jupyter_client.manager import KernelManager
from jupyter_core.paths import jupyter_runtime_dir

from jupyter_gpu_snapshot.core import procfs

from .conftest import KernelHandle, RestoredTrees, start_kernel, stop_kernel


def cli(
    store: Path, *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", "jupyter_gpu_snapshot.cli", "--store", str(store), *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )
    if check:
        assert out.returncode == 0, out.stderr
    return out


def test_save_list_restore_rm_by_pid(tmp_path: Path, kernel: KernelHandle, restored: RestoredTrees):
    store = tmp_path / "store"
    kernel.execute("state = {'epoch': 7}")
    saved = json.loads(cli(store, "save", "--pid", str(kernel.kernel_pid), "--name", "cli-1",
                           "--stop", "--json").stdout)
    assert saved["name"] == "cli-1" and saved["size_bytes"] > 0
    assert "key" not in saved["kernel"]["connection_info"]
    listing = json.loads(cli(store, "list", "--json", env={"FORCE_COLOR": "1"}).stdout)
    assert [s["id"] for s in listing] == [saved["id"]]
    human = cli(store, "list").stdout
    assert "cli-1" in human

    result = json.loads(cli(store, "restore", "cli-1", "--json").stdout)
    connection_file = Path(result["connection_file"])
    assert connection_file.stat().st_mode & 0o777 == 0o600
    client = restored.connect(connection_file, result["pid"])
    from .conftest import execute

    assert "{'epoch': 7}" in execute(client, "print(state)")
    assert procfs.namespace_init(result["kernel_pid"]) == result["pid"]
    # `jupyter console --existing FILE` only needs this file; it is a full connection file.
    info = json.loads(connection_file.read_text())
    assert {"shell_port", "iopub_port", "key", "transport", "ip"} <= set(info)

    assert "deleted cli-1" in cli(store, "rm", "cli-1").stdout
    assert json.loads(cli(store, "list", "--json").stdout) == []


def test_save_by_kernel_id(tmp_path: Path):
    kernel_id = str(uuid.uuid4())
    connection_file = Path(jupyter_runtime_dir()) / f"kernel-{kernel_id}.json"
    handle = start_kernel(connection_file=str(connection_file))
    try:
        handle.execute("x = 5")
        out = cli(tmp_path / "store", "save", "--kernel-id", kernel_id)
        assert out.stdout.startswith("saved python3-snapshot-")
        assert "5" in handle.execute("print(x)")
    finally:
        stop_kernel(handle)


def test_errors_are_one_line_and_exit_nonzero(tmp_path: Path):
    store = tmp_path / "store"
    out = cli(store, "restore", "../etc", check=False)
    assert out.returncode == 2
    assert "invalid snapshot name" in out.stderr and "Traceback" not in out.stderr
    out = cli(store, "rm", "missing", check=False)
    assert out.returncode == 2 and "no snapshot 'missing'" in out.stderr
    out = cli(store, "save", "--kernel-id", "nope", check=False)
    assert out.returncode == 2 and "no running kernel with id nope" in out.stderr


def test_check_reports_what_is_missing(tmp_path: Path):
    ok = cli(tmp_path / "store", "check")
    assert "criu check" in ok.stdout
    bad = cli(tmp_path / "store", "--criu", "/nonexistent/criu", "check", "--json", check=False)
    assert bad.returncode == 1
    checks = {c["name"]: c for c in json.loads(bad.stdout)}
    assert checks["criu"]["ok"] is False and "criu not found" in checks["criu"]["detail"]


def test_kernelspec_install(tmp_path: Path):
    cli(tmp_path / "store", "kernelspec", "install", "--prefix", str(tmp_path / "prefix"))
    spec = json.loads(
        (tmp_path / "prefix/share/jupyter/kernels/python3-snapshot/kernel.json").read_text()
    )
    assert spec["display_name"] == "Python 3 (snapshots)"
    assert spec["metadata"]["kernel_provisioner"]["provisioner_name"] == "gpu-snapshot-provisioner"
    assert KernelManager  # the spec is loadable by jupyter_client's own machinery below
    from jupyter_client.kernelspec import KernelSpecManager

    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "prefix/share/jupyter/kernels")])
    assert ksm.get_kernel_spec("python3-snapshot").display_name == "Python 3 (snapshots)"


def test_resume_wakes_a_kernel_left_stopped(tmp_path: Path, kernel: KernelHandle):
    import signal
    import time

    kernel.execute("n = 41")
    for proc in procfs.tree(kernel.root_pid):
        proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 5  # a signal is delivered asynchronously
    while not all(p.status() == "stopped" for p in procfs.tree(kernel.root_pid)):
        assert time.monotonic() < deadline, "the kernel did not stop"
        time.sleep(0.02)
    out = cli(tmp_path / "store", "resume", "--pid", str(kernel.kernel_pid))
    assert "woke pids" in out.stdout
    assert "42" in kernel.execute("n += 1; print(n)")


def test_list_latest_names_each_notebooks_newest_snapshot(tmp_path: Path, kernel: KernelHandle):
    from jupyter_gpu_snapshot.core.engine import SaveTarget, SnapshotEngine
    from jupyter_gpu_snapshot.core.store import SnapshotStore

    from .conftest import run

    store = tmp_path / "store"
    engine = SnapshotEngine(SnapshotStore(store))
    made = {}
    for notebook, reason in [("a.ipynb", "autosave"), ("b.ipynb", "user"),
                             ("a.ipynb", "shutdown"), (None, "user")]:
        target = SaveTarget(kernel.root_pid, notebook_path=notebook, reason=reason)
        made[(notebook, reason)] = run(engine.save(target)).id
    latest = json.loads(cli(store, "list", "--latest", "--json").stdout)
    # Newest first, one per notebook, whatever the reason; no notebook, no offer.
    assert [(s["notebook_path"], s["reason"], s["id"]) for s in latest] == [
        ("a.ipynb", "shutdown", made[("a.ipynb", "shutdown")]),
        ("b.ipynb", "user", made[("b.ipynb", "user")]),
    ]
    only_a = json.loads(cli(store, "list", "--latest", "--notebook", "a.ipynb", "--json").stdout)
    assert [s["id"] for s in only_a] == [made[("a.ipynb", "shutdown")]]
    human = cli(store, "list", "--latest").stdout
    assert "shutdown" in human and "autosave" not in human
