"""Hibernation's gpu tier through the node agent: a user without root has their kernel's GPU
released and given back, its process kept.

A real agent (``server.NodeAgent``), served by an event loop of its own in this process so
that its CUDA hook's driver is the scripted one of the test (``testkit/fake_driver.py``);
real kernels that Alice's jupyter_client starts through it; a real holder process, root's,
stopping their threads under ptrace. The calls come from a process of the user's that holds
the gpu tier as their server does (``SnapshotService.gpu_sleep``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest

import jupyter_gpu_snapshot.agent
from jupyter_gpu_snapshot.agent import realms, server
from jupyter_gpu_snapshot.agent_client.gpu_sleep import AgentGpuSleep
from jupyter_gpu_snapshot.agent_client.protocol import Refused, error_from
from jupyter_gpu_snapshot.config import GPUSnapshot
from jupyter_gpu_snapshot.core import locks, procfs
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.errors import (
    Busy,
    InvalidRequest,
    NotFound,
    NotReady,
    SnapshotError,
)
from jupyter_gpu_snapshot.gpu.driver import (
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_ERROR_UNKNOWN,
    ProcessState,
)
from jupyter_gpu_snapshot.gpu.hook import CudaCheckpointHook
from jupyter_gpu_snapshot.node.local_engine import default_hooks, make_engine
from testkit.fake_driver import (
    FORCE_CUDA_PLUGIN,
    GIB,
    RESTORE_THREAD_CODE,
    UUID0,
    FakeCudaDriver,
    FakeGpus,
    fake_cuda_env,
)
from testkit.unix_users import UnixUser

from .conftest import (
    UserKernel,
    as_user,
    ask_kernel,
    cli,
    kill_users_kernels,
    start_user_kernel,
    user_env,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent and its holders are root")

T = TypeVar("T")
KERNEL_BYTES = 2 * GIB
STOP_SECONDS = 30.0

# Run as the user: their server's gpu tier, called once per line of stdin (["method",
# [args]]), each answer a line: {"result": ...} or {"error": SnapshotError.to_dict()}.
USER_SERVER = """
import json, sys
from jupyter_gpu_snapshot.config import GPUSnapshot
from jupyter_gpu_snapshot.core.errors import SnapshotError
from jupyter_gpu_snapshot.node.local_engine import process_engine
settings = GPUSnapshot()
sleep = process_engine(settings).gpu_sleep()
print(json.dumps(type(sleep).__name__), flush=True)
for line in sys.stdin:
    method, args = json.loads(line)
    try:
        found = getattr(sleep, method)(*args)
        answer = {"result": found.to_dict() if hasattr(found, "to_dict") else found}
    except SnapshotError as exc:
        answer = {"error": exc.to_dict()}
    print(json.dumps(answer), flush=True)
"""

# Run as the user: where their server's preview says a restore of a snapshot would put its
# GPUs (``GET snapshots/{id}/gpus``), through ``NodeEngine.gpu_choice``.
GPU_PREVIEW = """
import asyncio, json, sys
from jupyter_gpu_snapshot.node.local_engine import process_engine
engine = process_engine()
print(json.dumps(asyncio.run(engine.gpu_choice(engine.get(sys.argv[1]), None))))
"""


class AgentInThisProcess:
    """A node agent served by an event loop of its own, in a thread of this process."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket = directory / "agent.sock"
        self.log_path = directory / "agent.log"
        self._log = logging.FileHandler(self.log_path)
        logging.getLogger(jupyter_gpu_snapshot.agent.__name__).addHandler(self._log)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.served: list[server.NodeAgent] = []
        self.node = self._start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(STOP_SECONDS)

    def _start(self) -> server.NodeAgent:
        node = server.NodeAgent(socket_path=self.socket, state_dir=self.directory / "state",
                                run_dir=self.directory / "run")
        self.run(node.start())
        self.served.append(node)
        return node

    def restart(self) -> None:
        """A new agent on the same directories, as systemd's restart makes one: it knows
        nothing but what they hold; the kernels and the holders run on."""
        self.run(self.node.stop())
        self.node = self._start()

    def close(self) -> None:
        """Stop serving, once the launchers of the kernels (ended by now) are reaped."""
        self.run(self.node.stop())

        async def reaped() -> None:
            launchers = [task for node in self.served for task in node._launchers]
            if launchers:
                await asyncio.wait(launchers, timeout=STOP_SECONDS)

        self.run(reaped())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(STOP_SECONDS)
        self.loop.close()
        logging.getLogger(jupyter_gpu_snapshot.agent.__name__).removeHandler(self._log)
        self._log.close()


class UserServer:
    """A process of the user's holding their server's gpu tier, asked one call at a time."""

    def __init__(self, user: UnixUser, agent: AgentInThisProcess) -> None:
        self.agent = agent
        self.proc = subprocess.Popen(
            [sys.executable, "-c", USER_SERVER], user=user.uid, group=user.gid,
            extra_groups=os.getgrouplist(user.name, user.gid), env=user_env(user, agent),
            cwd=user.home, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        kind = self.proc.stdout.readline()
        assert kind and json.loads(kind) == AgentGpuSleep.__name__, self._failed()

    def call(self, method: str, *args: Any) -> Any:
        """The method's result; an error of the agent is raised as its own class."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([method, list(args)]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, self._failed()
        answer = json.loads(line)
        if "error" in answer:
            raise error_from(answer["error"])
        return answer["result"]

    def close(self) -> None:
        """The server stops: its end of stdin closed, it ends."""
        with self.proc:  # closes the pipes, then waits
            pass

    def _failed(self) -> str:
        self.proc.kill()
        _, err = self.proc.communicate()
        return f"{err}\n--- agent log ---\n{self.agent.log()[-3000:]}"


@pytest.fixture
def driver() -> FakeCudaDriver:
    return FakeCudaDriver()


@pytest.fixture
def gpu_agent(agent_root: Path, unix_users: tuple[UnixUser, UnixUser],
              user_paths: dict[Path, int], driver: FakeCudaDriver,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentInThisProcess]:
    """Every user's engine in the agent gets a CUDA hook over ``driver``, one 80 GiB GPU."""
    gpus = FakeGpus(driver)

    def engine_with_fake_cuda(settings: GPUSnapshot, **options: Any) -> SnapshotEngine:
        cuda = CudaCheckpointHook(driver=driver.status, inventory=gpus, lock_timeout=1.0,
                                  drop_caches=False, memory_available=lambda: 64 * GIB,
                                  criu_env=FORCE_CUDA_PLUGIN)
        hooks = default_hooks(settings)[:-1]
        return make_engine(settings, hooks=[*hooks, cuda], **options)

    monkeypatch.setattr(realms, "make_engine", engine_with_fake_cuda)
    # Short: the agent's socket is in it. The users' kernels reach their logs in it.
    directory = Path(tempfile.mkdtemp(prefix="gpu-", dir=agent_root))
    os.chmod(directory, 0o711)
    agent = AgentInThisProcess(directory)
    try:
        yield agent
    finally:
        kill_users_kernels(unix_users)
        agent.close()


@pytest.fixture
def alice(unix_users: tuple[UnixUser, UnixUser]) -> UnixUser:
    return unix_users[0]


@pytest.fixture
def alice_server(gpu_agent: AgentInThisProcess, alice: UnixUser) -> Iterator[UserServer]:
    server = UserServer(alice, gpu_agent)
    yield server
    server.close()


def cuda_kernel(user: UnixUser, agent: AgentInThisProcess) -> UserKernel:
    """A kernel of ``user``'s holding ``KERNEL_BYTES`` of GPU memory for the scripted driver,
    with a thread that stands for the driver's restore thread."""
    kernel = start_user_kernel(user, agent, env=fake_cuda_env(KERNEL_BYTES))
    assert ask_kernel(user, agent, kernel.connection_file,
                      f"exec({RESTORE_THREAD_CODE!r}) or 'started'") == "started"
    return kernel


def release(server: UserServer, kernel: UserKernel) -> dict[str, Any]:
    """The kernel's GPU released as hibernation asks for it, the kernel's id noted."""
    report: dict[str, Any] = server.call("release", kernel.root_pid,
                                         {"kernel_id": kernel.kernel_id})
    return report


def kernel_pid(kernel: UserKernel) -> int:
    """The kernel's own process, under the namespace's init."""
    found = procfs.kernel_of(kernel.root_pid)
    assert found is not None
    return found.pid


def asleep_as_the_driver_wants(kernel: UserKernel, driver: FakeCudaDriver) -> bool:
    """CUDA checkpointed, and every thread of the tree in a ptrace stop but the driver's
    restore thread."""
    pid = kernel_pid(kernel)
    restore_tid = driver.restore_thread_id(pid)
    return driver.state(pid) == ProcessState.CHECKPOINTED and all(
        state == "t" for proc in procfs.tree(kernel.root_pid)
        for tid, state in procfs.thread_states(proc.pid).items() if tid != restore_tid)


def awake(kernel: UserKernel, driver: FakeCudaDriver, agent: AgentInThisProcess) -> bool:
    """CUDA running, and the kernel answering with what it held."""
    return (driver.state(kernel_pid(kernel)) == ProcessState.RUNNING
            and ask_kernel(kernel.user, agent, kernel.connection_file, "x") == "41")


def test_a_user_releases_and_wakes_their_kernels_gpu_through_the_agent(
    gpu_agent: AgentInThisProcess, alice: UnixUser, alice_server: UserServer,
    driver: FakeCudaDriver,
) -> None:
    kernel = cuda_kernel(alice, gpu_agent)
    released = release(alice_server, kernel)
    assert released["gpu_memory"] == {UUID0: KERNEL_BYTES}
    assert released["held_threads"] >= 3  # nsinit, the kernel's main and its other threads
    assert set(released["timings"]) == {"lock", "hold", "checkpoint"}
    assert asleep_as_the_driver_wants(kernel, driver)

    status = alice_server.call("asleep", kernel.root_pid)
    assert status["kernel_id"] == kernel.kernel_id and status["root"] == kernel.root_pid
    assert status["gpu_memory"] == {UUID0: KERNEL_BYTES}
    # The holder is root's, and no child of the agent's: it outlives the request.
    holder = psutil.Process(int(status["holder_pid"]))
    assert holder.uids().real == 0 and holder.ppid() != os.getpid()

    woken = alice_server.call("wake", kernel.root_pid)
    assert {"restore", "unlock", "run"} <= set(woken["timings"])
    assert alice_server.call("asleep", kernel.root_pid) is None
    assert awake(kernel, driver, gpu_agent)
    assert driver.ops(kernel_pid(kernel)) == ["lock", "checkpoint", "restore", "unlock"]
    assert driver.protocol_breaches() == []


def test_another_user_is_refused_her_kernel_asleep_or_awake(
    gpu_agent: AgentInThisProcess, alice_server: UserServer, driver: FakeCudaDriver,
    unix_users: tuple[UnixUser, UnixUser],
) -> None:
    alice, bob = unix_users
    kernel = cuda_kernel(alice, gpu_agent)
    bob_server = UserServer(bob, gpu_agent)
    try:
        with pytest.raises(Refused) as refused:
            bob_server.call("release", kernel.root_pid, {})
        assert "is not a kernel the node agent launched or restored for you" in \
            refused.value.cause
        assert refused.value.step == "release the GPU"
        assert driver.ops(kernel_pid(kernel)) == []
        assert awake(kernel, driver, gpu_agent)

        release(alice_server, kernel)
        # Asleep, it is no more his: he can neither wake it nor read of its sleep.
        with pytest.raises(Refused, match="is not a kernel the node agent launched"):
            bob_server.call("wake", kernel.root_pid)
        assert bob_server.call("asleep", kernel.root_pid) is None
        assert asleep_as_the_driver_wants(kernel, driver)
    finally:
        bob_server.close()
    alice_server.call("wake", kernel.root_pid)
    assert awake(kernel, driver, gpu_agent)


def test_a_sleep_outlives_the_server_that_asked_and_a_restart_of_the_agent(
    gpu_agent: AgentInThisProcess, alice: UnixUser, alice_server: UserServer,
    driver: FakeCudaDriver,
) -> None:
    kernel = cuda_kernel(alice, gpu_agent)
    release(alice_server, kernel)
    alice_server.close()  # her server stops; a new one starts

    restarted = UserServer(alice, gpu_agent)
    try:
        assert restarted.call("asleep", kernel.root_pid)["kernel_id"] == kernel.kernel_id
        gpu_agent.restart()
        status = restarted.call("asleep", kernel.root_pid)
        assert status["kernel_id"] == kernel.kernel_id
        assert status["gpu_memory"] == {UUID0: KERNEL_BYTES}
        assert asleep_as_the_driver_wants(kernel, driver)
        restarted.call("wake", kernel.root_pid)
    finally:
        restarted.close()
    assert awake(kernel, driver, gpu_agent)
    assert driver.protocol_breaches() == []


def test_a_holder_killed_mid_sleep_takes_the_kernel_with_it(
    gpu_agent: AgentInThisProcess, alice: UnixUser, alice_server: UserServer,
) -> None:
    kernel = cuda_kernel(alice, gpu_agent)
    release(alice_server, kernel)
    holder_pid = int(alice_server.call("asleep", kernel.root_pid)["holder_pid"])
    tree = procfs.tree(kernel.root_pid)
    os.kill(holder_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(_alive(proc) for proc in tree):
        assert time.monotonic() < deadline, "a held process outlived its holder"
        time.sleep(0.05)
    # Nothing of the kernel runs on checkpointed CUDA: there is no kernel left to ask of.
    assert alice_server.call("asleep", kernel.root_pid) is None
    with pytest.raises(Refused, match="is not a kernel the node agent launched"):
        alice_server.call("wake", kernel.root_pid)


def test_a_refused_or_failed_release_leaves_the_kernel_running_and_a_failed_wake_asleep(
    gpu_agent: AgentInThisProcess, alice: UnixUser, alice_server: UserServer,
    driver: FakeCudaDriver,
) -> None:
    plain = start_user_kernel(alice, gpu_agent)
    with pytest.raises(NotReady, match="holds no CUDA state"):
        alice_server.call("release", plain.root_pid, {})

    kernel = cuda_kernel(alice, gpu_agent)
    with pytest.raises(NotFound, match="is not sleeping"):
        alice_server.call("wake", kernel.root_pid)
    # One request at a time per kernel: a save of it holds the lock a release takes too.
    realm = gpu_agent.run(gpu_agent.node.realm(realms.caller_of(alice.uid, alice.gid)))
    with realm.shared.store.locks.hold(locks.kernel_key(kernel.root_pid), "kernel", "save",
                                       note="save of the kernel"), \
            pytest.raises(Busy, match="is busy"):
        alice_server.call("release", kernel.root_pid, {})
    with pytest.raises(InvalidRequest, match="note must be a JSON object of at most"):
        alice_server.call("release", kernel.root_pid, {"padding": "x" * 8192})
    driver.fail("checkpoint", CUDA_ERROR_UNKNOWN)
    with pytest.raises(SnapshotError) as failed:
        alice_server.call("release", kernel.root_pid, {})
    assert failed.value.step == "release the GPU"
    assert "the kernel runs on with its GPU" in failed.value.cause
    assert alice_server.call("asleep", kernel.root_pid) is None
    assert awake(kernel, driver, gpu_agent)

    release(alice_server, kernel)
    with pytest.raises(InvalidRequest, match="sleeps already"):
        release(alice_server, kernel)
    driver.fail("restore", CUDA_ERROR_OUT_OF_MEMORY, times=3)
    with pytest.raises(SnapshotError) as failed:
        alice_server.call("wake", kernel.root_pid)
    assert "sleeps on" in failed.value.cause
    assert asleep_as_the_driver_wants(kernel, driver)
    alice_server.call("wake", kernel.root_pid)
    assert awake(kernel, driver, gpu_agent)
    assert driver.protocol_breaches() == []


class _AgentBeforeTheGpuTier:
    """An agent's client whose agent knows none of the gpu tier's operations."""

    socket_path = Path("/run/agent.sock")

    def call_sync(self, op: str, args: dict[str, Any] | None = None) -> Any:
        if op == "hello":
            return {"agent_version": "0.1.0", "operations": ["hello", "save", "restore"]}
        raise InvalidRequest("agent", f"unknown operation {op!r}")


def test_an_agent_before_the_gpu_tier_has_no_kernel_asleep_and_says_why_it_releases_none(
) -> None:
    sleep = AgentGpuSleep(_AgentBeforeTheGpuTier(), dict, lambda: None)  # type: ignore[arg-type]
    assert sleep.asleep(1234) is None
    with pytest.raises(NotReady) as refused:
        sleep.release(1234, {})
    assert "(version 0.1.0) does not release GPUs in place" in refused.value.cause


def _alive(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.NoSuchProcess):
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    return False


def test_the_gpu_preview_reads_the_agents_gpus(gpu_agent: AgentInThisProcess, alice: UnixUser
                                               ) -> None:
    """A user's process may not see the node's GPUs (no driver in its namespace, no device
    files): the preview of a restore is the agent's reading, with its CUDA hook."""
    kernel = start_user_kernel(alice, gpu_agent)
    saved = json.loads(cli(alice, gpu_agent, "save", "--pid", str(kernel.root_pid),
                           "--json").stdout)
    preview = json.loads(as_user(alice, gpu_agent, [sys.executable, "-c", GPU_PREVIEW,
                                                    saved["id"]]).stdout)
    assert [d["uuid"] for d in preview["node"]] == [UUID0], preview
    assert preview["problem"] is None and preview["devices"] == [], preview
