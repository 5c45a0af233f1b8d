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

# Joins the pid and network namespaces of process POD_PID, and starts PROGRAM there as
# UID:GID with the host pid NODE_PID and the pid NS_PID in that namespace (clone3's
# set_tid, root's), its stdio /dev/null; prints the child's host pid. Exit status 3: a
# pid taken.
SPAWN_AT = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/sched.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 7) return 2;
    pid_t node = atoi(argv[1]), inner = atoi(argv[2]);
    const char *kinds[] = {"net", "pid"};
    for (int i = 0; i < 2; i++) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%s/ns/%s", argv[3], kinds[i]);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0 || setns(fd, 0) < 0) { perror(path); return 1; }
        close(fd);
    }
    pid_t tids[2] = {inner, node};
    struct clone_args args;
    memset(&args, 0, sizeof args);
    args.exit_signal = SIGCHLD;
    args.set_tid = (uint64_t)(uintptr_t)tids;
    args.set_tid_size = 2;
    long pid = syscall(SYS_clone3, &args, sizeof args);
    if (pid < 0) { perror("clone3"); return errno == EEXIST ? 3 : 1; }
    if (pid == 0) {
        /* Nothing of ours: whoever waits for our output must not wait for the child. */
        int null = open("/dev/null", O_RDWR);
        for (int fd = 0; fd < 3; fd++) dup2(null, fd);
        gid_t gid = atoi(argv[5]);
        if (setgroups(1, &gid) || setgid(gid) || setuid(atoi(argv[4]))) _exit(126);
        execv(argv[6], argv + 6);
        _exit(127);
    }
    printf("%ld\n", pid);
    return 0;
}
"""


def _node_pid(pod: Pod, pid_there: int) -> int:
    (found,) = [p.pid for p in psutil.process_iter() if pod.holds(p.pid)
                and pid_in_pod(p.pid) == pid_there]
    return found


def _spawn_at(helper: Path, pod: Pod, node_pid: int, user: UnixUser) -> int:
    """A process of ``pod`` (its cgroup, pid and network namespaces) as ``user``, with the
    host pid ``node_pid``; its host pid."""
    for _ in range(20):
        inner = random.randrange(20000, 30000)
        done = subprocess.run(
            ["sh", "-c", pod._enter_cgroups + 'exec "$@"', "spawn", str(helper),
             str(node_pid), str(inner), str(pod.init_pid), str(user.uid), str(user.gid),
             "/bin/sleep", "600"], capture_output=True, text=True, timeout=COMMAND_SECONDS)
        if done.returncode == 0:
            return int(done.stdout)
        assert done.returncode == 3, done.stderr
    raise AssertionError(f"pid {node_pid} could not be had again")


def test_a_pid_taken_by_another_pod_after_the_connection_does_not_make_it_theirs(
        tmp_path: Path, unix_users: tuple[UnixUser, UnixUser], user_paths: dict[Path, int]
) -> None:
    shared_uid = unix_users[0]
    helper = tmp_path / "spawn-at"
    (tmp_path / "spawn-at.c").write_text(SPAWN_AT)
    subprocess.run(["cc", "-O", "-o", str(helper), str(tmp_path / "spawn-at.c")], check=True)
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

        taken = _spawn_at(helper, bobs_pod, connected, bob.unix_user)
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
