"""What one user's connections can cost the node agent, and what the agent answers to
requests that are wrong in themselves.

A real agent as root (its own, with small limits where a test needs them) and the real
users Alice and Bob, whose clients are small scripts run as them over the agent's socket:

- connections: Alice holding more open than her cap, idle, while Bob is served; request
  lines that never end; a client that shuts down only its writing side;
- requests: malformed JSON, ``args`` that are not an object, a kernel id ending in a
  newline;
- the disk quota: counted as ``du`` counts the store, and two saves asked for at once;
- a snapshot whose image file was replaced by a link.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from jupyter_gpu_snapshot.agent_client.protocol import MAX_REQUEST_BYTES, encode
from jupyter_gpu_snapshot.core import procfs
from testkit.unix_users import UnixUser

from .conftest import (
    BIG_CELL,
    COMMAND_SECONDS,
    Agent,
    as_user,
    cli,
    start_user_kernel,
    user_env,
)

# Generous: these machines may be busy; nothing below waits this long when all is well.
ANSWER_SECONDS = 30.0

# Run as the user: sends its stdin on one connection, optionally shuts down its writing
# side (as ``nc -N`` does), prints every line the agent answers.
SEND = """
import socket, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
s.sendall(sys.stdin.buffer.read())
if sys.argv[2] == "half-close":
    s.shutdown(socket.SHUT_WR)
s.settimeout(float(sys.argv[3]))
sys.stdout.buffer.write(s.makefile("rb").read())
"""

# Run as the user: opens argv[2] connections without sending anything and holds them
# until a line comes on stdin; then prints, as JSON, the first line each one got (or ""
# when it ended without one) and how many got nothing within argv[3] seconds. A connect
# the agent's full backlog refuses (EAGAIN) is tried again for a few seconds, then given
# up.
FLOOD = """
import json, selectors, socket, sys, time
path, count, wait = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
held = []
give_up = time.monotonic() + 5
while len(held) < count and time.monotonic() < give_up:
    s = socket.socket(socket.AF_UNIX)
    s.setblocking(False)
    try:
        s.connect(path)
    except BlockingIOError:
        s.close()
        time.sleep(0.002)
        continue
    held.append(s)
print(len(held), flush=True)
sys.stdin.readline()
selector = selectors.DefaultSelector()
received = {}
for s in held:
    selector.register(s, selectors.EVENT_READ)
    received[s] = b""
lines = []
deadline = time.monotonic() + wait
while received and time.monotonic() < deadline:
    for key, _ in selector.select(timeout=1):
        s = key.fileobj
        try:
            chunk = s.recv(1 << 16)
        except OSError:
            chunk = b""
        received[s] += chunk
        if b"\\n" in received[s] or not chunk:
            lines.append(received.pop(s).split(b"\\n")[0].decode())
            selector.unregister(s)
print(json.dumps({"lines": lines, "unanswered": len(received)}), flush=True)
"""

# Run as the user: argv[2] connections, each sending argv[3] bytes of a request line that
# never ends, all at once; says "sent" once every one has sent them or was cut off, and
# waits for a line on stdin; then ends what it sends and prints the first line each
# connection got, as JSON.
LONG_LINES = """
import json, socket, sys, threading
path, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socks = [socket.socket(socket.AF_UNIX) for _ in range(count)]
def send(s):
    try:
        s.sendall(b'{"op": "hello", "args": {"pad": "' + b"x" * size)
    except OSError:
        pass
threads = []
for s in socks:
    s.connect(path)
    threads.append(threading.Thread(target=send, args=(s,)))
    threads[-1].start()
for t in threads:
    t.join()
print("sent", flush=True)
sys.stdin.readline()
lines = []
for s in socks:
    try:
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    s.settimeout(60)
    try:
        lines.append(s.makefile("rb").readline().decode())
    except OSError as exc:
        lines.append(f"! {exc}")
print(json.dumps(lines), flush=True)
"""


def send(user: UnixUser, agent: Agent, data: bytes, half_close: bool = False,
         timeout: float = ANSWER_SECONDS) -> list[dict[str, Any]]:
    """``data`` sent as ``user`` on one connection: every line the agent answered."""
    done = subprocess.run(
        [sys.executable, "-c", SEND, str(agent.socket), "half-close" if half_close else "keep",
         str(timeout)], input=data, user=user.uid, group=user.gid, env=user_env(user, agent),
        capture_output=True, timeout=timeout + 30, check=False)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return [json.loads(line) for line in done.stdout.splitlines()]


def user_process(user: UnixUser, agent: Agent, code: str, *args: str
                 ) -> subprocess.Popen[str]:
    """Python ``code`` run as ``user`` with ``args``, talking over pipes."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], user=user.uid, group=user.gid,
        extra_groups=os.getgrouplist(user.name, user.gid), env=user_env(user, agent),
        cwd=user.home, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)


def log_since(agent: Agent, offset: int) -> str:
    with open(agent.log_path, "rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


def peak_rss(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


# -- connections -----------------------------------------------------------------------------
def test_one_user_holding_connections_shuts_no_one_else_out(start_agent, unix_users):
    """Alice opens many more connections than her cap and leaves them idle, with the
    agent's descriptors fewer than those (as under systemd's soft limit of 1,024, which
    about 1,000 connections used up): her connections over the cap are refused at once,
    those under it closed at the deadline, each with one line saying why; Bob is served
    while she holds them; the agent's log takes a line or two, not a traceback each."""
    alice, bob = unix_users
    cap, deadline = 8, 5
    agent = start_agent("flood", "--max-connections", str(cap),
                        "--request-timeout", str(deadline))
    # asyncio accepts up to 100 connections at a time before any is served.
    psutil.Process(agent.process.pid).rlimit(psutil.RLIMIT_NOFILE, (256, 256))
    log_start = agent.log_path.stat().st_size
    flood = user_process(alice, agent, FLOOD, str(agent.socket), "400", str(ANSWER_SECONDS))
    try:
        assert flood.stdout is not None and flood.stdin is not None
        connected = int(flood.stdout.readline() or 0)
        assert connected > 256, flood.stderr.read() if flood.stderr else ""
        asked = time.monotonic()
        hello = send(bob, agent, encode({"op": "hello", "args": {}}))
        assert hello and hello[-1]["result"]["user"]["uid"] == bob.uid, hello
        assert time.monotonic() - asked < ANSWER_SECONDS
        flood.stdin.write("go\n")
        flood.stdin.flush()
        said = json.loads(flood.stdout.readline())
    finally:
        flood.kill()
        flood.communicate()
    lines = said["lines"]
    assert said["unanswered"] == 0 and len(lines) == connected
    refused = [line for line in lines
               if f"you have {cap} connections open with the node agent" in line]
    idle = [line for line in lines if f"no request line within {deadline} s" in line]
    assert len(refused) + len(idle) == connected, sorted(set(lines))[:5]
    assert len(idle) <= cap
    assert all(json.loads(line)["error"]["code"] == "refused" for line in refused)
    # Her connections gone, she is served again.
    mine = send(alice, agent, encode({"op": "hello", "args": {}}))
    assert mine[-1]["result"]["limits"]["max_connections"] == cap
    said_in_log = log_since(agent, log_start)
    assert "Traceback" not in said_in_log
    assert len(said_in_log) < 4096, said_in_log[-2000:]


def test_request_lines_that_never_end_cost_the_agent_little(start_agent, unix_users):
    """Alice sends 32 request lines of 4 MiB that never end, all at once: the agent
    refuses each past MAX_REQUEST_BYTES, with a line saying so, and its memory grows by
    far less than the 128 MiB she sent (it grew by all of it with a 16 MiB limit)."""
    alice, _ = unix_users
    agent = start_agent("long-lines")
    count, size = 32, 4 << 20
    send(alice, agent, encode({"op": "hello", "args": {}}))  # the agent's realms, warm
    before = peak_rss(agent.process.pid)
    sender = user_process(alice, agent, LONG_LINES, str(agent.socket), str(count), str(size))
    try:
        assert sender.stdout is not None and sender.stdin is not None
        assert sender.stdout.readline().strip() == "sent", (
            sender.stderr.read() if sender.stderr else "")
        grown = peak_rss(agent.process.pid) - before
        sender.stdin.write("go\n")
        sender.stdin.flush()
        lines = json.loads(sender.stdout.readline())
    finally:
        sender.kill()
        sender.communicate()
    print(f"agent's peak RSS grew by {grown / 2**20:.1f} MiB for {count} lines of "
          f"{size >> 20} MiB")
    assert grown < 48 << 20, f"{grown / 2**20:.0f} MiB"
    errors = [json.loads(line)["error"] for line in lines]
    limit_kib = MAX_REQUEST_BYTES >> 10
    assert all(e["code"] == "invalid_request" for e in errors), errors[:3]
    assert all(f"longer than {limit_kib}.0 KiB" in e["message"] for e in errors), errors[:3]


def test_a_client_that_half_closes_gets_its_answer(agent, unix_users):
    """``nc -N`` and the like shut down their writing side once the request is sent, and
    then read: that is no request to stop. A launch (slow enough to be cancelled) and a
    hello both answer."""
    alice, _ = unix_users
    hello = send(alice, agent, encode({"op": "hello", "args": {}}), half_close=True)
    assert hello and hello[-1]["result"]["user"]["uid"] == alice.uid, hello
    launched = send(alice, agent, encode({"op": "launch", "args": {
        "argv": ["/bin/sleep", "300"], "kernel_id": "half-closed"}}), half_close=True)
    assert launched and "result" in launched[-1], launched
    assert procfs.tree_alive(launched[-1]["result"]["pid"])
    procfs.kill_tree(launched[-1]["result"]["pid"])


# -- requests --------------------------------------------------------------------------------
def test_malformed_requests_are_invalid_requests_without_a_traceback(agent, unix_users):
    alice, _ = unix_users
    log_start = agent.log_path.stat().st_size
    for data, expected in (
        (b'{"op": "hello",\n', "the request is not JSON"),
        (b'["hello"]\n', "the request is a JSON list, not an object"),
        (encode({"op": "hello", "args": ["x"]}), "args must be a JSON object, not list"),
        (encode({"op": "launch", "args": {"argv": ["/bin/true"], "kernel_id": "k1\n"}}),
         "is not a plain name"),
    ):
        replies = send(alice, agent, data)
        assert len(replies) == 1, (data, replies)
        error = replies[0]["error"]
        assert error["code"] == "invalid_request", (data, error)
        assert expected in error["message"], (data, error)
    assert not (agent.run_dir / "users" / str(alice.uid) / "logs" / "kernel-k1\n.log").exists()
    assert "Traceback" not in log_since(agent, log_start)


# A request nested deeper than any parser's stack: 100,000 lists in a hello's args.
DEEP = 100_000


@dataclass(frozen=True)
class Malformed:
    """One row: a request whose field is of the wrong kind, and the field's name, which the
    answer must give."""

    row: str
    op: str
    args: Callable[[int], dict[str, Any]]  # of the pid of Alice's kernel
    field: str


MALFORMED_FIELDS = (
    Malformed("a NUL in cwd", "launch", lambda pid: {
        "argv": ["/bin/true"], "kernel_id": "nul-cwd", "cwd": "/tmp/a\x00b"}, "cwd"),
    Malformed("a string as target.portable", "save", lambda pid: {
        "target": {"pid": pid, "portable": "yes"}}, "portable"),
    Malformed("a list as name", "save", lambda pid: {
        "target": {"pid": pid}, "name": ["mine"]}, "name"),
    Malformed("true as the pid", "save", lambda pid: {"target": {"pid": True}}, "pid"),
    Malformed("a number as a snapshot's ref", "restore", lambda pid: {"ref": 7}, "ref"),
)


def test_malformed_fields_are_invalid_requests_before_any_work(agent, unix_users):
    """Each is answered ``invalid_request`` naming the field, before anything is done for
    it (the kernel untouched and answering, nothing saved, no kernel launched), and the
    agent's log takes a line at most for each, never a traceback."""
    alice, _ = unix_users
    kernel = start_user_kernel(alice, agent)
    log_start = agent.log_path.stat().st_size
    for case in MALFORMED_FIELDS:
        replies = send(alice, agent, encode({"op": case.op, "args": case.args(kernel.root_pid)}))
        error = replies[-1].get("error") or {}
        assert error.get("code") == "invalid_request", (case.row, replies)
        assert case.field in error["message"], (case.row, error)
    deep = b'{"op": "hello", "args": {"x": ' + b"[" * DEEP + b"]" * DEEP + b"}}\n"
    replies = send(alice, agent, deep)
    assert replies[-1]["error"]["code"] == "invalid_request", replies
    said = log_since(agent, log_start)
    assert "Traceback" not in said, said[-3000:]
    assert len(said.splitlines()) <= len(MALFORMED_FIELDS) + 1, said[-3000:]
    assert json.loads(cli(alice, agent, "list", "--json").stdout) == []
    assert procfs.tree_alive(kernel.root_pid)
    assert not (agent.run_dir / "users" / str(alice.uid) / "logs" / "kernel-nul-cwd.log").exists()


def test_an_image_file_replaced_by_a_link_is_refused_by_name(agent, unix_users, tmp_path):
    """A snapshot's image file that is a link (the store altered behind the agent's back)
    is refused before anything reads it, naming the file, with what to do."""
    alice, _ = unix_users
    kernel = start_user_kernel(alice, agent)
    saved = json.loads(cli(alice, agent, "save", "--pid", str(kernel.root_pid), "--stop",
                           "--json").stdout)
    snapshot = agent.store_of(alice) / saved["id"]
    image = snapshot / "core-1.img"
    shutil.copy2(image, tmp_path / image.name)
    image.unlink()
    image.symlink_to(tmp_path / image.name)
    deadline = time.monotonic() + COMMAND_SECONDS
    while procfs.tree_alive(kernel.root_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    log_start = agent.log_path.stat().st_size
    refused = cli(alice, agent, "restore", saved["id"], check=False)
    assert refused.returncode == 2, refused
    assert (f"image file core-1.img of {saved['id']} is a symbolic link, not a regular file"
            in refused.stderr), refused.stderr
    assert "delete it" in refused.stderr
    assert "Traceback" not in log_since(agent, log_start)


# -- the disk quota --------------------------------------------------------------------------
def test_the_quota_counts_the_store_as_du_does(start_agent, unix_users):
    """The bytes a quota counts are those the store takes: its page packs once."""
    alice, _ = unix_users
    agent = start_agent("quota-du", "--disk-quota", "100G")
    kernel = start_user_kernel(alice, agent)
    cli(alice, agent, "save", "--pid", str(kernel.root_pid), "--name", "one")
    used = send(alice, agent, encode({"op": "hello", "args": {}}))[-1]["result"]["limits"][
        "used_bytes"]
    du = subprocess.run(["du", "-sb", str(agent.store_of(alice))], capture_output=True,
                        text=True, check=True)
    on_disk = int(du.stdout.split()[0])
    # du also counts the directories themselves (a few KiB).
    assert abs(used - on_disk) <= on_disk // 50 + (64 << 10), (used, on_disk)


# Run as the user: saves kernel argv[2] and, the moment the agent reports it under way,
# kernel argv[3]; prints every reply of both.
SAVE_TWO_KERNELS = """
import json, socket, sys

def save(pid, name):
    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
    s.sendall(json.dumps({"op": "save", "args": {"target": {"pid": pid}, "name": name}}
                         ).encode() + b"\\n")
    return s.makefile("rb")

big = save(int(sys.argv[2]), "big")
said = {"big": [json.loads(big.readline())]}
said["small"] = [json.loads(line) for line in save(int(sys.argv[3]), "small")]
said["big"] += [json.loads(line) for line in big]
print(json.dumps(said))
"""

def test_two_saves_at_once_cannot_both_pass_the_quota(start_agent, unix_users):
    """Alice's store is empty and her quota 200 MiB; she saves a kernel of 300 MiB and,
    while it runs, another: the second counts what the first may write, and is refused,
    with the command that makes room."""
    alice, _ = unix_users
    agent = start_agent("quota-twice", "--disk-quota", "200M", "--max-operations", "2")
    big = start_user_kernel(alice, agent)
    small = start_user_kernel(alice, agent)
    as_user(alice, agent, [sys.executable, "-c", BIG_CELL, big.connection_file])
    said = json.loads(as_user(alice, agent, [
        sys.executable, "-c", textwrap.dedent(SAVE_TWO_KERNELS), str(agent.socket),
        str(big.root_pid), str(small.root_pid)]).stdout)
    assert "result" in said["big"][-1], said["big"][-1]
    error = said["small"][-1]["error"]
    assert error["code"] == "refused", error
    assert "your saves under way" in error["message"] and "of your 200.0 MiB" in (
        error["message"]), error
    assert "jupyter gpu-snapshot rm" in error["hint"], error
    names = [s["name"] for s in json.loads(cli(alice, agent, "list", "--json").stdout)]
    assert names == ["big"]
    assert procfs.tree_alive(small.root_pid)
