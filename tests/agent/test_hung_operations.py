"""What one user's hung operations may cost the node agent: neither another user's answers
nor the agent's own stop.

- A FIFO at one's own kernel's connection file (the second audit's case): saves of that
  kernel, as many as the agent's worker threads, all under way. Bob's ``hello`` and
  ``list`` are answered at once all the same; her clients then go away, and SIGTERM stops
  the agent while the FIFO has no writer.
- A save whose criu hangs (a criu stand-in that never ends): Bob is served meanwhile, and
  SIGTERM stops the agent all the same, Alice's kernel running on (this one held on this
  release too: a guard for the stop).

Each waits for its event (a first answer line, a file the stand-in makes), never for time.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import IO, Any

import psutil

from jupyter_gpu_snapshot.agent_client.protocol import encode
from testkit.criu_wrappers import install
from testkit.file_watch import release_fifo

from .conftest import COMMAND_SECONDS, as_user, ask_kernel, start_user_kernel
from .test_limits import ANSWER_SECONDS, send, user_process

STOP_SECONDS = 60.0
# The threads of asyncio's default executor (concurrent.futures' default for a thread pool),
# which runs every blocking step of the agent: the saves below ask for as many.
DEFAULT_WORKERS = min(32, (os.cpu_count() or 1) + 4)

# Run as the user: ``argv[3]`` saves of kernel ``argv[2]`` through the agent at ``argv[1]``,
# each on a connection of its own; prints each line the agent answers as JSON
# ``{"save": i, "line": ...}``; closes every connection at the first line on stdin.
SAVES = """
import json, selectors, socket, sys
path, pid, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
selector = selectors.DefaultSelector()
socks = []
for i in range(count):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.sendall(json.dumps({"op": "save", "args": {"target": {"pid": pid}}}).encode() + b"\\n")
    selector.register(s, selectors.EVENT_READ, i)
    socks.append(s)
selector.register(sys.stdin, selectors.EVENT_READ, None)
pending = [b""] * count
while True:
    for key, _ in selector.select():
        if key.data is None:
            for s in socks:
                s.close()
            sys.exit(0)
        chunk = key.fileobj.recv(1 << 16)
        pending[key.data] += chunk
        while b"\\n" in pending[key.data]:
            line, pending[key.data] = pending[key.data].split(b"\\n", 1)
            print(json.dumps({"save": key.data, "line": json.loads(line)}), flush=True)
        if not chunk:
            selector.unregister(key.fileobj)
"""


class Lines:
    """The lines a process prints, read in a thread, each awaited with a deadline."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        self.reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line)

    def next(self, deadline: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=max(deadline - time.monotonic(), 0))
        except queue.Empty:
            raise AssertionError("no line before the deadline") from None
        return json.loads(line)  # type: ignore[no-any-return]


def test_a_fifo_at_ones_connection_file_holds_up_no_one_else(start_agent, unix_users):
    alice, bob = unix_users
    agent = start_agent("fifo-connection", "--max-operations", str(DEFAULT_WORKERS))
    kernel = start_user_kernel(alice, agent)
    kept = alice.home / "fifo-kernel.json"
    fifo = Path(kernel.connection_file)
    as_user(alice, agent, ["cp", str(fifo), str(kept)])
    as_user(alice, agent, ["rm", str(fifo)])
    as_user(alice, agent, ["mkfifo", str(fifo)])
    saves = user_process(alice, agent, SAVES, str(agent.socket), str(kernel.root_pid),
                         str(DEFAULT_WORKERS))
    assert saves.stdout is not None and saves.stdin is not None
    lines = Lines(saves.stdout)
    try:
        # Every save under way (its first report came) or answered; Bob asks meanwhile.
        started: set[int] = set()
        deadline = time.monotonic() + COMMAND_SECONDS
        while len(started) < DEFAULT_WORKERS:
            started.add(lines.next(deadline)["save"])
        asked = time.monotonic()
        for op in ("hello", "list"):
            said = send(bob, agent, encode({"op": op, "args": {}}))
            assert said and "result" in said[-1], (op, said)
        assert time.monotonic() - asked < ANSWER_SECONDS
        saves.stdin.write("close\n")
        saves.stdin.flush()
        assert saves.wait(timeout=COMMAND_SECONDS) == 0
        assert ask_kernel(alice, agent, str(kept), "x") == "41"
        agent.process.terminate()
        assert agent.process.wait(timeout=STOP_SECONDS) == 0, agent.log()[-3000:]
    finally:
        saves.kill()
        saves.wait()
        lines.reader.join()
        for pipe in (saves.stdin, saves.stdout, saves.stderr):
            if pipe is not None:
                pipe.close()
        release_fifo(fifo)


def _wrappers_of(script: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if script in (proc.info.get("cmdline") or []):
            found.append(proc)
    return found


def test_a_hung_save_holds_neither_another_user_nor_the_agents_stop(
        start_agent, agent_root, unix_users):
    alice, bob = unix_users
    directory = agent_root / "hung-criu"
    directory.mkdir(mode=0o711)
    waiting = directory / "criu-waits"
    # criu as it hangs on a file system that never answers: it says so, then waits.
    wrapper = install(directory, f'if [ "$1" = dump ]; then\n  touch {waiting}\n'
                                 "  while :; do sleep 1; done\nfi\n"
                                 f'exec {shutil.which("criu")} "$@"\n')
    config = directory / "config.py"
    config.write_text(f"c.GPUSnapshot.criu_path = {wrapper!r}\n")
    agent = start_agent("hung-criu", "--config", str(config))
    kernel = start_user_kernel(alice, agent)
    saves = user_process(alice, agent, SAVES, str(agent.socket), str(kernel.root_pid), "1")
    try:
        deadline = time.monotonic() + COMMAND_SECONDS
        while not waiting.exists():
            assert time.monotonic() < deadline and saves.poll() is None, agent.log()[-3000:]
            time.sleep(0.2)
        said = send(bob, agent, encode({"op": "hello", "args": {}}))
        assert said and "result" in said[-1], said
        agent.process.terminate()
        assert agent.process.wait(timeout=STOP_SECONDS) == 0, agent.log()[-3000:]
        assert ask_kernel(alice, agent, kernel.connection_file, "x") == "41"
    finally:
        saves.kill()
        saves.communicate()
        for proc in _wrappers_of(wrapper):
            for child in proc.children(recursive=True):
                child.kill()
            proc.kill()
