"""``jupyter gpu-snapshot`` on real kernels: save by pid and by kernel id, list, restore
standalone into a kernel that `jupyter console --existing` can reach, rm, check."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from jupyter_client.manager import KernelManager
from jupyter_core.paths import jupyter_runtime_dir

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.store import SnapshotStore
from testkit.manifests import move_to_another_node
from tests.conftest import KernelHandle, RestoredTrees, start_kernel, stop_kernel


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
    from tests.conftest import execute

    assert "{'epoch': 7}" in execute(client, "print(state)")
    assert procfs.namespace_init(result["kernel_pid"]) == result["pid"]
    # `jupyter console --existing FILE` only needs this file; it is a full connection file.
    info = json.loads(connection_file.read_text())
    assert {"shell_port", "iopub_port", "key", "transport", "ip"} <= set(info)
    # The README's recipe, as written (plus a plain prompt, as stdin is no terminal here).
    console = subprocess.run(
        [str(Path(sys.executable).parent / "jupyter"), "console", "--existing",
         str(connection_file), "--simple-prompt",
         "--ZMQTerminalInteractiveShell.confirm_exit=False"],
        input="print('console sees', state)\n", capture_output=True, text=True, timeout=60,
    )
    assert "console sees {'epoch': 7}" in console.stdout, console.stdout + console.stderr

    assert "deleted cli-1" in cli(store, "rm", "cli-1").stdout
    assert json.loads(cli(store, "list", "--json").stdout) == []


def test_human_output_never_cuts_or_wraps_ids_and_paths(
    tmp_path: Path, kernel: KernelHandle, restored: RestoredTrees
):
    store = tmp_path / "a-store-directory-with-a-rather-long-name" / "snapshots"
    name = "a-snapshot-name-long-enough-to-be-cut-by-a-narrow-table-01"
    # A narrow terminal's width: nothing may be folded or shortened to fit it.
    narrow = {"COLUMNS": "60", "TERM": "xterm"}
    saved = cli(store, "save", "--pid", str(kernel.kernel_pid), "--name", name, "--stop",
                env=narrow).stdout
    [saved_line] = saved.splitlines()
    snapshot_id = json.loads(cli(store, "list", "--json").stdout)[0]["id"]
    assert f"saved {name} ({snapshot_id})" in saved_line
    listing = cli(store, "list", env=narrow).stdout.splitlines()
    assert "…" not in "".join(listing)
    assert listing[0].split() == [
        "NAME", "ID", "CREATED", "REASON", "SIZE", "NEW", "NOTEBOOK", "LOCATION", "STATUS",
    ]
    assert listing[1].split()[:2] == [name, snapshot_id]
    out = cli(store, "restore", name, env=narrow).stdout
    connect = [line for line in out.splitlines() if line.startswith("connect with:")]
    assert len(connect) == 1, out
    connection_file = Path(connect[0].split("--existing ", 1)[1])
    assert connection_file.is_file(), out  # the whole path, on one line
    pid = int(out.split(" as pid ", 1)[1].split()[0])
    restored.connect(connection_file, pid)


def test_every_json_flag_has_help():
    from jupyter_gpu_snapshot.cli.main import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    flagged = 0
    for name, sub in commands.items():
        for action in sub._actions:
            if "--json" in action.option_strings:
                flagged += 1
                assert action.help, f"{name} --json has no help text"
    assert flagged >= 5


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


def test_a_refused_image_comes_back_through_the_cli_fallback(tmp_path: Path):
    """save --portable, the image refused (another node's Linux), restore --fallback:
    a standalone fresh kernel holds the state, reached by its connection file."""
    kernel_id = str(uuid.uuid4())
    connection_file = Path(jupyter_runtime_dir()) / f"kernel-{kernel_id}.json"
    handle = start_kernel(connection_file=str(connection_file))
    outputs: list[dict[str, Any]] = []
    try:
        handle.execute("import numpy as np")
        handle.execute("grid = np.arange(4096, dtype=np.float64).reshape(64, 64) ** 0.5")
        handle.execute("stream = (n for n in range(3))")
        saved = json.loads(cli(tmp_path / "store", "save", "--kernel-id", kernel_id,
                               "--portable", "--json").stdout)
        assert saved["fallback"] == ["portable", "replay", "both"]
    finally:
        stop_kernel(handle)
    move_to_another_node(SnapshotStore(tmp_path / "store"), saved["id"])
    refused = cli(tmp_path / "store", "restore", saved["name"], check=False)
    assert refused.returncode != 0 and "compatibility failed" in refused.stderr
    assert (f"jupyter gpu-snapshot restore {saved['name']} --fallback portable|replay|both"
            in " ".join(refused.stderr.split())), refused.stderr

    out = cli(tmp_path / "store", "restore", saved["name"], "--fallback", "both", "--json")
    fresh: dict[str, Any] = json.loads(out.stdout)
    report = fresh["fallback"]
    assert {"grid", "np"} <= {entry["name"] for entry in report["loaded"]}
    assert len(report["replayed"]) == 1 and report["replayed"][0]["status"] == "ok"
    km = KernelManager(connection_file=fresh["connection_file"])
    km.load_connection_file()
    client = km.blocking_client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=30)
        reply = client.execute_interactive(
            "import hashlib; print(hashlib.sha256(grid.tobytes()).hexdigest(), next(stream))",
            output_hook=lambda msg: outputs.append(msg), timeout=30)
        assert reply["content"]["status"] == "ok"
    finally:
        client.shutdown()
        client.stop_channels()
    expected = hashlib.sha256((np.arange(4096, dtype=np.float64).reshape(64, 64) ** 0.5)
                              .tobytes()).hexdigest()
    printed = "".join(m["content"].get("text", "") for m in outputs
                      if m["msg_type"] == "stream")
    assert printed.split() == [expected, "0"]


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


def test_check_names_the_cuda_plugin_and_where_it_is_missing(tmp_path: Path):
    # make test installs the plugin and the stand-in where the default points.
    checks = {c["name"]: c for c in json.loads(cli(tmp_path / "store", "check", "--json").stdout)}
    assert checks["cuda plugin"]["ok"] is True, checks["cuda plugin"]
    assert "cuda_plugin.so" in checks["cuda plugin"]["detail"]
    elsewhere = cli(tmp_path / "store", "check", "--json",
                    env={"JUPYTER_GPU_SNAPSHOT_LIBDIR": str(tmp_path / "none")})
    plugin = {c["name"]: c for c in json.loads(elsewhere.stdout)}["cuda plugin"]
    assert plugin["ok"] is False and "is not installed" in plugin["detail"]
    assert "install-criu.sh" in plugin["fix"] and plugin["required"] is False


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
    resource_dir = Path(ksm.get_all_specs()["python3-snapshot"]["resource_dir"])
    assert (resource_dir / "logo-svg.svg").is_file()  # JupyterLab's launcher shows it


def test_the_wheel_ships_the_kernelspec_as_data():
    # pyproject's shared-data puts kernelspec_files/ where jupyter_client looks for kernels
    # (as ipykernel ships python3), so pip install alone gives the kernel.
    from jupyter_client.kernelspec import KernelSpecManager

    from jupyter_gpu_snapshot.launch.kernelspec import SHIPPED_SPEC, kernel_json

    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    source = SHIPPED_SPEC.relative_to(Path(__file__).parents[2]).as_posix()
    assert f'"{source}" = "share/jupyter/kernels/python3-snapshot"' in pyproject
    # The shipped file is what install writes, with jupyter_client's stand-in for the
    # server's own interpreter; it cannot drift from kernel_json().
    assert json.loads((SHIPPED_SPEC / "kernel.json").read_text()) == kernel_json("python")
    ksm = KernelSpecManager(kernel_dirs=[str(SHIPPED_SPEC.parent)])
    spec = ksm.get_kernel_spec(SHIPPED_SPEC.name)
    assert spec.display_name == "Python 3 (snapshots)" and spec.argv[0] == "python"
    km = KernelManager(kernel_name=SHIPPED_SPEC.name, kernel_spec_manager=ksm)
    assert km.format_kernel_cmd()[0] == sys.executable


def test_resume_wakes_a_kernel_left_stopped(tmp_path: Path, kernel: KernelHandle):
    import signal
    import time

    kernel.execute("n = 41")
    for proc in procfs.tree(kernel.root_pid):
        proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 60  # a signal is delivered asynchronously
    while not all(p.status() == "stopped" for p in procfs.tree(kernel.root_pid)):
        assert time.monotonic() < deadline, "the kernel did not stop"
        time.sleep(0.02)
    out = cli(tmp_path / "store", "resume", "--pid", str(kernel.kernel_pid))
    assert "woke pids" in out.stdout
    assert "42" in kernel.execute("n += 1; print(n)")


def test_resume_refuses_a_process_that_is_no_kernel_of_ours(tmp_path: Path):
    import signal

    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        other_proc = procfs.tree(other.pid)[0]
        other_proc.send_signal(signal.SIGSTOP)
        refused = cli(tmp_path / "store", "resume", "--pid", str(other.pid), check=False)
        assert refused.returncode == 2
        message = " ".join(refused.stderr.split())
        assert "not in a snapshot-ready kernel's process tree" in message and "--force" in message
        forced = cli(tmp_path / "store", "resume", "--pid", str(other.pid), "--force")
        assert f"woke pids [{other.pid}]" in forced.stdout
    finally:
        other.kill()
        other.wait()


def _flat(text: str) -> str:
    """Rich wraps long lines to the terminal's width."""
    return " ".join(text.split())


def test_unsigned_and_damaged_snapshots_are_listed_and_trust_is_explicit(tmp_path: Path):
    from tests.core.store.test_store import _commit, _manifest, _rewrite, _store

    store = _store(tmp_path)
    store.policy = SnapshotStore(store.root).policy  # the CLI's: this runtime dir's logs
    key = {"JUPYTER_GPU_SNAPSHOT_SIGNING_KEY_FILE": str(store.key_file)}
    old, forged = _commit(store, "old"), _commit(store, "forged")
    legacy = {k: v for k, v in _manifest(store, old).items()
              if k not in ("signature", "digest", "files")}
    payload = (store.root / old / "pages-1.img").read_bytes()
    legacy.update(format=1, files={"pages-1.img": {
        "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}})
    _rewrite(store, old, legacy)
    tampered = _manifest(store, forged)
    tampered["kernel"]["log_files"] = ["/etc/evil-cli/kernel-x.log"]
    _rewrite(store, forged, tampered)

    listing = {s["id"]: s for s in json.loads(cli(store.root, "list", "--json", env=key).stdout)}
    assert listing[old]["status"] == "unsigned" and listing[forged]["status"] == "damaged"
    assert "altered" in listing[forged]["problem"]
    assert "damaged" in cli(store.root, "list", env=key).stdout
    refused = cli(store.root, "restore", old, env=key, check=False)
    assert refused.returncode == 2 and f"gpu-snapshot trust {old}" in _flat(refused.stderr)
    refused = cli(store.root, "restore", forged, env=key, check=False)
    assert refused.returncode == 2 and "damaged" in refused.stderr
    assert not Path("/etc/evil-cli").exists()

    asked = cli(store.root, "trust", old, env=key, check=False)
    assert asked.returncode == 1 and "runs whatever code" in _flat(asked.stderr)
    assert "trusted old" in cli(store.root, "trust", old, "--yes", env=key).stdout
    listing = {s["id"]: s for s in json.loads(cli(store.root, "list", "--json", env=key).stdout)}
    assert listing[old]["status"] == "ok"
    assert f"deleted {forged}" in cli(store.root, "rm", forged, env=key).stdout


def test_du_says_what_each_snapshot_wrote_and_what_deleting_it_frees(tmp_path: Path):
    from tests.core.store.test_usage import _pages, _save
    from tests.core.store.test_usage import _store as usage_store

    store = usage_store(tmp_path)
    store.policy = SnapshotStore(store.root).policy  # the CLI's: this runtime dir's logs
    key = {"JUPYTER_GPU_SNAPSHOT_SIGNING_KEY_FILE": str(store.key_file)}
    first = _save(store, "first", _pages(*range(1, 301)))
    second = _save(store, "second", _pages(*range(1, 201), *range(1001, 1101)))

    du = json.loads(cli(store.root, "du", "--json", env=key).stdout)
    assert du["path"] == str(store.root) and du["disk_bytes"] > du["chunks_bytes"] > 0
    rows = {s["name"]: s for s in du["snapshots"]}
    assert [s["id"] for s in du["snapshots"]] == [first, second]
    assert rows["first"]["new_bytes"] > rows["second"]["new_bytes"]
    assert rows["second"]["frees_bytes"] > rows["second"]["own_bytes"]
    listing = {s["name"]: s for s in json.loads(cli(store.root, "list", "--json", env=key).stdout)}
    assert listing["second"]["new_bytes"] == rows["second"]["new_bytes"]

    human = cli(store.root, "du", env=key).stdout.splitlines()
    assert human[0].split() == ["NAME", "ID", "SIZE", "NEW", "FREES"]
    assert human[2].split()[:2] == ["second", second]
    assert human[-1].startswith("1.6 MiB on disk in ") and "in page packs" in human[-1]
    row = cli(store.root, "list", env=key).stdout.splitlines()[2].split()
    assert row[0] == "second" and row[5:9] == ["1.2", "MiB", "405.7", "KiB"]  # size, new
    cli(store.root, "rm", "first", env=key)
    cli(store.root, "rm", "second", env=key)
    assert cli(store.root, "du", env=key).stdout.startswith("0 B on disk in ")


def test_check_reports_an_unsafe_store(tmp_path: Path):
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    (store / "20250101T000000Z-0000abcd").symlink_to(tmp_path)
    checks = {c["name"]: c for c in json.loads(
        cli(store, "check", "--json", check=False).stdout)}
    assert not checks["store"]["ok"] and "symbolic link" in checks["store"]["detail"]
    os.unlink(store / "20250101T000000Z-0000abcd")
    os.chown(store, 65534, 65534)
    out = cli(store, "check", "--json", check=False)
    checks = {c["name"]: c for c in json.loads(out.stdout)}
    assert out.returncode == 1 and "owned by uid 65534" in checks["store"]["detail"]


def test_list_latest_names_each_notebooks_newest_snapshot(tmp_path: Path, kernel: KernelHandle):
    from jupyter_gpu_snapshot.core.engine import SnapshotEngine
    from jupyter_gpu_snapshot.core.hooks import SaveTarget
    from jupyter_gpu_snapshot.core.store import SnapshotStore
    from tests.conftest import run

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


def test_restore_gpus_is_checked_before_anything_runs(tmp_path: Path, kernel: KernelHandle,
                                                      restored: RestoredTrees):
    store = tmp_path / "store"
    cli(store, "save", "--pid", str(kernel.kernel_pid), "--name", "cpu", "--stop")
    for gpus, says in [("cuda:1", "gpus entry 'cuda:1' is neither a GPU index nor a GPU UUID"),
                       (",", "gpus entry '' is neither"),
                       ("0", "gpus was given, but snapshot")]:
        out = cli(store, "restore", "cpu", "--gpus", gpus, check=False)
        assert out.returncode == 2 and says in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    # Nothing of the refused restores runs: the kernel's ports are free for this one.
    result = json.loads(cli(store, "restore", "cpu", "--json").stdout)
    restored.connect(Path(result["connection_file"]), result["pid"])
    assert result["gpu_remap"] is None
