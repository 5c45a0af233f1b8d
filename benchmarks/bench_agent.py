"""The node agent's cost: a non-root user's kernel saved and restored through the agent,
against root's direct engine calls on the same kernel, in the same run.

Run as root. It creates a Unix user (``jgs-bench``, removed at the end if it was created),
makes the checkout and the interpreter traversable by them, and starts a real agent
(``jupyter gpu-snapshot agent``) on a private socket, state and run directory. Per case:

1. the user starts a snapshot-ready kernel through the agent (their own jupyter_client
   KernelManager, as their server would), which builds the case's state and prints its
   digest;
2. saves, ``stop=False``, alternating in ABBA order: ``direct`` is root's own engine
   (``make_engine``, a root store) called in this process; ``agent`` is a process of the
   user's timing ``AgentClient.call_sync("save", ...)`` around the call alone (not the
   interpreter's start);
3. the kernel is killed; restores alternate the same way: ``agent`` restores the user's
   snapshot through the agent, ``direct`` root's snapshot with the engine; after each, the
   restored kernel's digest (asked over its connection info) must equal the first, bitwise;
   then it is killed.

Each way first runs ``--warmup`` untimed saves and restores (criu's first run, the CUDA
plugin, the page cache). Where root lacks CAP_SYS_RESOURCE, criu cannot dump another user's
process as plain root; the direct engine then runs criu as the agent does there (criu's
``--unprivileged`` mode as the user, ``--direct-dump plain-root`` shows the failure).

The result names each run's seconds and the engine's own timings (the manifest's for a
save, the restore's), the medians and ``agent_extra_ms`` = median(agent) - median(direct).
The engine's steps vary from run to run by far more than the agent adds, so it also gives
``agent_extra_outside_engine_ms``: the same difference of each call's seconds less the
engine's own ``total`` (the socket, the agent's checks outside the engine, the replies).

    python benchmarks/bench_agent.py --cases torch,jax,cupy [--out FILE]
    python benchmarks/bench_agent.py --cases numpy     # CPU: no GPU needed
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pwd
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30
USER = "jgs-bench"
CLI = [sys.executable, "-m", "jupyter_gpu_snapshot.cli"]
COMMAND_SECONDS = 900.0

# Each case's kernel code: its state, and state_digest(), the sha256 of every byte of it
# plus of an elementwise kernel's result (a reduction may not repeat bitwise on a GPU).
TORCH = """
import hashlib, torch
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn({n}, generator=g, device="cuda", dtype=torch.float32)
torch.cuda.synchronize()
def state_digest():
    h = hashlib.sha256(x.cpu().numpy().tobytes())
    h.update((x[: 1 << 20] * 3 + 1).cpu().numpy().tobytes())
    return h.hexdigest()
assert state_digest() == state_digest()  # the digest itself is repeatable
print(torch.__version__, torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
print(state_digest())
"""
JAX = """
import os
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # the state, not 75% of the GPU
import hashlib, jax, jax.numpy as jnp, numpy as np
x = jax.random.normal(jax.random.key(0), ({n},), dtype=jnp.float32)
x.block_until_ready()
def state_digest():
    h = hashlib.sha256(np.asarray(x).tobytes())
    h.update(np.asarray(x[: 1 << 20] * 3 + 1).tobytes())
    return h.hexdigest()
assert state_digest() == state_digest()
print(jax.__version__, x.nbytes)
print(state_digest())
"""
CUPY = """
import hashlib, cupy as cp
x = cp.random.default_rng(0).standard_normal({n}, dtype=cp.float32)
def state_digest():
    # CuPy's float cumsum and sum are not bitwise repeatable: the bytes themselves.
    h = hashlib.sha256(x.get().tobytes())
    h.update((x[: 1 << 20] * 3 + 1).get().tobytes())
    return h.hexdigest()
assert state_digest() == state_digest()
print(cp.__version__, x.nbytes)
print(state_digest())
"""
# A CPU-only case: the benchmark itself, and the agent's cost on a machine without a GPU.
NUMPY = """
import hashlib, numpy as np
x = np.random.default_rng(0).standard_normal({n}, dtype=np.float32)
def state_digest():
    return hashlib.sha256(x.tobytes()).hexdigest()
print(np.__version__, x.nbytes)
print(state_digest())
"""
STATES = {"torch": TORCH, "jax": JAX, "cupy": CUPY, "numpy": NUMPY}
DIGEST_CELL = "print(state_digest())"
# After a restore, the next new CUDA process on some nodes fails its initialisation
# (NVRM assertions in the kernel log); a throwaway one absorbs it before the next case.
THROWAWAY_CUDA = """
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
ctx = ctypes.c_void_p()
rc = cuda.cuInit(0) or cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0)
print(rc)
raise SystemExit(rc)
"""


# -- what the user runs ---------------------------------------------------------------------
def ask_kernel(connection_file: str, code: str = DIGEST_CELL, timeout: float = 600) -> str:
    """What a cell prints in the kernel of ``connection_file``; raises on an error."""
    from jupyter_client.blocking import BlockingKernelClient
    from server_process import run_cell

    kc = BlockingKernelClient(connection_file=connection_file)
    kc.load_connection_file()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=timeout)
        return run_cell(kc, code, timeout)
    finally:
        kc.stop_channels()


def user_start_kernel(setup: str) -> None:
    """As the user: a kernel started through the agent, its state built; held until stdin
    closes (jupyter_client removes the connection file at exit)."""
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3-snapshot")
    t = time.monotonic()
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=300)
    kc.stop_channels()
    start_s = time.monotonic() - t
    t = time.monotonic()
    try:
        printed, error = ask_kernel(km.connection_file, setup, COMMAND_SECONDS), None
    except Exception as exc:  # said to the bench, which stops the kernel
        printed, error = "", f"{type(exc).__name__}: {exc}"
    print(json.dumps({
        "kernel_id": km.kernel_id, "root_pid": km.provisioner.root_pid,  # type: ignore
        "connection_file": km.connection_file, "start_s": start_s,
        "setup_s": time.monotonic() - t, "printed": printed, "error": error,
    }), flush=True)
    sys.stdin.read()


def user_call(op: str, args_json: str, connection_dir: str) -> None:
    """As the user: one agent call, timed around the call alone; after a restore, the
    restored kernel's digest (untimed)."""
    from jupyter_gpu_snapshot.agent_client.client import AgentClient
    from jupyter_gpu_snapshot.config import GPUSnapshot

    args = json.loads(args_json)
    client = AgentClient(GPUSnapshot().agent_socket)
    t = time.perf_counter()
    result = client.call_sync(op, args)
    seconds = time.perf_counter() - t
    out: dict[str, Any] = {"seconds": seconds}
    if op == "save":
        out.update(id=result["id"], timings=result["manifest"].get("timings"),
                   size_bytes=_size(result))
    elif op == "restore":
        out.update(pid=result["pid"], timings=result["timings"])
        path = Path(connection_dir) / f"restored-{result['pid']}.json"
        path.write_text(json.dumps(result["connection_info"]))
        t = time.monotonic()
        out["printed"] = ask_kernel(str(path))
        out["digest_s"] = time.monotonic() - t
    elif op == "delete":
        out["id"] = result["id"]
    print(json.dumps(out), flush=True)


def _size(fields: dict[str, Any]) -> int | None:
    from jupyter_gpu_snapshot.agent_client.protocol import snapshot_from

    with contextlib.suppress(Exception):
        return snapshot_from(fields).size_bytes
    return None


# -- the machine ----------------------------------------------------------------------------
def nvidia(query: str) -> str:
    if shutil.which("nvidia-smi") is None:
        return "no GPU"
    done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                          capture_output=True, text=True)
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 else done.stderr.strip()


def has_cap_sys_resource() -> bool:
    from jupyter_gpu_snapshot.agent.credentials.criu_runs_as import (
        CAP_SYS_RESOURCE,
        own_capabilities,
    )

    return bool(own_capabilities() >> CAP_SYS_RESOURCE & 1)


class BenchUser:
    """The Unix user, and the paths made traversable for them; undone by ``close``."""

    def __init__(self, name: str) -> None:
        self.created = False
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name],
                           check=True, capture_output=True)
            self.created = True
        entry = pwd.getpwnam(name)
        self.name, self.uid, self.gid = name, entry.pw_uid, entry.pw_gid
        self.home = Path(entry.pw_dir)
        self.groups = os.getgrouplist(name, self.gid)
        self.changed: dict[Path, int] = {}

    def open_paths(self) -> None:
        """o+x on every directory down to the checkout, the interpreter and the
        PYTHONPATH entries (the carried site-packages on the GPU machine); o+rx on the
        checkout and its benchmarks, which are on the user's sys.path."""
        targets = [REPO, REPO / "benchmarks", Path(sys.prefix),
                   Path(os.path.realpath(sys.executable)).parent, Path(sys.base_prefix)]
        targets += [Path(p) for p in os.environ.get("PYTHONPATH", "").split(":") if p]
        for target in targets:
            if not target.is_dir():
                continue
            for directory in [*reversed(target.parents), target]:
                mode = stat.S_IMODE(directory.stat().st_mode)
                wanted = mode | stat.S_IXOTH
                if directory in (REPO, REPO / "benchmarks"):
                    wanted |= stat.S_IROTH
                if wanted != mode and directory not in self.changed:
                    self.changed[directory] = mode
                    os.chmod(directory, wanted)

    def env(self, socket: Path) -> dict[str, str]:
        env = {
            "HOME": str(self.home), "USER": self.name, "LOGNAME": self.name,
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "JUPYTER_GPU_SNAPSHOT_AGENT_SOCKET": str(socket),
            "JUPYTER_PLATFORM_DIRS": "1", "PYTHONUNBUFFERED": "1",
        }
        # What the frameworks need, and the machine's settings for them (on the GPU
        # machine: NVLink multicast off, which must hold for every program).
        for key, value in os.environ.items():
            if key in ("PYTHONPATH", "LD_LIBRARY_PATH", "JUPYTER_PATH", "JUPYTER_CONFIG_PATH") \
                    or key.startswith(("CUDA_", "NCCL_", "NVSHMEM_", "TORCH_", "NVIDIA_", "XLA_")):
                env[key] = value
        return env

    def popen(self, argv: list[str], socket: Path, **kwargs: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(argv, user=self.uid, group=self.gid, extra_groups=self.groups,
                                env=self.env(socket), cwd=self.home, text=True, **kwargs)

    def run(self, argv: list[str], socket: Path) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(argv, user=self.uid, group=self.gid, extra_groups=self.groups,
                              env=self.env(socket), cwd=self.home, text=True,
                              capture_output=True, timeout=COMMAND_SECONDS)
        return done

    def kill_all(self) -> None:
        import psutil

        procs = [p for p in psutil.process_iter(["uids"])
                 if p.info["uids"] and self.uid in (p.info["uids"].real, p.info["uids"].effective)]
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(procs, timeout=30)

    def close(self) -> None:
        self.kill_all()
        for path, mode in self.changed.items():
            with contextlib.suppress(OSError):
                os.chmod(path, mode)
        if self.created:
            subprocess.run(["userdel", "-r", self.name], capture_output=True)


class Agent:
    """A real agent, root's, on a private socket and state."""

    def __init__(self, directory: Path) -> None:
        # The agent's state is root's; the user reaches only the socket and their logs.
        directory.mkdir(mode=0o711)
        os.chmod(directory, 0o711)
        self.socket = directory / "agent.sock"
        self.state_dir = directory / "state"
        self.run_dir = directory / "run"
        self.log_path = directory / "agent.log"
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [*CLI, "agent", "--socket", str(self.socket), "--state-dir",
                 str(self.state_dir), "--run-dir", str(self.run_dir)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while not self.socket.is_socket():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"the agent did not start:\n{self.log()[-3000:]}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_dir(self, uid: int) -> Path:
        return self.run_dir / "users" / str(uid) / "logs"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# -- one case -------------------------------------------------------------------------------
class Case:
    def __init__(self, name: str, setup: str, user: BenchUser, agent: Agent, base: Path,
                 loop: asyncio.AbstractEventLoop, direct_dump: str = "as-agent") -> None:
        from jupyter_gpu_snapshot.agent.credentials.criu_runs_as import dump_command
        from jupyter_gpu_snapshot.agent.credentials.ownership import Caller
        from jupyter_gpu_snapshot.agent.files.opener import CallerFiles
        from jupyter_gpu_snapshot.config import GPUSnapshot
        from jupyter_gpu_snapshot.core.criu import CriuLaunch
        from jupyter_gpu_snapshot.node.local_engine import EngineLaunch, make_engine

        self.name, self.setup, self.user, self.agent, self.loop = name, setup, user, agent, loop
        self.dir = base / name
        self.dir.mkdir(mode=0o700)
        # Where the user writes the restored kernels' connection files: theirs.
        self.user_dir = user.home / f"bench-agent-{name}"
        self.user_dir.mkdir(mode=0o700, exist_ok=True)
        os.chown(self.user_dir, user.uid, user.gid)
        # Root's direct engine: a store of its own, the user's log directory (the kernel
        # logs there), and criu as root, or as the agent runs it where root lacks
        # CAP_SYS_RESOURCE (criu's dump of another user's process needs it).
        settings = GPUSnapshot(store_dir=str(self.dir / "store"),
                               signing_key_file=str(self.dir / "signing.key"))
        log_dir = agent.log_dir(user.uid)
        self.direct_dump_as: list[str] = []
        caller = Caller(user.uid, user.gid, frozenset(user.groups), user.name)
        if not has_cap_sys_resource() and direct_dump == "as-agent":
            self.direct_dump_as = dump_command(caller)
        # The user's files (the kernel's log among them) opened as the user, as the
        # agent's engines open them.
        launch = EngineLaunch(CriuLaunch(dump_as=tuple(self.direct_dump_as)),
                              files=CallerFiles(caller))
        self.engine = make_engine(settings, kernel_log_dir=lambda: log_dir, launch=launch)
        self.holder: subprocess.Popen[str] | None = None
        self.result: dict[str, Any] = {}

    def user_call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        done = self.user.run([sys.executable, str(Path(__file__).resolve()), "--as-user-call",
                              op, json.dumps(args), str(self.user_dir)], self.agent.socket)
        if done.returncode != 0:
            raise RuntimeError(f"{op} through the agent ended {done.returncode}:\n"
                               f"{done.stderr[-3000:]}\n--- agent log ---\n"
                               f"{self.agent.log()[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    def start_kernel(self) -> dict[str, Any]:
        holder = self.user.popen(
            [sys.executable, str(Path(__file__).resolve()), "--as-user-kernel", self.setup],
            self.agent.socket, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)
        assert holder.stdout is not None and holder.stderr is not None
        line = holder.stdout.readline()
        if not line:
            holder.wait(timeout=60)
            raise RuntimeError(f"the kernel did not start:\n{holder.stderr.read()[-3000:]}"
                               f"\n--- agent log ---\n{self.agent.log()[-3000:]}")
        self.holder = holder
        found: dict[str, Any] = json.loads(line)
        if found["error"]:
            raise RuntimeError(f"the state was not built: {found['error']}")
        return found

    def stop_holder(self) -> None:
        if self.holder is not None:
            self.holder.kill()
            self.holder.communicate()
            self.holder = None

    # The two ways, each one operation.
    def save_direct(self, pid: int, name: str) -> dict[str, Any]:
        from jupyter_gpu_snapshot.core.hooks import SaveTarget

        t = time.perf_counter()
        snapshot = self.loop.run_until_complete(
            self.engine.save(SaveTarget(pid=pid), name=name, stop=False))
        seconds = time.perf_counter() - t
        return {"seconds": seconds, "id": snapshot.id, "size_bytes": snapshot.size_bytes,
                "timings": snapshot.manifest.get("timings")}

    def save_agent(self, pid: int, name: str) -> dict[str, Any]:
        return self.user_call("save", {"target": {"pid": pid}, "name": name, "stop": False})

    def restore_direct(self, ref: str) -> dict[str, Any]:
        t = time.perf_counter()
        restored = self.loop.run_until_complete(self.engine.restore(ref))
        seconds = time.perf_counter() - t
        path = self.dir / f"restored-{restored.pid}.json"
        path.write_text(json.dumps(restored.connection_info))
        t = time.monotonic()
        printed = ask_kernel(str(path))
        return {"seconds": seconds, "pid": restored.pid, "timings": restored.timings,
                "printed": printed, "digest_s": time.monotonic() - t}

    def restore_agent(self, ref: str) -> dict[str, Any]:
        return self.user_call("restore", {"ref": ref})

    def run(self, saves: int, restores: int, warmup: int = 0) -> dict[str, Any]:
        from jupyter_gpu_snapshot.core import procfs

        r = self.result
        found = self.start_kernel()
        root_pid = int(found["root_pid"])
        digest = found["printed"].split()[-1]
        r.update(kernel={"start_s": found["start_s"], "setup_s": found["setup_s"],
                         "printed": found["printed"].strip(), "digest": digest,
                         "root_pid": root_pid},
                 direct_dump_as=self.direct_dump_as)
        print(f"[{self.name}] kernel {root_pid} up ({found['setup_s']:.1f}s), digest "
              f"{digest[:16]}", flush=True)

        ids: dict[str, list[str]] = {"direct": [], "agent": []}
        runs: list[dict[str, Any]] = []
        warm: list[dict[str, Any]] = []
        # First the untimed warm-ups (criu's first run, the plugin, the page cache), then
        # the timed runs.
        for i, how in enumerate(abba(warmup) + abba(saves)):
            name = f"{self.name}-{how}-{i}"
            one = (self.save_direct if how == "direct" else self.save_agent)(root_pid, name)
            one["how"] = how
            ids[how].append(one["id"])
            (warm if i < 2 * warmup else runs).append(one)
            print(f"[{self.name}] save {how}{' (warm-up)' if i < 2 * warmup else ''}: "
                  f"{one['seconds']:.3f}s", flush=True)
        r["save"] = summarise(runs)
        r["save"]["warmup"] = warm
        # The live kernel is still the same after the saves.
        r["kernel"]["digest_after_saves"] = ask_kernel(found["connection_file"]).split()[-1] \
            if os.access(found["connection_file"], os.R_OK) else None

        procfs.kill_tree(root_pid)
        self.stop_holder()
        runs, warm = [], []
        for i, how in enumerate(abba(warmup, first="agent") + abba(restores, first="agent")):
            ref = ids[how][-1]
            one = (self.restore_direct if how == "direct" else self.restore_agent)(ref)
            one["how"] = how
            one["snapshot"] = ref
            one["digest"] = one.pop("printed").split()[-1]
            one["digest_equal"] = one["digest"] == digest
            procfs.kill_tree(int(one["pid"]))
            (warm if i < 2 * warmup else runs).append(one)
            print(f"[{self.name}] restore {how}{' (warm-up)' if i < 2 * warmup else ''}: "
                  f"{one['seconds']:.3f}s, digest "
                  f"{'equal' if one['digest_equal'] else 'DIFFERENT'}", flush=True)
        r["restore"] = summarise(runs)
        r["restore"]["warmup"] = warm
        # Every restore, the warm-ups too.
        r["restore"]["all_digests_equal"] = all(x["digest_equal"] for x in runs + warm)
        r["snapshot_bytes"] = next((x.get("size_bytes") for x in r["save"]["runs"]), None)
        return r

    def clean(self) -> None:
        """Deletes this case's snapshots from both stores; kills what is left."""
        self.stop_holder()
        with contextlib.suppress(Exception):
            saved = self.result.get("save", {})
            for one in saved.get("runs", []) + saved.get("warmup", []):
                if one["how"] == "direct":
                    self.engine.delete(one["id"])
                else:
                    self.user_call("delete", {"ref": one["id"]})
        self.user.kill_all()


def abba(n: int, first: str = "direct") -> list[str]:
    """``n`` of each way, in pairs that alternate which goes first: D A, A D, D A..."""
    other = "agent" if first == "direct" else "direct"
    order: list[str] = []
    for i in range(n):
        order += [first, other] if i % 2 == 0 else [other, first]
    return order


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"order": [x["how"] for x in runs], "runs": runs}
    for how in ("direct", "agent"):
        seconds = [x["seconds"] for x in runs if x["how"] == how]
        engine = [float(x["timings"]["total"]) for x in runs
                  if x["how"] == how and (x.get("timings") or {}).get("total") is not None]
        out[f"{how}_s"] = seconds
        out[f"{how}_median_s"] = statistics.median(seconds) if seconds else None
        out[f"{how}_engine_total_s"] = engine
        # What each call cost beyond the engine's own steps.
        outside = [x["seconds"] - float(x["timings"]["total"]) for x in runs
                   if x["how"] == how and (x.get("timings") or {}).get("total") is not None]
        out[f"{how}_outside_engine_median_s"] = statistics.median(outside) if outside else None
    if out["direct_median_s"] is not None and out["agent_median_s"] is not None:
        out["agent_extra_ms"] = (out["agent_median_s"] - out["direct_median_s"]) * 1e3
    if (out["direct_outside_engine_median_s"] is not None
            and out["agent_outside_engine_median_s"] is not None):
        out["agent_extra_outside_engine_ms"] = (
            out["agent_outside_engine_median_s"] - out["direct_outside_engine_median_s"]) * 1e3
    return out


def throwaway_cuda() -> dict[str, Any]:
    if shutil.which("nvidia-smi") is None:
        return {}
    done = subprocess.run([sys.executable, "-c", THROWAWAY_CUDA], capture_output=True,
                          text=True, timeout=120)
    return {"returncode": done.returncode, "output": (done.stdout + done.stderr)[-500:]}


def table(result: dict[str, Any]) -> str:
    lines = [f"{'case':8} {'op':8} {'direct s':>9} {'agent s':>9} {'extra ms':>9} "
             f"{'outside-engine extra ms':>24} digests"]
    for name, case in result["cases"].items():
        if "error" in case:
            lines.append(f"{name:8} error: {case['error'][:200]}")
            continue
        for op in ("save", "restore"):
            s = case.get(op)
            if not s:
                continue
            digests = "" if op == "save" else ("equal" if s["all_digests_equal"] else "DIFFER")
            outside = s.get("agent_extra_outside_engine_ms")
            lines.append(f"{name:8} {op:8} {s['direct_median_s']:9.3f} {s['agent_median_s']:9.3f}"
                         f" {s['agent_extra_ms']:9.1f} "
                         f"{'' if outside is None else f'{outside:.1f}':>24} {digests}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="torch,jax,cupy")
    parser.add_argument("--gib", type=float, default=1.0, help="each GPU case's state")
    parser.add_argument("--saves", type=int, default=3, help="of each way")
    parser.add_argument("--restores", type=int, default=3, help="of each way")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed saves and restores of each way first")
    parser.add_argument("--user", default=USER)
    parser.add_argument(
        "--direct-dump", choices=("as-agent", "plain-root"), default="as-agent",
        help="how root's direct save runs criu where root lacks CAP_SYS_RESOURCE: as the "
        "agent does (criu --unprivileged as the user), or as plain root")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--as-user-kernel", help=argparse.SUPPRESS)
    parser.add_argument("--as-user-call", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_user_kernel is not None:
        return user_start_kernel(args.as_user_kernel)
    if args.as_user_call is not None:
        return user_call(*args.as_user_call)
    if os.geteuid() != 0:
        raise SystemExit("run as root: it creates a user and runs the agent")

    from common import host_facts

    from jupyter_gpu_snapshot.launch.kernelspec import install

    install()
    base = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    os.chmod(base, 0o711)
    n = int(args.gib * GIB) // 4
    result: dict[str, Any] = {
        "benchmark": "agent",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": host_facts(),
        "gpu": nvidia("name,memory.total"),
        "driver": nvidia("driver_version"),
        "kernel": os.uname().release,
        "commit": os.environ.get("JGS_BENCH_COMMIT", ""),
        "commit_source": os.environ.get("JGS_BENCH_COMMIT_SOURCE", ""),
        "tree_note": os.environ.get("JGS_BENCH_TREE_NOTE", ""),
        "root_has_cap_sys_resource": has_cap_sys_resource(),
        "agent_dump_mode": ("plain root" if has_cap_sys_resource() else
                            "criu --unprivileged, as the user with root's other capabilities"),
        "direct_dump": args.direct_dump,
        "state_gib": args.gib,
        "warmup_each": args.warmup,
        "saves_each": args.saves,
        "restores_each": args.restores,
        "cases": {},
    }
    if not result["commit"]:
        done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                              capture_output=True, text=True)
        result["commit"] = done.stdout.strip()
        result["commit_source"] = "git rev-parse HEAD of the checkout it ran in"
    user = BenchUser(args.user)
    agent: Agent | None = None
    loop = asyncio.new_event_loop()
    try:
        user.open_paths()
        result["user"] = {"name": user.name, "uid": user.uid, "created": user.created,
                          "paths_opened": {str(p): f"{m:o}" for p, m in user.changed.items()}}
        agent = Agent(base / "agent")
        for name in args.cases.split(","):
            setup = STATES[name].format(n=n if name != "numpy" else GIB // 16)
            case = Case(name, setup, user, agent, base, loop, args.direct_dump)
            try:
                case.run(args.saves, args.restores, args.warmup)
                result["cases"][name] = case.result
            except Exception as exc:  # one case's failure is a result too
                case.result["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
                result["cases"][name] = case.result
            finally:
                case.clean()
                result["cases"][name]["throwaway_cuda_after"] = throwaway_cuda()
            if args.out:
                args.out.write_text(json.dumps(result, indent=1))
    finally:
        if agent is not None:
            agent.stop()
            result["agent_log_tail"] = agent.log()[-4000:]
        user.close()
        loop.close()
        subprocess.run(["rm", "-rf", str(base)], check=False)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text[-2000:])
    print(table(result))


if __name__ == "__main__":
    main()
