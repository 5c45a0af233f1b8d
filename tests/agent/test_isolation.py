"""What the node agent does for a user without root, and what it refuses them.

Real everything: the agent runs as root; Alice and Bob are real Unix users; their kernels
are real ipykernels started through jupyter_client and our provisioner, which asks the
agent; every save and restore is real CRIU. Each refusal is checked for its message, and
for what did not happen (no snapshot listed, the kernel still running).

The table (docs/cluster.md, "What each check defends against"), one test per row: Alice's
own kernel saved and restored; Bob asking for Alice's processes and snapshots; an image
claiming root though signed; paths out of Alice's realm and a library in her environment;
two saves of hers at once, and her quota, neither holding Bob up; a client gone mid-save.
Then the agent's own footing: a request with bytes after it, a user whose groups changed,
its config file, and a state directory others could write.
"""

from __future__ import annotations

import grp
import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from traitlets.config import Config

from jupyter_gpu_snapshot.agent_client.protocol import decode, encode
from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.manifest import ManifestPolicy
from jupyter_gpu_snapshot.launch.liveness import kernel_answers
from testkit.unix_users import UnixUser

from ..conftest import run, start_kernel, stop_kernel
from .conftest import (
    BIG_CELL,
    CLI,
    Agent,
    as_user,
    ask_kernel,
    cli,
    save_and_stop,
    start_user_kernel,
    tree_uids,
)


def listed(user: UnixUser, agent: Agent) -> list[dict[str, object]]:
    return json.loads(cli(user, agent, "list", "--json").stdout)  # type: ignore[no-any-return]


def raw_call(user: UnixUser, agent: Agent, op: str, args: dict[str, object],
             after: bytes = b"") -> list[dict]:
    """One request sent by hand as ``user``, then ``after``: the agent's every reply line."""
    code = textwrap.dedent(f"""
        import socket, sys
        s = socket.socket(socket.AF_UNIX); s.connect({str(agent.socket)!r})
        s.sendall(sys.stdin.buffer.read())
        sys.stdout.buffer.write(s.makefile("rb").read())
    """)
    done = subprocess.run(
        [sys.executable, "-c", code], input=encode({"op": op, "args": args}) + after,
        user=user.uid, group=user.gid, capture_output=True, timeout=120, check=True)
    return [decode(line) for line in done.stdout.splitlines()]


def test_a_user_saves_and_restores_their_own_kernel_through_the_agent(agent, unix_users):
    alice, _ = unix_users
    checked = cli(alice, agent, "check")
    assert f"{alice.name} (uid {alice.uid}" in checked.stdout
    assert str(agent.store_of(alice)) in checked.stdout
    kernel = start_user_kernel(alice, agent)
    assert tree_uids(kernel.root_pid) == {(alice.uid,) * 3}
    saved = json.loads(cli(alice, agent, "save", "--pid", str(kernel.root_pid), "--name",
                           "mine", "--json").stdout)
    assert [s["name"] for s in listed(alice, agent)] == ["mine"]
    # Root's, in root's directory: she can neither change an image nor sign one.
    store = agent.store_of(alice)
    assert store.stat().st_uid == 0 and stat.S_IMODE(store.stat().st_mode) == 0o700
    assert agent.key_of(alice).stat().st_uid == 0
    denied = as_user(alice, agent, ["ls", str(store)], check=False)
    assert denied.returncode != 0 and "Permission denied" in denied.stderr

    procfs.kill_tree(kernel.root_pid)
    restored = json.loads(cli(alice, agent, "restore", saved["id"], "--json").stdout)
    assert tree_uids(restored["pid"]) == {(alice.uid,) * 3}
    for proc in procfs.tree(restored["pid"]):
        status = Path(f"/proc/{proc.pid}/status").read_text()
        assert "CapEff:\t0000000000000000" in status
    assert ask_kernel(alice, agent, restored["connection_file"], "x + 1") == "42"


def test_other_users_processes_are_refused(agent, unix_users):
    alice, bob = unix_users
    kernel = start_user_kernel(alice, agent)
    refused = cli(bob, agent, "save", "--pid", str(kernel.root_pid), check=False)
    assert refused.returncode == 2
    assert "is not a kernel the node agent launched or restored for you" in refused.stderr
    # A process of his own that the agent did not launch is refused the same way.
    own = subprocess.Popen(["sleep", "300"], user=bob.uid, group=bob.gid)
    try:
        refused = cli(bob, agent, "save", "--pid", str(own.pid), check=False)
        assert "is not a kernel the node agent launched" in refused.stderr
    finally:
        own.kill()
        own.wait()
    assert listed(bob, agent) == []
    assert procfs.tree_alive(kernel.root_pid)
    assert ask_kernel(alice, agent, kernel.connection_file, "x") == "41"


def test_a_tree_with_a_process_that_is_not_the_callers_own_is_refused(agent, unix_users):
    """``ownership`` on real processes: root's, and one that dropped from root to Alice (the
    kernel marks it undumpable: its memory may hold what she must not read)."""
    from jupyter_gpu_snapshot.agent.credentials.ownership import Caller, process_problem

    alice, _ = unix_users
    caller = Caller(alice.uid, alice.gid, frozenset(os.getgrouplist(alice.name, alice.gid)),
                    alice.name)
    assert "runs as uid [0]" in (process_problem(os.getpid(), caller) or "")
    dropped = subprocess.Popen(
        [sys.executable, "-c", "import os, time; os.setgroups([]); "
         f"os.setresgid({alice.gid}, {alice.gid}, {alice.gid}); "
         f"os.setresuid({alice.uid}, {alice.uid}, {alice.uid}); print(1, flush=True); "
         "time.sleep(300)"], stdout=subprocess.PIPE)
    try:
        assert dropped.stdout is not None and dropped.stdout.readline().strip() == b"1"
        problem = process_problem(dropped.pid, caller) or ""
        assert "marked undumpable" in problem
    finally:
        dropped.kill()
        dropped.wait()
        assert dropped.stdout is not None
        dropped.stdout.close()
    own = start_user_kernel(alice, agent)
    assert process_problem(own.root_pid, caller) is None


def test_other_users_snapshots_are_not_theirs_to_see_or_touch(agent, unix_users):
    alice, bob = unix_users
    kernel = start_user_kernel(alice, agent)
    saved = json.loads(cli(alice, agent, "save", "--pid", str(kernel.root_pid), "--name",
                           "alices", "--json").stdout)
    assert "alices" not in [s["name"] for s in listed(bob, agent)]
    for command in (["restore", saved["id"]], ["rm", saved["id"]],
                    ["rename", saved["id"], "bobs"]):
        refused = cli(bob, agent, *command, check=False)
        assert refused.returncode != 0, command
        assert saved["id"] in refused.stderr and "no snapshot" in refused.stderr, refused.stderr
    # Nothing a request says makes Bob someone else: the agent knows him by his socket.
    replies = raw_call(bob, agent, "list", {"uid": alice.uid, "user": alice.name})
    assert replies[-1]["result"] == [] or all(
        s["id"] != saved["id"] for s in replies[-1]["result"])
    assert saved["id"] in [s["id"] for s in listed(alice, agent)]


def test_an_image_claiming_root_is_refused_though_signed(agent, unix_users):
    """The worst case: a snapshot of a root kernel, signed with Alice's key and writing its
    log in her log directory, lies in her store (as if someone else had written the store).
    The agent still refuses to restore it, before criu runs: CRIU would give the processes
    the image's credentials."""
    alice, _ = unix_users
    cli(alice, agent, "check")  # the agent makes her realm on first contact
    logs = agent.run_dir / "users" / str(alice.uid) / "logs"
    kernel = start_kernel(config=Config({"SnapshotReadyProvisioner": {"log_dir": str(logs)}}))
    try:
        kernel.execute("secret = 'root'")
        store = SnapshotStore(agent.store_of(alice), agent.key_of(alice),
                              ManifestPolicy(kernel_log_dir=lambda: logs))
        engine = SnapshotEngine(store, kernel_answers=kernel_answers)
        forged = run(engine.save(SaveTarget(pid=kernel.root_pid), name="roots", stop=True))
    finally:
        stop_kernel(kernel)
    assert forged.status == "ok"
    assert forged.id in [s["id"] for s in listed(alice, agent)]
    # Its log is root's file in her directory: not handed to her.
    refused = cli(alice, agent, "restore", forged.id, check=False)
    assert "is not the kernel user's own file" in refused.stderr, refused.stderr
    for log in logs.glob(f"kernel-{kernel.km.kernel_id}.log"):
        log.unlink()
    refused = cli(alice, agent, "restore", forged.id, check=False)
    assert refused.returncode == 2, refused.stdout
    assert "would run as uid 0" in refused.stderr, refused.stderr
    assert "your own unprivileged processes" in refused.stderr
    assert not [p for p in psutil.process_iter(["uids"])
                if p.info["uids"] and p.info["uids"].real == 0
                and f"kernel-{kernel.km.kernel_id}" in " ".join(_cmdline(p))]


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def test_paths_outside_the_users_realm_are_refused(agent, unix_users, tmp_path):
    alice, _ = unix_users
    for args, expected in (
        ({"argv": ["true"], "kernel_id": "../../../etc/cron.d/x"}, "is not a plain name"),
        ({"argv": ["true"], "kernel_id": "k1", "cwd": "relative/dir"}, "not an absolute path"),
    ):
        replies = raw_call(alice, agent, "launch", args)
        assert expected in replies[-1]["error"]["message"]
    # The kernel changes to its directory as Alice: root's private one is not hers to enter.
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700 and tmp_path.stat().st_uid == 0
    replies = raw_call(alice, agent, "launch", {
        "argv": [sys.executable, "-c", "print('ran')"], "kernel_id": "k2",
        "cwd": str(tmp_path)})
    error = replies[-1].get("error") or {}
    log = agent.run_dir / "users" / str(alice.uid) / "logs" / "kernel-k2.log"
    if not error:  # nsinit started, then could not enter /root as Alice
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
                log.exists() and "PermissionError" in log.read_text()):
            time.sleep(0.2)
        assert "PermissionError" in log.read_text()
        assert "ran" not in log.read_text()
    # Her log directory is hers, its parents root's: she cannot swap it for a link.
    logs = log.parent
    assert logs.stat().st_uid == alice.uid and logs.parent.stat().st_uid == 0
    swapped = as_user(alice, agent, ["mv", str(logs), str(logs) + ".old"], check=False)
    assert swapped.returncode != 0


def test_the_launcher_runs_none_of_the_users_libraries(agent, unix_users, tmp_path):
    """LD_PRELOAD in the kernel's environment reaches the kernel, which runs as Alice, and
    never the launcher, which runs as root until nsinit drops."""
    alice, _ = unix_users
    marks = Path(alice.home) / "preload-marks"
    marks.mkdir(exist_ok=True)
    os.chown(marks, alice.uid, alice.gid)
    source = tmp_path / "mark.c"
    source.write_text(textwrap.dedent(f"""
        #include <stdio.h>
        #include <unistd.h>
        __attribute__((constructor)) static void mark(void) {{
            char path[256];
            snprintf(path, sizeof path, "{marks}/uid-%d", (int)geteuid());
            FILE *f = fopen(path, "a"); if (f) {{ fputs("loaded\\n", f); fclose(f); }}
        }}
    """))
    library = Path(alice.home) / "mark.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    os.chown(library, alice.uid, alice.gid)
    replies = raw_call(alice, agent, "launch", {
        "argv": [sys.executable, "-c", "import time; time.sleep(30)"], "kernel_id": "preload",
        "env": {"LD_PRELOAD": str(library), "PATH": "/usr/bin:/bin"}})
    pid = replies[-1]["result"]["pid"]
    try:
        deadline = time.monotonic() + 60
        while not (marks / f"uid-{alice.uid}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (marks / f"uid-{alice.uid}").exists(), "the kernel did not get its environment"
        assert not (marks / "uid-0").exists(), "root loaded the user's library"
    finally:
        procfs.kill_tree(pid)



# Run as the user: a save, and a second one sent the moment the agent reports the first
# under way; prints every reply of both.
SAVE_TWICE = """
import json, socket, sys

def ask(name):
    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
    s.sendall(json.dumps({"op": "save", "args": {"target": {"pid": int(sys.argv[2])},
                          "name": name}}).encode() + b"\\n")
    return s.makefile("rb")

first = ask("first")
said = {"first": [json.loads(first.readline())]}
said["second"] = [json.loads(line) for line in ask("second")]
said["first"] += [json.loads(line) for line in first]
print(json.dumps(said))
"""


def test_one_operation_at_a_time_per_user_and_another_user_is_not_held_up(agent, unix_users):
    alice, bob = unix_users
    kernel = start_user_kernel(alice, agent)
    # 300 MiB of pages that do not compress: the first save lasts well beyond the moment
    # the second asks, even on a fast disk.
    as_user(alice, agent, [sys.executable, "-c", BIG_CELL, kernel.connection_file])
    said = json.loads(as_user(alice, agent, [
        sys.executable, "-c", SAVE_TWICE, str(agent.socket), str(kernel.root_pid)]).stdout)
    assert "progress" in said["first"][0]
    assert "you already have 1 snapshot operations under way" in (
        said["second"][-1]["error"]["message"])
    assert "result" in said["first"][-1], said["first"][-1]
    names = [s["name"] for s in listed(alice, agent)]
    assert "first" in names and "second" not in names
    # Bob's saves are his own business, whatever Alice has under way.
    bobs = start_user_kernel(bob, agent)
    cli(bob, agent, "save", "--pid", str(bobs.root_pid), "--name", "bobs")


def test_a_quota_stops_a_users_saves_and_no_one_elses(start_agent, unix_users):
    alice, bob = unix_users
    small = start_agent("quota", "--disk-quota", "1")
    kernel = start_user_kernel(alice, small)
    cli(alice, small, "save", "--pid", str(kernel.root_pid), "--name", "one")
    refused = cli(alice, small, "save", "--pid", str(kernel.root_pid), "--name", "two",
                  check=False)
    assert "your snapshots use" in refused.stderr and "of your 1" in refused.stderr
    assert procfs.tree_alive(kernel.root_pid)
    bobs = start_user_kernel(bob, small)
    cli(bob, small, "save", "--pid", str(bobs.root_pid), "--name", "bobs")
    checked = cli(alice, small, "check").stdout
    assert "used of 1 B" in checked


def test_a_client_that_goes_away_mid_save_leaves_the_kernel_running(agent, unix_users):
    alice, _ = unix_users
    kernel = start_user_kernel(alice, agent)
    before = {s["id"] for s in listed(alice, agent)}
    code = textwrap.dedent(f"""
        import socket, json, os
        s = socket.socket(socket.AF_UNIX); s.connect({str(agent.socket)!r})
        s.sendall(json.dumps({{"op": "save", "args": {{"target": {{"pid": {kernel.root_pid}}},
                                "name": "abandoned"}}}}).encode() + b"\\n")
        s.makefile("rb").readline()
        os._exit(0)
    """)
    as_user(alice, agent, [sys.executable, "-c", code])
    deadline = time.monotonic() + 120
    while "closed the connection" not in agent.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert procfs.tree_alive(kernel.root_pid)
    assert ask_kernel(alice, agent, kernel.connection_file, "x") == "41"
    names = {s["name"] for s in listed(alice, agent) if s["id"] not in before}
    # Either the save was stopped and rolled back, or it had already committed: never half.
    assert names <= {"abandoned"}


def test_check_says_when_no_agent_answers(unix_users, user_paths, tmp_path):
    alice, _ = unix_users
    gone = Agent(None, tmp_path / "nothing.sock", tmp_path, tmp_path, tmp_path / "log")  # type: ignore[arg-type]
    (tmp_path / "log").write_text("")
    done = as_user(alice, gone, [*CLI, "check"], check=False)
    assert done.returncode == 1
    assert "cannot be reached" in done.stdout and "docs/cluster.md" in done.stdout


def test_bytes_sent_after_the_request_do_not_stop_it(agent, unix_users):
    """Only the end of the connection asks the agent to stop; more bytes are ignored."""
    alice, _ = unix_users
    replies = raw_call(alice, agent, "hello", {}, after=b"more\n")
    assert replies[-1]["result"]["user"]["uid"] == alice.uid


EXTRA_GROUP = "jgs-agent-extra"


@pytest.fixture
def extra_group() -> Iterator[int]:
    """A group of no one's, removed (with every membership in it) at the end."""
    subprocess.run(["groupdel", EXTRA_GROUP], capture_output=True, check=False)
    subprocess.run(["groupadd", EXTRA_GROUP], capture_output=True, check=True)
    try:
        yield grp.getgrnam(EXTRA_GROUP).gr_gid
    finally:
        subprocess.run(["groupdel", EXTRA_GROUP], capture_output=True, check=False)


def test_a_user_who_joined_a_group_saves_and_restores_with_it(agent, unix_users, extra_group):
    """Each request is served with its caller's groups as the user database says then, not
    as it said at their first request: Alice joins a group after the agent met her, and
    her kernel, launched with it, comes back with it."""
    alice, _ = unix_users
    cli(alice, agent, "check")
    subprocess.run(["usermod", "-aG", EXTRA_GROUP, alice.name], capture_output=True,
                   check=True)
    kernel = start_user_kernel(alice, agent)
    assert extra_group in _groups(kernel.root_pid)
    saved = json.loads(cli(alice, agent, "save", "--pid", str(kernel.root_pid), "--name",
                           "grouped", "--json").stdout)
    procfs.kill_tree(kernel.root_pid)
    restored = json.loads(cli(alice, agent, "restore", saved["id"], "--json").stdout)
    assert extra_group in _groups(restored["pid"])
    assert ask_kernel(alice, agent, restored["connection_file"], "x + 1") == "42"


def _groups(pid: int) -> set[int]:
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("Groups:"))
    return {int(g) for g in line.split()[1:]}


def test_the_agent_reads_its_config_file(start_agent, agent_root, unix_users):
    alice, _ = unix_users
    config = agent_root / "agent_config.py"
    config.write_text('c.GPUSnapshot.criu_path = "/nonexistent/criu-from-config"\n')
    configured = start_agent("configured", "--config", str(config))
    launched = raw_call(alice, configured, "launch", {
        "argv": ["/bin/sleep", "300"], "kernel_id": "configured"})[-1]["result"]
    # Saved once nsinit runs the kernel, as Alice.
    deadline = time.monotonic() + 60
    while tree_uids(launched["pid"]) != {(alice.uid,) * 3} or len(
            procfs.tree(launched["pid"])) < 2:
        assert time.monotonic() < deadline, "the kernel did not start"
        time.sleep(0.2)
    refused = raw_call(alice, configured, "save", {"target": {"pid": launched["pid"]}})[-1]
    assert "/nonexistent/criu-from-config" in refused["error"]["message"], refused


def test_the_agent_refuses_a_state_dir_others_may_write(agent_root):
    shared = agent_root / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    done = subprocess.run(
        [*CLI, "agent", "--socket", str(shared / "agent.sock"), "--state-dir",
         str(shared / "state"), "--run-dir", str(shared / "run")],
        capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2, done
    assert f"the state directory {shared / 'state'} is not root's alone" in done.stderr
    assert f"{shared} is writable by group and others (mode 777)" in done.stderr
    assert not (shared / "agent.sock").exists()


def test_a_link_planted_at_a_kernel_log_is_never_followed_by_root(agent, unix_users):
    """Before a restore, root recreates the kernel's log in the user's log directory: a
    link Alice put there in its place (to /etc/passwd) is refused, never followed."""
    alice, _ = unix_users
    kernel = start_user_kernel(alice, agent)
    saved = save_and_stop(alice, agent, kernel)
    target = Path("/etc/passwd")
    before = (target.stat(), target.read_bytes())
    log = Path(kernel.log)
    as_user(alice, agent, ["rm", "-f", str(log)])
    as_user(alice, agent, ["ln", "-s", str(target), str(log)])
    refused = cli(alice, agent, "restore", saved["id"], check=False)
    assert refused.returncode == 2, refused.stdout
    assert f"preflight failed: the kernel log {log} is a link" in refused.stderr, refused.stderr
    after = (target.stat(), target.read_bytes())
    assert (before[0].st_uid, before[0].st_mode, before[1]) == (
        after[0].st_uid, after[0].st_mode, after[1])
    assert log.is_symlink()
