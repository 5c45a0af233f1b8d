"""What each command of ``jupyter gpu-snapshot`` imports from its start to its answer: only
what it uses. The modules come from ``python -X importtime`` (its stderr lists every module
a process imports), so an import that creeps back in fails here, however fast the machine;
the time itself is benchmarks/bench_cli.py's to measure."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from jupyter_gpu_snapshot.core.store import SnapshotStore
from testkit.manifests import commit_tiny

# No command's start needs these: jsonschema and the format grammars its format checker
# compiles at import, the server, the kernel side, and the libraries of the operations that
# move pages or talk to kernels.
NEVER = (
    "jsonschema", "rfc3987_syntax", "lark", "arrow", "isoduration",
    "tornado", "jupyter_server", "jupyter_events", "jupyter_gpu_snapshot.server",
    "IPython", "ipykernel", "ipywidgets", "jupyter_gpu_snapshot.kernel",
    "numpy", "fsspec", "cryptography", "zmq", "jupyter_client",
    "jupyter_gpu_snapshot.core.store.packs", "jupyter_gpu_snapshot.core.store.images",
    "jupyter_gpu_snapshot.core.store.streamer", "jupyter_gpu_snapshot.core.store.usage",
    "jupyter_gpu_snapshot.core.store.remote.download",
    "jupyter_gpu_snapshot.core.store.remote.upload", "jupyter_gpu_snapshot.core.save",
    "jupyter_gpu_snapshot.agent",
)
# What --help may import of the package: the command table and what main() itself uses.
HELP_OWN = {
    "jupyter_gpu_snapshot", "jupyter_gpu_snapshot._version", "jupyter_gpu_snapshot._constants",
    "jupyter_gpu_snapshot.cli", "jupyter_gpu_snapshot.cli.main",
    "jupyter_gpu_snapshot.cli.output", "jupyter_gpu_snapshot.cli.interrupts",
    "jupyter_gpu_snapshot.core", "jupyter_gpu_snapshot.core.errors",
}
_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \| ( *)(\S+)$", re.M)


def imported(*args: str, cwd: Path) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    """The modules the CLI imports to answer ``args``, and how it ended."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "jupyter_gpu_snapshot.cli", *args],
        capture_output=True, text=True, timeout=120, cwd=cwd,
        env={**os.environ, "JUPYTER_GPU_SNAPSHOT_USE_AGENT": "never"},
    )
    modules = {name for _, name in _LINE.findall(done.stderr)}
    assert "jupyter_gpu_snapshot.cli.main" in modules, done.stderr[-2000:]
    return modules, done


def within(modules: set[str], forbidden: tuple[str, ...]) -> list[str]:
    """The modules of ``modules`` that are, or are inside, one of ``forbidden``."""
    return sorted(m for m in modules if any(m == f or m.startswith(f + ".") for f in forbidden))


def test_help_imports_the_command_table_alone(tmp_path: Path) -> None:
    modules, done = imported("--help", cwd=tmp_path)
    assert done.returncode == 0 and "list" in done.stdout
    own = {m for m in modules if m.startswith("jupyter_gpu_snapshot")}
    assert own <= HELP_OWN, sorted(own - HELP_OWN)
    assert not within(modules, (*NEVER, "traitlets", "psutil", "asyncio", "rich")), \
        within(modules, (*NEVER, "traitlets", "psutil", "asyncio", "rich"))


def test_list_reads_the_manifests_with_nothing_of_the_sequences(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store")
    snapshot_id = commit_tiny(store, "listed")
    modules, done = imported("--store", str(store.root), "list", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    # The manifest was read and checked, so the check's own imports are counted here.
    [listed] = json.loads(done.stdout)
    assert (listed["id"], listed["status"]) == (snapshot_id, "ok")
    assert not within(modules, (*NEVER, "rich")), within(modules, (*NEVER, "rich"))


def test_status_reads_proc_alone(tmp_path: Path) -> None:
    modules, done = imported("status", "--pid", str(os.getpid()), "--json", cwd=tmp_path)
    assert done.returncode == 1 and json.loads(done.stdout)["ready"] is False, done.stderr
    quiet = (*NEVER, "rich", "traitlets", "jupyter_gpu_snapshot.config",
             "jupyter_gpu_snapshot.node", "jupyter_gpu_snapshot.core.store",
             "jupyter_gpu_snapshot.gpu")
    assert not within(modules, quiet), within(modules, quiet)


def test_check_imports_the_checks_and_no_more(tmp_path: Path) -> None:
    modules, done = imported("check", "--json", cwd=tmp_path)
    assert {c["name"] for c in json.loads(done.stdout)} >= {"criu", "privileges"}, done.stderr
    assert not within(modules, NEVER), within(modules, NEVER)


def test_timeline_asks_the_kernel_with_nothing_of_the_server_or_the_store(
    tmp_path: Path,
) -> None:
    # The kernel's connection (jupyter_client, its tornado, zmq) is all it needs; a kernel
    # that is not there is told in one line naming the step, before any of it is asked.
    modules, done = imported("timeline", "no-such-kernel", cwd=tmp_path)
    told = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2 and done.stdout == "", told
    assert len(told) == 1 and told[0].startswith(
        "error: lookup failed: no connection file kernel-no-such-kernel.json"), told
    quiet = (*(m for m in NEVER if m not in ("zmq", "jupyter_client", "tornado")),
             "jupyter_gpu_snapshot.config", "jupyter_gpu_snapshot.core.store",
             "jupyter_gpu_snapshot.gpu", "jupyter_gpu_snapshot.node.engine")
    assert not within(modules, quiet), within(modules, quiet)
