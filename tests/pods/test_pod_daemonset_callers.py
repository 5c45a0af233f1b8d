"""Who a connection to the node's agent is, in the DaemonSet model, where pods of one uid are
different users: the pod, fixed once, when the agent accepts the connection.

- Connections are counted per pod: a user who makes pid namespaces of their own inside
  their pod (``unshare -Urpf``, which any user may run) does not get the cap once more per
  namespace; the agent's descriptors grow by the cap at most, and another pod is served.
- The caller is the process that connected, as it was then: a process that connected in
  Alice's pod and ended, its pid taken meanwhile by a process of Bob's pod (as a full pid
  wrap would do, here made at once with ``clone3``'s ``set_tid``), does not make the
  request line sent later on that connection Bob's.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil

from jupyter_gpu_snapshot.agent_client.protocol import decode
from testkit.pid_taker import Namespace, PidTaken, take_pid
from testkit.pods import Pod
from testkit.unix_users import POLL, UnixUser

from ..agent.conftest import COMMAND_SECONDS
from .conftest import pid_in_pod
from .daemonset import SOCKET_VARIABLE
from .test_pod_daemonset_isolation import node_users

# Far below the agent's default, so that a few namespaces show what is counted.
CONNECTION_CAP = 4
NAMESPACES = 5
# The descriptors the agent may hold for each connection (its socket, a pidfd of its peer),
# and besides them (a realm's first files).
PER_CONNECTION = 2
DESCRIPTOR_SLACK = 3

# Run in a pod as the user: ``argv[2]`` connections to the agent at ``argv[1]``, sending
# nothing; prints how many it holds, and holds them until its stdin ends.
HOLD = """
import socket, sys, time
path, count = sys.argv[1], int(sys.argv[2])
held = []
give_up = time.monotonic() + 30
while len(held) < count and time.monotonic() < give_up:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
    except BlockingIOError:
        s.close()
        time.sleep(0.01)
        continue
    held.append(s)
print(len(held), flush=True)
sys.stdin.read()
"""


def _agent_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_pid_namespaces_of_ones_own_do_not_multiply_a_pods_connections(
        tmp_path: Path, unix_users: tuple[UnixUser, UnixUser], user_paths: dict[Path, int]
) -> None:
    shared_uid = unix_users[0]  # Alice's and Bob's, as the chart's one uid for all
    options = ("--max-connections", str(CONNECTION_CAP), "--request-timeout", "300")
    with node_users(tmp_path, shared_uid, *options) as (agent, alice, bob):
        alices_pod, bobs_pod = alice.next_pod(), bob.next_pod()
        socket = alice.spec.env[SOCKET_VARIABLE]
        for user, pod in ((alice, alices_pod), (bob, bobs_pod)):  # their realms made
            assert "result" in user.ask_agent(pod, "hello", {})
        before = _agent_descriptors(agent.process.pid)
        holders = []
        for _ in range(NAMESPACES):
            holder = subprocess.Popen(
                alices_pod.argv("unshare", "-Urpf", "--kill-child", sys.executable, "-c",
                                HOLD, socket, str(CONNECTION_CAP), user=alice.unix_user.name),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            alice.holders.append(holder)  # ended with her holders, whatever happens
            holders.append(holder)
        for holder in holders:
            assert holder.stdout is not None
            assert int(holder.stdout.readline() or 0) == CONNECTION_CAP
        # Bob's request comes after all of hers: once it is answered, the agent has taken
        # each of hers (and refused those over the cap).
        asked = time.monotonic()
        said = bob.ask_agent(bobs_pod, "hello", {})
        assert "result" in said, said
        assert time.monotonic() - asked < COMMAND_SECONDS
        grown = _agent_descriptors(agent.process.pid) - before
        assert grown <= PER_CONNECTION * CONNECTION_CAP + DESCRIPTOR_SLACK, (
            f"{NAMESPACES} pid namespaces of one pod hold {grown} descriptors of the agent, "
            f"with a cap of {CONNECTION_CAP} connections per pod")


# Run in a pod as the user: connects to the agent at ``argv[1]`` and says its pid in the
# pod; at the first line on stdin, forks a child that keeps the connection, and ends; the
# child, at the next line, sends a hello on it and prints the agent's answer.
CONNECT_THEN_END = textwrap.dedent("""
    import os, socket, sys
    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
    print(os.getpid(), flush=True)
    sys.stdin.readline()
    if os.fork():
        os._exit(0)
    sys.stdin.readline()
    s.sendall(b'{"op": "hello", "args": {}}\\n')
    sys.stdout.write(s.makefile().readline())
    sys.stdout.flush()
""")

def _node_pid(pod: Pod, pid_there: int) -> int:
    (found,) = [p.pid for p in psutil.process_iter() if pod.holds(p.pid)
                and pid_in_pod(p.pid) == pid_there]
    return found


def _spawn_at(pod: Pod, node_pid: int, user: UnixUser) -> int:
    """A process of ``pod`` (its cgroup, pid and network namespaces) as ``user``, with the
    host pid ``node_pid``; its host pid."""
    for _ in range(20):
        inner = random.randrange(20000, 30000)
        with contextlib.suppress(PidTaken):  # the inner pid, most likely: another is drawn
            return take_pid(node_pid, ["/bin/sleep", "600"], user=(user.uid, user.gid),
                            namespace=Namespace(pod.init_pid, inner, pod._enter_cgroups),
                            timeout=COMMAND_SECONDS).pid
    raise AssertionError(f"pid {node_pid} could not be had again")


def test_a_pid_taken_by_another_pod_after_the_connection_does_not_make_it_theirs(
        tmp_path: Path, unix_users: tuple[UnixUser, UnixUser], user_paths: dict[Path, int]
) -> None:
    shared_uid = unix_users[0]
    with node_users(tmp_path, shared_uid) as (agent, alice, bob):
        alices_pod, bobs_pod = alice.next_pod(), bob.next_pod()
        stores = {}
        for user, pod in ((alice, alices_pod), (bob, bobs_pod)):
            stores[user.name] = user.ask_agent(pod, "hello", {})["result"]["store"]
        before = _agent_descriptors(agent.process.pid)
        client = subprocess.Popen(
            alices_pod.argv(sys.executable, "-c", CONNECT_THEN_END,
                            alice.spec.env[SOCKET_VARIABLE], user=alice.unix_user.name),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        alice.holders.append(client)
        assert client.stdout is not None and client.stdin is not None
        connected = _node_pid(alices_pod, int(client.stdout.readline()))
        # The agent has taken the connection: it holds a descriptor more.
        deadline = time.monotonic() + COMMAND_SECONDS
        while _agent_descriptors(agent.process.pid) <= before:
            assert time.monotonic() < deadline, "the agent did not accept the connection"
            time.sleep(POLL)
        client.stdin.write("end\n")
        client.stdin.flush()
        deadline = time.monotonic() + COMMAND_SECONDS
        while psutil.pid_exists(connected):
            assert time.monotonic() < deadline, f"process {connected} did not end"
            time.sleep(POLL)

        taken = _spawn_at(bobs_pod, connected, bob.unix_user)
        try:
            # The pid is Bob's pod's now, by what the runtime made of the pod (its cgroup
            # and network), not by the agent's own reading of it.
            assert taken == connected and bobs_pod.holds(taken)
            client.stdin.write("send\n")
            client.stdin.flush()
            said: dict[str, Any] = decode(client.stdout.readline())
        finally:
            psutil.Process(taken).kill()
        result = said.get("result")
        assert result is None or result["store"] == stores["alice"], (
            f"a connection made in Alice's pod was answered as Bob's: {said}")
