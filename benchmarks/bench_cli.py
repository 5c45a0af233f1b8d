"""How fast ``jupyter gpu-snapshot`` answers, what a restore through it adds to the engine's
own time, and what the magic's first call costs. Run as root.

1. A store of ``--snapshots`` real snapshots: one snapshot-ready CPU kernel holding numpy
   arrays, saved keep-running by the engine as notebook ``bench.ipynb``'s; the kernel
   stays up for ``status``.
2. Each command ``--repeats`` times as a person types it, through jupyter_core's launcher
   (``jupyter gpu-snapshot ...``): ``--help``, ``list``, ``list --json``, ``status --pid``
   of the live kernel, and ``check``. Each run's wall time (spawn to exit) and CPU time
   (user + system of the command and what it waited for), and, from one more run of
   ``python -X importtime -m jupyter_gpu_snapshot.cli``, the modules it imports.
3. The magic in a fresh kernel of ``bench.ipynb`` in a real Jupyter server whose store is
   the same one: ``%gpu_snapshot list`` twice, then ``!jupyter gpu-snapshot list`` twice,
   each cell timed by its client (``--magic-kernels`` fresh kernels, one after the other).
4. ``--restores`` restores of the newest snapshot through ``restore --json`` (the kernel is
   stopped first): wall time from the spawn to the exit, against the engine's own
   ``timings.total`` in the JSON; the difference is what the CLI adds. Each restored
   kernel is killed after it.
5. With ``--agent``: ``list`` as a user without root, through a real node agent
   (bench_agent.py's user and agent), with ``--snapshots`` snapshots in that user's store.
   On a machine shared with the agent tests, run it under ``flock /tmp/jgs-users.lock``.

``--compare TREE`` runs every command as often from another tree of the package (first on
PYTHONPATH; e.g. ``git archive BASE jupyter_gpu_snapshot | tar -x -C /tmp/before``),
alternating run by run, so that both trees meet the same load; the load average is recorded
around each group. Steps 1 and 3 use this checkout only.

    python benchmarks/bench_cli.py [--snapshots 10] [--repeats 10] [--restores 5]
        [--magic-kernels 3] [--compare TREE --compare-name NAME] [--agent] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import host_facts

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
JUPYTER = str(BIN / "jupyter")
THIS = "this checkout"
NOTEBOOK = "bench.ipynb"
_IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \| *(\S+)$", re.M)


def tree_env(tree: Path | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a run of ``tree`` (None: this checkout, as installed)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.pop("PYTHONPATH", None)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    env.update(extra or {})
    return env


def timed(argv: list[str], env: dict[str, str], cwd: Path, ok: tuple[int, ...] = (0,),
          **popen: Any) -> dict[str, Any]:
    """One run: wall seconds from the spawn to the exit, CPU seconds of the process and of
    the children it waited for, and its stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=600, **popen)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in ok:
        raise RuntimeError(f"{argv} ended {done.returncode}:\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 4), "cpu_s": round(cpu, 4), "stdout": done.stdout}


def package_of(tree: Path | None, cwd: Path) -> str:
    """Where a run of ``tree`` takes the package from."""
    return subprocess.run(
        [sys.executable, "-c", "import jupyter_gpu_snapshot as p; print(p.__file__)"],
        env=tree_env(tree), cwd=cwd, capture_output=True, text=True).stdout.strip()


def modules_imported(args: list[str], env: dict[str, str], cwd: Path) -> list[str]:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "jupyter_gpu_snapshot.cli",
                           *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    return sorted(set(_IMPORTED.findall(done.stderr)))


def figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    walls, cpus = [r["wall_s"] for r in runs], [r["cpu_s"] for r in runs]
    return {"wall_median_s": round(statistics.median(walls), 4), "wall_min_s": min(walls),
            "cpu_median_s": round(statistics.median(cpus), 4), "cpu_min_s": min(cpus),
            "wall_s": walls, "cpu_s": cpus}


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- 1. the store -----------------------------------------------------------------------------
def start_kernel() -> Any:
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3-snapshot")
    km.start_kernel()
    client = km.blocking_client()
    client.start_channels()
    client.wait_for_ready(timeout=300)
    client.execute_interactive(
        "import numpy as np\nstate = np.random.default_rng(0).standard_normal(1 << 22)",
        timeout=300)
    client.stop_channels()
    return km


def fill_store(settings: Any, kernel_pid: int, count: int) -> list[dict[str, Any]]:
    from jupyter_gpu_snapshot.core.hooks import SaveTarget
    from jupyter_gpu_snapshot.node.local_engine import make_engine

    engine = make_engine(settings)
    saved = []
    for i in range(count):
        t = time.perf_counter()
        target = SaveTarget(pid=kernel_pid, notebook_path=NOTEBOOK)
        snapshot = asyncio.run(engine.save(target, name=f"bench-cli-{i}"))
        saved.append({"id": snapshot.id, "name": snapshot.name, "seconds": round(
            time.perf_counter() - t, 3), "size_bytes": snapshot.size_bytes,
            "files": len(snapshot.manifest["files"])})
    return saved


# -- 2. the commands --------------------------------------------------------------------------
def commands(store: Path, kernel_pid: int) -> dict[str, tuple[list[str], tuple[int, ...]]]:
    """Each command's arguments, and the exit codes that mean it answered."""
    return {
        "--help": (["--help"], (0,)),
        "list": (["--store", str(store), "list"], (0,)),
        "list --json": (["--store", str(store), "list", "--json"], (0,)),
        "status": (["status", "--pid", str(kernel_pid)], (0,)),
        # check says 1 where something optional of the machine is missing (a GPU).
        "check": (["check"], (0, 1)),
    }


def bench_commands(trees: dict[str, Path | None], store: Path, kernel_pid: int,
                   repeats: int, extra_env: dict[str, str], cwd: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (args, ok) in commands(store, kernel_pid).items():
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
        load_before = load()
        # One untimed run of each tree first: its bytecode, the page cache.
        for i in range(repeats + 1):
            for label, tree in trees.items():
                one = timed([JUPYTER, "gpu-snapshot", *args], tree_env(tree, extra_env), cwd, ok)
                one.pop("stdout")
                if i:
                    runs[label].append(one)
        out[name] = {"load_before": load_before, "load_after": load()}
        for label, tree in trees.items():
            out[name][label] = {
                **figures(runs[label]),
                "modules": len(modules_imported(args, tree_env(tree, extra_env), cwd)),
            }
        print(f"{name:12} " + "  ".join(
            f"{label}: wall {out[name][label]['wall_median_s']:.3f} s, cpu "
            f"{out[name][label]['cpu_median_s']:.3f} s, {out[name][label]['modules']} modules"
            for label in trees), flush=True)
    return out


# -- 3. the magic -----------------------------------------------------------------------------
def bench_magic(store: Path, key_file: Path, kernels: int, base: Path) -> dict[str, Any]:
    from server_process import Server, connect, run_cell

    from jupyter_gpu_snapshot._constants import KERNEL_NAME

    server = Server(base / "server", {"store_dir": str(store),
                                      "signing_key_file": str(key_file)}, "magic")
    # The server keeps JUPYTER_* variables from its kernels: the key is named again.
    cli = (f"!JUPYTER_GPU_SNAPSHOT_SIGNING_KEY_FILE={key_file} {JUPYTER} gpu-snapshot "
           f"--store {store} list")
    runs: list[dict[str, float]] = []
    first_imports: list[str] = []
    try:
        # The last kernel only says what the magic's first call imports: its first cell
        # notes the modules, so its timings are not a first cell's.
        for i in range(kernels + 1):
            session = server.request("POST", "api/sessions", {
                "path": NOTEBOOK, "name": NOTEBOOK, "type": "notebook",
                "kernel": {"name": KERNEL_NAME}})
            client = connect(server.connection_info(session["kernel"]["id"]))
            try:
                if i == kernels:
                    run_cell(client, "import sys\nbefore_magic = set(sys.modules)", 300)
                    run_cell(client, "%gpu_snapshot list", 300)
                    first_imports = run_cell(
                        client, "print(*sorted(set(sys.modules) - before_magic))", 300).split()
                    continue
                one: dict[str, float] = {}
                for label, code in (("magic_first", "%gpu_snapshot list"),
                                    ("magic_second", "%gpu_snapshot list"),
                                    ("cli_first", cli), ("cli_second", cli)):
                    t = time.perf_counter()
                    printed = run_cell(client, code, 300)
                    one[label] = round(time.perf_counter() - t, 4)
                    if "bench-cli-0" not in printed:
                        raise RuntimeError(f"{code!r} did not list the snapshots:\n{printed}")
                runs.append(one)
            finally:
                client.stop_channels()
                server.request("DELETE", f"api/sessions/{session['id']}")
    finally:
        server.stop()
    out: dict[str, Any] = {"runs": runs, "magic_first_call_imports": first_imports}
    for label in ("magic_first", "magic_second", "cli_first", "cli_second"):
        out[f"{label}_median_s"] = round(statistics.median(r[label] for r in runs), 4)
    print(f"magic        first {out['magic_first_median_s']:.3f} s, second "
          f"{out['magic_second_median_s']:.3f} s; !jupyter gpu-snapshot list "
          f"{out['cli_first_median_s']:.3f} / {out['cli_second_median_s']:.3f} s", flush=True)
    return out


# -- 4. restores ------------------------------------------------------------------------------
def bench_restores(trees: dict[str, Path | None], settings: Any, ref: str, count: int,
                   extra_env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """CLI restores of each tree, alternating with the engine's own restore in this
    process, whose modules are imported already (as in a server, or the GPU benchmarks)."""
    from jupyter_gpu_snapshot.core import procfs
    from jupyter_gpu_snapshot.node.local_engine import make_engine

    engine = make_engine(settings)
    store = Path(settings.store_dir)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    warm: list[dict[str, Any]] = []
    load_before = load()
    # One untimed restore of each way first: criu's first run, the page cache, bytecode.
    for i in range(count + 1):
        t = time.perf_counter()
        restored_here = asyncio.run(engine.restore(ref))
        wall = time.perf_counter() - t
        procfs.kill_tree(restored_here.pid)
        if i:
            warm.append({"wall_s": round(wall, 4),
                         "engine_total_s": round(float(restored_here.timings["total"]), 4),
                         "timings": restored_here.timings})
        for label, tree in trees.items():
            one = timed([JUPYTER, "gpu-snapshot", "--store", str(store), "restore", ref,
                         "--json"], tree_env(tree, extra_env), cwd)
            restored = json.loads(one.pop("stdout"))
            procfs.kill_tree(int(restored["pid"]))
            total = float(restored["timings"]["total"])
            if i:
                runs[label].append({**one, "engine_total_s": round(total, 4),
                                    "outside_engine_s": round(one["wall_s"] - total, 4),
                                    "timings": restored["timings"]})
    in_process = statistics.median(r["wall_s"] for r in warm)
    out: dict[str, Any] = {
        "snapshot": ref, "load_before": load_before, "load_after": load(),
        "engine_in_process": {
            "wall_median_s": round(in_process, 4),
            "preflight_median_s": round(statistics.median(
                r["timings"]["preflight"] for r in warm), 4),
            "runs": warm},
    }
    for label in trees:
        outside = [r["outside_engine_s"] for r in runs[label]]
        out[label] = {
            **figures(runs[label]),
            "engine_total_median_s": round(statistics.median(
                r["engine_total_s"] for r in runs[label]), 4),
            # What the command adds: beyond the engine's own total in its JSON, and beyond
            # the engine's restore in a process that imported everything already.
            "outside_engine_median_s": round(statistics.median(outside), 4),
            "over_engine_in_process_median_s": round(
                statistics.median(r["wall_s"] for r in runs[label]) - in_process, 4),
            "preflight_median_s": round(statistics.median(
                r["timings"]["preflight"] for r in runs[label]), 4),
            "imports": restore_imports(tree_env(trees[label], extra_env), store, ref, cwd),
            "runs": runs[label],
        }
    print(f"restore      engine in this process {in_process:.3f} s  " + "  ".join(
        f"{label}: wall {out[label]['wall_median_s']:.3f} s, its JSON's engine total "
        f"{out[label]['engine_total_median_s']:.3f} s" for label in trees), flush=True)
    return out


def restore_imports(env: dict[str, str], store: Path, ref: str, cwd: Path) -> dict[str, Any]:
    """One more restore through the CLI under ``-X importtime``: the seconds its imports
    took in all (inflated by the measurement itself) and the heaviest packages."""
    from jupyter_gpu_snapshot.core import procfs

    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "jupyter_gpu_snapshot.cli",
                           "--store", str(store), "restore", ref, "--json"],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    procfs.kill_tree(int(json.loads(done.stdout)["pid"]))
    total, packages = 0, dict[str, int]()
    for line in done.stderr.splitlines():
        found = re.match(r"^import time:\s+(\d+) \|\s+(\d+) \| ( *)(\S+)$", line)
        if not found:
            continue
        own, name = int(found[1]), found[4]
        total += own
        top = ".".join(name.split(".")[:2]) if name.startswith("jupyter_gpu_snapshot") \
            else name.split(".")[0]
        packages[top] = packages.get(top, 0) + own
    heaviest = sorted(packages.items(), key=lambda kv: -kv[1])[:8]
    return {"seconds": round(total / 1e6, 3),
            "heaviest_s": {name: round(us / 1e6, 3) for name, us in heaviest}}


# -- 5. through the node agent ----------------------------------------------------------------
def bench_agent_list(trees: dict[str, Path | None], snapshots: int, repeats: int,
                     base: Path) -> dict[str, Any]:
    from bench_agent import USER, Agent, BenchUser

    user = BenchUser(USER)
    agent: Agent | None = None
    holder: subprocess.Popen[str] | None = None
    try:
        user.open_paths()
        for tree in trees.values():
            if tree is not None:
                _traversable(user, tree)
        agent = Agent(base / "agent")
        holder = user.popen([sys.executable, str(REPO / "benchmarks" / "bench_agent.py"),
                             "--as-user-kernel", "x = list(range(1 << 16))\nprint('up')"],
                            agent.socket, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
        assert holder.stdout is not None
        line = holder.stdout.readline()
        if not line:
            raise RuntimeError(f"the user's kernel did not start:\n{agent.log()[-3000:]}")
        kernel = json.loads(line)
        from jupyter_gpu_snapshot.core import procfs

        pid = procfs.inspect_kernel(int(kernel["root_pid"])).kernel_pid
        for i in range(snapshots):
            done = user.run([JUPYTER, "gpu-snapshot", "save", "--pid", str(pid), "--name",
                             f"bench-cli-agent-{i}", "--json"], agent.socket)
            if done.returncode != 0:
                raise RuntimeError(f"a save through the agent failed:\n{done.stderr[-3000:]}")
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
        load_before = load()
        for _ in range(repeats):
            for label, tree in trees.items():
                env = {**user.env(agent.socket), **({"PYTHONPATH": str(tree)} if tree else {})}
                one = timed([JUPYTER, "gpu-snapshot", "list"], env, user.home, user=user.uid,
                            group=user.gid, extra_groups=user.groups)
                if one.pop("stdout").count("bench-cli-agent-") != snapshots:
                    raise RuntimeError("the listing through the agent missed snapshots")
                runs[label].append(one)
        out: dict[str, Any] = {"load_before": load_before, "load_after": load()}
        for label in trees:
            out[label] = figures(runs[label])
        print("agent list   " + "  ".join(
            f"{label}: wall {out[label]['wall_median_s']:.3f} s, cpu "
            f"{out[label]['cpu_median_s']:.3f} s" for label in trees), flush=True)
        return out
    finally:
        if holder is not None:
            holder.kill()
            holder.communicate()
        if agent is not None:
            agent.stop()
        user.close()


def _traversable(user: Any, tree: Path) -> None:
    """o+x on every directory down to ``tree`` (put back by ``user.close``)."""
    import stat

    for directory in [*reversed(tree.parents), tree]:
        mode = stat.S_IMODE(directory.stat().st_mode)
        if not mode & stat.S_IXOTH and directory not in user.changed:
            user.changed[directory] = mode
            os.chmod(directory, mode | stat.S_IXOTH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--snapshots", type=int, default=10, help="in the listed store")
    parser.add_argument("--repeats", type=int, default=10, help="runs of each command")
    parser.add_argument("--restores", type=int, default=5, help="restores of each tree")
    parser.add_argument("--magic-kernels", type=int, default=3,
                        help="fresh kernels whose first %%gpu_snapshot list is timed")
    parser.add_argument("--compare", type=Path, default=None,
                        help="another tree of the package, each command run as often from it")
    parser.add_argument("--compare-name", default="compared",
                        help="what the results call the --compare tree (e.g. its commit)")
    parser.add_argument("--agent", action="store_true",
                        help="also list as a user without root, through a node agent")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the saves and restores run criu")

    from jupyter_gpu_snapshot.config import GPUSnapshot
    from jupyter_gpu_snapshot.core import procfs
    from jupyter_gpu_snapshot.launch.kernelspec import install

    install()
    trees: dict[str, Path | None] = {THIS: None}
    if args.compare is not None:
        trees[args.compare_name] = args.compare.resolve()
    base = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    os.chmod(base, 0o711)
    # The server's runtime directory for everything: the kernels' logs, which its manifest
    # check wants in its own, and the connection files.
    os.environ["JUPYTER_RUNTIME_DIR"] = str(base / "server" / "runtime")
    cwd = base / "cwd"  # neither checkout: its package must not shadow the tree's
    cwd.mkdir()
    store, key_file = base / "store", base / "signing.key"
    extra_env = {"JUPYTER_GPU_SNAPSHOT_SIGNING_KEY_FILE": str(key_file),
                 "JUPYTER_GPU_SNAPSHOT_USE_AGENT": "never"}
    result: dict[str, Any] = {
        "benchmark": "cli",
        "machine": host_facts(),
        "commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                 capture_output=True, text=True).stdout.strip(),
        "trees": list(trees),
        "repeats": args.repeats,
    }
    for label, tree in trees.items():
        found = package_of(tree, cwd)
        if tree is not None and not found.startswith(str(tree)):
            raise SystemExit(f"{label}: the package came from {found}, not from the tree")
    km = start_kernel()
    try:
        root_pid = km.provisioner.root_pid
        kernel_pid = procfs.inspect_kernel(root_pid).kernel_pid
        settings = GPUSnapshot(store_dir=str(store), signing_key_file=str(key_file))
        result["snapshots"] = fill_store(settings, kernel_pid, args.snapshots)
        print(f"store        {args.snapshots} snapshots of "
              f"{result['snapshots'][-1]['size_bytes'] / 2**20:.0f} MiB, "
              f"{result['snapshots'][-1]['files']} files each", flush=True)
        result["commands"] = bench_commands(trees, store, kernel_pid, args.repeats, extra_env,
                                            cwd)
        if args.magic_kernels:
            result["magic"] = bench_magic(store, key_file, args.magic_kernels, base)
    finally:
        km.shutdown_kernel(now=True)
        with contextlib.suppress(Exception):
            procfs.kill_tree(root_pid)
    if args.restores:
        result["restore"] = bench_restores(trees, settings, result["snapshots"][-1]["name"],
                                           args.restores, extra_env, cwd)
    if args.agent:
        result["agent"] = bench_agent_list(trees, args.snapshots, args.repeats, base)
    subprocess.run(["rm", "-rf", str(base)], check=False)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
