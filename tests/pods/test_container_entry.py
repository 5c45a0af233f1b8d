"""The node agent's criu, run inside a user's container (``agent/pods/entry``).

An agent in the node's namespaces (a DaemonSet) must dump a kernel in the user's container
and restore it into the user's container, the same pod or the user's next one, with a criu
the container's image does not have. Here the pods' image hides criu and its plugin
directory; the agent's criu reaches the pod through ``pods/entry_program`` with its own loader
and libraries, read through a descriptor of the agent's root, and works with the engine's
own criu command lines (``CriuRunner``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from jupyter_gpu_snapshot.agent.pods.entry import ContainerEntry, in_agent
from jupyter_gpu_snapshot.agent.pods.entry_program import ENTRY_FAILED
from jupyter_gpu_snapshot.core.criu import CriuLaunch, CriuRunner
from testkit.pods import Pod, pods

from .conftest import pid_in_pod

# A tree as the agent launches one: its own pid and mount namespaces, its own session, no
# file of the launcher's. Its state lives in its memory and is written out each tick.
COUNTER = (
    "import time\n"
    "count = 0\n"
    "while True:\n"
    "    count += 1\n"
    "    with open('/data/count', 'w') as f:\n"
    "        f.write(str(count))\n"
    "    time.sleep(0.05)\n"
)
SETTLE_SECONDS = 30.0
MIN_COUNT_AT_DUMP = 10


def start_tree(pod: Pod) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        pod.argv("unshare", "--pid", "--fork", "--mount", "--mount-proc", "--propagation",
                 "private", "sh", "-c",
                 'exec </dev/null >/dev/null 2>&1; exec setsid "$0" -c "$1"',
                 sys.executable, COUNTER),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)


def tree_root(pod: Pod) -> int:
    """The node's pid of the tree's init in ``pod``, once it runs."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline:
        for proc in psutil.process_iter():
            nspids = _nspids(proc.pid)
            if len(nspids) == 3 and nspids[2] == 1 and pod.holds(proc.pid):
                return proc.pid
        time.sleep(0.1)
    raise AssertionError(f"no tree started in {pod.name}")


def _nspids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return [int(p) for p in line.split()[1:]]
    except OSError:
        pass
    return []


def count(volume: Path) -> int:
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline:
        text = (volume / "count").read_text() if (volume / "count").exists() else ""
        if text.isdigit():
            return int(text)
        time.sleep(0.05)
    raise AssertionError("the tree wrote no count")


def grows_from(volume: Path, at_least: int) -> int:
    """The count once it has moved on from ``at_least`` or more: the tree runs on."""
    first = count(volume)
    deadline = time.monotonic() + SETTLE_SECONDS
    while count(volume) <= first and time.monotonic() < deadline:
        time.sleep(0.05)
    now = count(volume)
    assert first >= at_least and now > first, (first, now, at_least)
    return now


@pytest.fixture
def criu_in_agent_only(tmp_path: Path) -> dict[Path, str]:
    """Volumes that hide the agent's criu and its plugins from the pods' image."""
    criu = Path(CriuRunner().executable())
    hidden = {criu.parent, Path("/usr/local/lib/jupyter-gpu-snapshot")}
    volumes = {}
    for index, path in enumerate(sorted(hidden)):
        empty = tmp_path / f"hidden-{index}"
        empty.mkdir()
        volumes[empty] = str(path)
    return volumes


def criu_in(entry: ContainerEntry) -> CriuRunner:
    prefix = tuple(entry.prefix())
    return CriuRunner(launch=CriuLaunch(dump_as=prefix, restore_as=prefix,
                                        program=ContainerEntry.program))


def test_agent_criu_dumps_in_a_pod_and_restores_into_the_next(
        tmp_path: Path, criu_in_agent_only: dict[Path, str]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    volumes = {data: "/data", **criu_in_agent_only}
    with pods(tmp_path / "pods") as made:
        first = Pod("jupyter-alice", tmp_path / "pods", volumes)
        made.append(first)
        hidden = subprocess.run(first.argv("sh", "-c", "command -v criu || echo none"),
                                capture_output=True, text=True, check=True).stdout.strip()
        assert hidden == "none"
        tree = start_tree(first)
        root = tree_root(first)
        # Far enough from 1 that a tree started afresh could not pass for it.
        before = grows_from(data, 1)
        while before < MIN_COUNT_AT_DUMP:
            before = grows_from(data, before)

        images, work = tmp_path / "images", tmp_path / "work"
        images.mkdir()
        work.mkdir()
        dump = criu_in(ContainerEntry.of(first.init_pid)).dump_argv(
            pid_in_pod(root) or 0, Path(in_agent(images)), Path(in_agent(work)),
            leave_running=False)
        done = subprocess.run(dump, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (done.stderr, (work / "dump.log").read_text()[-3000:])
        tree.wait(timeout=SETTLE_SECONDS)
        dumped = count(data)
        assert dumped >= before
        first.delete()

        second = Pod("jupyter-alice", tmp_path / "pods", volumes)
        made.append(second)
        pidfile = work / "restore.pid"
        restore = criu_in(ContainerEntry.of(second.init_pid)).restore_argv(
            Path(in_agent(images)), Path(in_agent(work)), Path(in_agent(pidfile)))
        done = subprocess.run(restore, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (done.stderr, (work / "restore.log").read_text()[-3000:])
        # criu wrote the pid the tree has in the pod's namespace, where it ran.
        in_pod = int(pidfile.read_text())
        restored = tree_root(second)
        assert pid_in_pod(restored) == in_pod
        # The tree goes on from its count at the dump, in the new pod's network and
        # cgroups: not from 1, and not in the agent's namespaces.
        grows_from(data, dumped)
        assert second.holds(restored)


def test_entry_refuses_a_process_that_is_not_the_one_named(tmp_path: Path) -> None:
    with pods(tmp_path / "pods") as made:
        pod = Pod("jupyter-bob", tmp_path / "pods", {})
        made.append(pod)
        entry = ContainerEntry.of(pod.init_pid)
        # The same pid, started at another time: a pid given out again.
        stale = ContainerEntry(entry.pid, entry.start + 1, entry.cgroup_procs)
        done = subprocess.run([*stale.prefix(), "/bin/true"], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == ENTRY_FAILED
        assert "not the container's process any more" in done.stderr
        # The real one runs the command in the pod, whose hostname it then has.
        done = subprocess.run([*entry.prefix(), *ContainerEntry.program(
            shutil.which("hostname") or "/bin/hostname")],
            capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout.strip()) == (0, pod.name), done.stderr
