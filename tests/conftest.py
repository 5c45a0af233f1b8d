"""Shared fixtures: real snapshot-ready kernels, a private snapshot store, and helpers.

Every kernel here is a real ipykernel launched through jupyter_client with the
python3-snapshot kernelspec (our provisioner), and every snapshot is made by real CRIU.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import tempfile
import textwrap
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest
from jupyter_client.blocking import BlockingKernelClient
from jupyter_client.manager import KernelManager

# Keep connection files and kernel logs of the tests out of the user's runtime dir.
if "JUPYTER_RUNTIME_DIR" not in os.environ:
    os.environ["JUPYTER_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="jgs-runtime-")
    atexit.register(shutil.rmtree, os.environ["JUPYTER_RUNTIME_DIR"], ignore_errors=True)
# ...and the key that signs the tests' snapshots out of the user's data dir.
if "JUPYTER_GPU_SNAPSHOT_SIGNING_KEY_FILE" not in os.environ:
    _keys = tempfile.mkdtemp(prefix="jgs-keys-")
    os.environ["JUPYTER_GPU_SNAPSHOT_SIGNING_KEY_FILE"] = os.path.join(_keys, "signing.key")
    atexit.register(shutil.rmtree, _keys, ignore_errors=True)

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME, install
from jupyter_gpu_snapshot.launch.liveness import kernel_answers
from testkit import gpu_results
from testkit.manifests import commit_tiny
from testkit.processes import private_kernel_ports
from testkit.unix_users import unix_users, user_paths  # noqa: F401  (fixtures for tests/agent, tests/hub)

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one engine coroutine to completion from a synchronous test.

    A private loop, leaving the thread's current loop alone: asyncio.run() would unset it
    and break the pytest-jupyter server tests that run in the same session.
    """
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def _is_worker(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist worker (the controller collects its reports)."""
    return hasattr(config, "workerinput")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    # Once, before any test and before xdist starts its workers: install_kernel_spec
    # removes the directory before it copies, so a worker installing it while another
    # worker's kernel starts would pull the kernelspec from under that kernel.
    if not _is_worker(session.config):
        install()


# -- running in parallel ---------------------------------------------------------------------
# `make pytest` runs the suite in several pytest-xdist workers with `--dist loadgroup`: most
# of its time is spent waiting for kernels, criu and servers, not computing. Tests that
# share something beyond their own temporary directory run in one group, one after another
# on one worker, set up once.
UNIX_USERS_FOLDERS = ("tests/agent/", "tests/hub/", "tests/pods/")
BROWSER_FOLDER = "tests/ui/"


def _worker_group(item: pytest.Item) -> str | None:
    path = item.nodeid.split("::")[0]
    # They create, use and remove the machine's Unix users alice and bob, kill every one
    # of their processes when they end, and the node agent tests listen on /run/agent.sock.
    if path.startswith(UNIX_USERS_FOLDERS) or "unix_users" in item.fixturenames:
        return "unix-users"
    # Each scenario drives a chromium, heavy enough alone; the session's ui_tools may run
    # jlpm install into tests/ui/node_modules, which two workers must not do at once.
    if path.startswith(BROWSER_FOLDER):
        return "browser"
    # Built once for the session, on the worker that runs its readers.
    if "many_snapshots" in item.fixturenames:
        return "many-snapshots"
    # A module-scoped fixture (a Jupyter server, a saved kernel, a network namespace and
    # its S3 server) is started once per worker that runs one of the module's tests.
    info = getattr(item, "_fixtureinfo", None)
    if info is not None and any(
        defs[-1].scope in ("module", "package", "class")
        for name, defs in info.name2fixturedefs.items() if name in info.names_closure
    ):
        return path
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = _worker_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session: pytest.Session) -> None:
    # pytest-xdist groups a test by the "@group" it appends to the test's id; where it could
    # not (a pytest that ignores it), the group's tests would run at once on several workers.
    config = session.config
    if not (_is_worker(config) and config.getvalue("loadgroup")):
        return
    ungrouped = [item.nodeid for item in session.items
                 if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if ungrouped:
        # xdist's controller answers this with an internal error of its own, without the
        # words: pytest_configure names the one pytest known to do it.
        raise pytest.UsageError(
            f"pytest-xdist could not group {len(ungrouped)} tests (the first: {ungrouped[0]}), "
            "which would run at once on several workers")


def pytest_configure(config: pytest.Config) -> None:
    # Only loadgroup keeps a group on one worker; load, loadscope or worksteal would run
    # two unix-users tests at once, each killing the other's processes.
    dist = config.getoption("dist", "no")
    if config.getoption("tx", None) and dist not in ("no", "loadgroup"):
        raise pytest.UsageError(f"--dist {dist}: this suite runs in parallel only with "
                                "--dist loadgroup (the default of its addopts)")
    if config.getoption("tx", None) and _ignores_group_suffix(pytest.__version__):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} ignores the group pytest-xdist adds to a test's id, "
            "so --dist loadgroup would run a group's tests at once on several workers: "
            "install the pytest pyproject.toml asks for (pip install -e '.[test]')")


def _ignores_group_suffix(version: str) -> bool:
    """pytest 9.2 builds a test's id from its parts and drops the suffix xdist sets."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= (9, 2)


# -- GPU results -----------------------------------------------------------------------------
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    gpu_results.record(report)


def pytest_sessionfinish(session: pytest.Session) -> None:
    # Under xdist the controller receives every worker's reports, figures included.
    if not _is_worker(session.config):
        gpu_results.write()


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Numbers a GPU test measured, kept in the results file under the test's name; they
    travel in the teardown's report, from an xdist worker too."""
    found: dict[str, Any] = {}
    yield found
    if found:
        request.node.user_properties.append((gpu_results.FIGURES, found))


@dataclass
class KernelHandle:
    """A running kernel and a client that talks to it."""

    km: KernelManager
    client: BlockingKernelClient

    @property
    def root_pid(self) -> int:
        root = getattr(self.km.provisioner, "root_pid", None)
        assert root, "the kernel was not launched by the snapshot provisioner"
        return int(root)

    @property
    def kernel_pid(self) -> int:
        found = procfs.kernel_of(self.root_pid)
        assert found is not None
        return int(found.pid)

    def execute(self, code: str, timeout: float = 60) -> str:
        return execute(self.client, code, timeout)


class KernelError(AssertionError):
    pass


def execute(client: BlockingKernelClient, code: str, timeout: float = 60) -> str:
    """Run code in the kernel; return what it printed; raise on an error reply."""
    chunks: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        content = msg["content"]
        if msg["msg_type"] == "stream":
            chunks.append(content["text"])
        elif msg["msg_type"] == "execute_result":
            chunks.append(content["data"].get("text/plain", "") + "\n")
        elif msg["msg_type"] == "error":
            chunks.append("\n".join(content["traceback"]))

    reply = client.execute_interactive(textwrap.dedent(code), timeout=timeout, output_hook=hook)
    text = "".join(chunks)
    if reply["content"]["status"] != "ok":
        raise KernelError(f"kernel error: {reply['content'].get('ename')}: {text}")
    return text


def wait_for_output(
    client: BlockingKernelClient, msg_id: str, text: str, timeout: float = 120,
    stream: str | None = None,
) -> None:
    """Until the cell ``msg_id`` has printed ``text`` (on ``stream`` alone when given): it
    runs, whatever the machine's load."""
    deadline = time.monotonic() + timeout
    printed = ""
    while text not in printed:
        left = deadline - time.monotonic()
        assert left > 0, f"the cell did not print {text!r} in {timeout}s: {printed!r}"
        msg = client.get_iopub_msg(timeout=left)
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream"
                and stream in (None, msg["content"]["name"])):
            printed += msg["content"]["text"]


def reply_to(client: BlockingKernelClient, msg_id: str, timeout: float = 120) -> dict[str, Any]:
    """The shell reply to request ``msg_id``, skipping replies to earlier requests."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no reply to {msg_id} in {timeout}s"
        reply: dict[str, Any] = client.get_shell_msg(timeout=left)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply


def connect(info: dict[str, Any] | Path, timeout: float = 30) -> BlockingKernelClient:
    client = BlockingKernelClient()
    if isinstance(info, Path):
        client.load_connection_file(str(info))
    else:
        client.load_connection_info(info)
    client.start_channels()
    client.wait_for_ready(timeout=timeout)
    return client


def start_kernel(kernel_name: str = KERNEL_NAME, env: dict[str, str] | None = None,
                 **kwargs: Any) -> KernelHandle:
    """A kernel of ``kernel_name`` and a client; ``env`` adds to this process's environment."""
    km = KernelManager(kernel_name=kernel_name, **{**private_kernel_ports(), **kwargs})
    km.start_kernel(**({"env": {**os.environ, **env}} if env else {}))
    client = km.blocking_client()
    client.start_channels()
    client.wait_for_ready(timeout=60)
    return KernelHandle(km, client)


def stop_kernel(handle: KernelHandle) -> None:
    handle.client.stop_channels()
    # The root as the provisioner holds it: the pid alone may be another's by now.
    root = getattr(handle.km.provisioner, "root", None)
    if handle.km.has_kernel:
        handle.km.shutdown_kernel(now=True)
    if root is not None and procfs.tree_alive(root):
        procfs.kill_tree(root)


@pytest.fixture
def kernel() -> Iterator[KernelHandle]:
    handle = start_kernel()
    try:
        yield handle
    finally:
        stop_kernel(handle)


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(tmp_path / "store")


@pytest.fixture(scope="session")
def many_snapshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of 200 small snapshots of 7 notebooks, committed once for the
    session: each commit checks its name against every snapshot already there, so filling
    it takes seconds of CPU. For the tests that only list them, each in a copy of its own
    (``copy_many_snapshots``)."""
    store = SnapshotStore(tmp_path_factory.mktemp("many-snapshots") / "store")
    for i in range(200):
        commit_tiny(store, f"snap-{i}", f"nb-{i % 7}.ipynb")
    return store.root


def copy_many_snapshots(many_snapshots: Path, root: Path) -> None:
    """The ``many_snapshots`` store copied to ``root``, whole: the same signed manifests and
    images, read through this test's own store."""
    shutil.copytree(many_snapshots, root, symlinks=True, dirs_exist_ok=True)


@pytest.fixture
def criu_path() -> str:
    """The real criu, for the servers that the tests start."""
    found = shutil.which("criu")
    assert found, "criu >= 4.2 must be installed (make criu)"
    return found


@pytest.fixture
def engine(store: SnapshotStore) -> SnapshotEngine:
    # As make_engine wires it: keep-running saves check that the kernel still answers.
    return SnapshotEngine(store, kernel_answers=kernel_answers)


class RestoredTrees:
    """Restored process trees to kill after a test, whatever happened in it."""

    def __init__(self) -> None:
        # Held as the processes they are now: a tree that ended during the test leaves its
        # pid to others, whom the cleanup must not kill.
        self.roots: list[psutil.Process] = []
        self.clients: list[BlockingKernelClient] = []

    def connect(self, info: dict[str, Any] | Path, root: int) -> BlockingKernelClient:
        held = procfs.held(root)
        if held is not None:
            self.roots.append(held)
        client = connect(info)
        self.clients.append(client)
        return client

    def close(self) -> None:
        for client in self.clients:
            client.stop_channels()
        for root in self.roots:
            procfs.kill_tree(root)


@pytest.fixture
def restored() -> Iterator[RestoredTrees]:
    trees = RestoredTrees()
    try:
        yield trees
    finally:
        trees.close()
