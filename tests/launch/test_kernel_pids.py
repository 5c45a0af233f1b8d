"""A snapshot-ready kernel's pid in its namespace: drawn from a range, and above every pid
that a restored process's CUDA socket claims for that namespace (launch/nsinit.py).

libcuda binds "\\0cuda-uvmfd-<namespace number>-<pid>\\0" at cuInit and fails when the name
is taken; criu binds the name again in a restored process. Here the sockets are bound by
plain Python, as libcuda binds them (SOCK_SEQPACKET, listening), so it all runs on a CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import psutil
import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.errors import NotFound
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.launch import nsinit
from jupyter_gpu_snapshot.server.status import TreeFacts
from tests.conftest import KernelHandle, RestoredTrees, execute, run, start_kernel, stop_kernel

# What libcuda does at cuInit (strace on driver 580.159.04).
BIND_LIKE_CUINIT = """
import os, socket
_ns = os.stat("/proc/self/ns/pid").st_ino
cuda_socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
cuda_socket.bind(f"\\0cuda-uvmfd-{_ns}-{os.getpid()}\\0".encode())
cuda_socket.listen(128)
print(_ns, os.getpid())
"""

UNIX_TABLE = """\
Num       RefCount Protocol Flags    Type St Inode Path
0000000000000000: 00000002 00000000 00010000 0005 01 20001 @cuda-uvmfd-4026532186-2@
0000000000000000: 00000002 00000000 00010000 0005 01 20002 @cuda-uvmfd-4026532186-7@
0000000000000000: 00000002 00000000 00010000 0005 01 20003 @cuda-uvmfd-4026532187-9@
0000000000000000: 00000002 00000000 00010000 0005 01 20004 @cuda-uvmfd-4026532186-x@
0000000000000000: 00000002 00000000 00010000 0001 01 20005 /run/cuda-uvmfd-4026532186-3
0000000000000000: 00000003 00000000 00000000 0001 03 20006
"""


def test_claimed_pids_are_this_namespaces_cuda_sockets():
    assert nsinit.claimed_pids(4026532186, UNIX_TABLE) == {2, 7}
    assert nsinit.claimed_pids(4026532187, UNIX_TABLE) == {9}
    assert nsinit.claimed_pids(4026531836, UNIX_TABLE) == set()


def test_kernel_pid_is_drawn_from_the_range_and_above_every_claim_over_it():
    low, high = nsinit.KERNEL_PIDS
    assert nsinit.kernel_pid(set(), 0) == low
    assert nsinit.kernel_pid(set(), high - low - 1) == high - 1
    assert nsinit.kernel_pid(set(), high - low) == low
    assert nsinit.kernel_pid({2, 7}, 5) == low + 5  # claims below the draw are no matter
    assert nsinit.kernel_pid({low + 5}, 5) == low + 6
    assert nsinit.kernel_pid({2, low + 9}, 5) == low + 10


def _in_new_namespace(claims: list[int]) -> tuple[int, str]:
    """In a fresh PID namespace: bind CUDA socket names for ``claims`` there, choose the
    kernel's pid as nsinit does, fork; the child's pid and nsinit's note."""
    code = textwrap.dedent(f"""
        import importlib.util, os, socket
        spec = importlib.util.spec_from_file_location("nsinit", {str(nsinit.__file__)!r})
        nsinit = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(nsinit)
        ns = os.stat("/proc/self/ns/pid").st_ino
        held = []
        for pid in {claims!r}:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.bind(f"\\0cuda-uvmfd-{{ns}}-{{pid}}\\0".encode())
            s.listen(1)
            held.append(s)
        note = nsinit._choose_kernel_pid()
        child = os.fork()
        if child == 0:
            os._exit(0)
        os.waitpid(child, 0)
        print(child, note)
    """)
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "--", sys.executable, "-I", "-S", "-c",
         code], capture_output=True, text=True, timeout=60, check=True)
    pid, note = done.stdout.strip().split(" ", 1)
    return int(pid), note


def test_the_kernel_starts_above_what_restored_sockets_claim_in_its_namespace():
    low, high = nsinit.KERNEL_PIDS
    pid, note = _in_new_namespace([2, high - 1])
    assert pid == high
    assert f"pids [2, {high - 1}] of PID namespace" in note and f"kernel is pid {high}" in note
    pid, note = _in_new_namespace([])
    assert low <= pid < high and note == "None"


def _cuda_socket_names(pid: int) -> set[str]:
    with open(f"/proc/{pid}/net/unix") as f:
        return {fields[7] for line in f.read().splitlines()[1:]
                if len(fields := line.split()) > 7 and fields[7].startswith("@cuda-uvmfd-")}


def test_a_kernel_started_after_a_restore_can_bind_its_cuda_socket(
        engine: SnapshotEngine, restored: RestoredTrees):
    # The saved kernel binds its name as cuInit does; criu binds it again in the restored
    # copy, whose namespace has another number; every kernel started then binds its own.
    k = start_kernel()
    try:
        namespace, pid = map(int, k.execute(BIND_LIKE_CUINIT).split())
        assert pid == procfs.ns_pid(k.kernel_pid) and pid >= nsinit.KERNEL_PIDS[0]
        snapshot = run(engine.save(
            SaveTarget(pid=k.root_pid, connection_info=k.km.get_connection_info()),
            name="cuda-socket", stop=True))
    finally:
        stop_kernel(k)
    back = run(engine.restore(snapshot.id))
    client = restored.connect(back.connection_info, back.pid)
    stale = f"@cuda-uvmfd-{namespace}-{pid}@"
    assert stale in _cuda_socket_names(back.kernel_pid)
    assert procfs.pid_namespace(back.kernel_pid) != f"pid:[{namespace}]"
    started: list[KernelHandle] = []
    try:
        for _ in range(3):
            started.append(start_kernel())
            new_namespace, new_pid = map(int, started[-1].execute(BIND_LIKE_CUINIT).split())
            assert (new_namespace, new_pid) != (namespace, pid)
    finally:
        for other in started:
            stop_kernel(other)
    assert execute(client, "print(cuda_socket.getsockname())").strip() == repr(
        stale.replace("@", "\0").encode())


def test_a_kernel_that_exits_while_it_is_inspected_is_not_found(monkeypatch):
    """A kernel killed while its status is asked for: its /proc entries go between two reads
    (seen as a 500 from GET kernels/{id}/status in a full run)."""

    def gone(pid: int) -> int:
        raise FileNotFoundError(f"/proc/{pid}/ns/pid")

    monkeypatch.setattr(procfs, "namespace_init", gone)
    with pytest.raises(NotFound, match="has exited"):
        procfs.inspect_kernel(os.getpid())

    def vanished(pid: int) -> procfs.KernelProcess:
        raise psutil.NoSuchProcess(pid)

    monkeypatch.setattr(procfs, "inspect_kernel", vanished)
    reasons, cuda = TreeFacts(lambda: []).get(os.getpid())
    assert "the kernel has no running process" in reasons and cuda is False
