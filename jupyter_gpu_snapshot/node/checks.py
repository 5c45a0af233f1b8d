"""What this machine needs for snapshots, checked one by one (``jupyter gpu-snapshot check``)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import GPUSnapshot
from ..core import procfs
from ..core.criu import MIN_VERSION, CriuRunner
from ..core.criu_build import describe_fill
from ..core.errors import SnapshotError
from ..core.store import SnapshotStore
from ..gpu.broker import PluginInstall
from ..gpu.driver import driver_status
from ..gpu.inventory import read_inventory
from .local_engine import make_engine

CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_CHECKPOINT_RESTORE = 40


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True
    fix: str = ""


def check_criu(criu: CriuRunner) -> list[Check]:
    fix = "run scripts/install-criu.sh (Debian) or install criu >= 4.2"
    try:
        version = criu.version()
    except SnapshotError as exc:
        return [Check("criu", False, exc.cause, fix=fix)]
    text = ".".join(map(str, version))
    if version[:2] < MIN_VERSION:
        return [Check("criu", False, f"criu {text} found, 4.2 or newer needed", fix=fix)]
    ok, output = criu.check_output()
    last = output.splitlines()[-1] if output else ""
    return [
        Check("criu", True, f"criu {text} at {criu.executable()}"),
        Check("criu check", ok, last or "no output", fix="" if ok else "see 'criu check' output"),
    ]


def check_criu_fill(criu: CriuRunner, plugin_dir: Path) -> Check:
    """Which criu this is: ours, filling restored memory on several CPUs, or stock, which
    works, slower. Never required: the product restores the same with either."""
    try:
        executable = Path(criu.executable())
    except SnapshotError as exc:
        return Check("criu fill", False, f"cannot check without criu: {exc.cause}",
                     required=False)
    fill = describe_fill(executable, plugin_dir)
    fix = "" if fill.fast else ("nothing is needed; for the fast fill, run "
                                "scripts/install-criu.sh (make criu) with a criu source our "
                                "patches fit (docs/criu.md)")
    return Check("criu fill", bool(fill.fast), fill.detail, required=False, fix=fix)


def check_privileges() -> Check:
    if os.geteuid() == 0:
        return Check("privileges", True, "running as root")
    caps = procfs.effective_capabilities()
    needed = {
        "CAP_CHECKPOINT_RESTORE": CAP_CHECKPOINT_RESTORE,
        "CAP_SYS_ADMIN": CAP_SYS_ADMIN,
        "CAP_SYS_PTRACE": CAP_SYS_PTRACE,
    }
    lacking = [name for name, bit in needed.items() if not caps & (1 << bit)]
    if lacking:
        return Check(
            "privileges", False, f"missing {', '.join(lacking)}",
            fix="run as root, or grant the capabilities to criu and the server",
        )
    return Check("privileges", True, "checkpoint capabilities present")


def check_pid_namespaces() -> Check:
    unshare = shutil.which("unshare")
    if not unshare:
        return Check("pid namespaces", False, "unshare not found", fix="install util-linux")
    out = subprocess.run(
        [unshare, "--pid", "--fork", "true"], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        return Check(
            "pid namespaces", False, out.stderr.strip() or "unshare --pid failed",
            fix="snapshot-ready kernels need 'unshare --pid' (root or CAP_SYS_ADMIN)",
        )
    return Check("pid namespaces", True, "unshare --pid works")


def check_kernel_features() -> Check:
    if not Path("/proc/sys/kernel/ns_last_pid").exists():
        return Check(
            "kernel", False, "no /proc/sys/kernel/ns_last_pid",
            fix="the Linux kernel needs CONFIG_CHECKPOINT_RESTORE",
        )
    return Check("kernel", True, f"Linux {os.uname().release} with CONFIG_CHECKPOINT_RESTORE")


def check_store(store: SnapshotStore) -> list[Check]:
    """The store is private all the way up, holds no links, and the signing key is usable."""
    fix = "snapshots are code that runs as this user: chown/chmod it, or set " \
        "c.GPUSnapshot.store_dir"
    try:
        problems = store.audit()
        if problems:
            return [Check("store", False, "; ".join(problems), fix=fix)]
        store.ensure()
        free = store.free_bytes()
    except SnapshotError as exc:
        return [Check("store", False, exc.cause, fix=fix)]
    except OSError as exc:
        return [Check(
            "store", False, f"{store.root}: {exc.strerror}", fix="set c.GPUSnapshot.store_dir"
        )]
    checks = [Check("store", True, f"{store.root} (0700, private up to /), "
                    f"{free / (1 << 30):.1f} GiB free")]
    try:
        key = store.key
        checks.append(Check("signing key", True, f"{key.path} (0600, key id {key.key_id})"))
    except SnapshotError as exc:
        checks.append(Check("signing key", False, exc.cause, fix=exc.hint or ""))
    return checks


def check_gpu() -> list[Check]:
    """The NVIDIA driver, its checkpoint API and the GPUs; optional, CPU kernels need none."""
    fix = "NVIDIA driver 570 or newer snapshots GPU kernels; CPU kernels need none"
    status = driver_status()
    if status.driver is None:
        return [Check("gpu driver", False, status.problem, required=False, fix=fix)]
    info = status.driver.info
    checks = [Check("gpu driver", True, f"driver {info.version or '?'} (CUDA "
                    f"{info.cuda_version // 1000}.{info.cuda_version % 1000 // 10}), checkpoint "
                    f"API via {info.backend}", required=False)]
    if not info.lock_timeout:
        checks.append(Check("gpu lock timeout", False, "this driver ignores lock timeouts: a "
                            "save waits for running GPU work to finish", required=False, fix=fix))
    inventory = read_inventory()
    if inventory is None:
        return [*checks, Check("gpus", False, "NVML and nvidia-smi cannot be read",
                               required=False)]
    for d in inventory.devices:
        note = ", MIG mode: not supported by the checkpoint API" if d.mig_enabled else ""
        checks.append(Check(f"gpu {d.index}", not d.mig_enabled, f"{d.name}, "
                            f"{d.memory_free / (1 << 30):.1f} of {d.memory_total / (1 << 30):.1f}"
                            f" GiB free{note}", required=False))
    if inventory.mps_active:
        checks.append(Check("gpu mps", False, "an MPS daemon runs; MPS clients cannot be "
                            "checkpointed", required=False))
    return checks


def check_cuda_plugin(criu: CriuRunner, plugin: PluginInstall) -> Check:
    """CRIU's CUDA plugin built for this criu, and the stand-in it calls (GPU kernels only)."""
    fix = "run scripts/install-criu.sh (make criu) to build it; CPU kernels need none"
    try:
        version = criu.require_version()
    except SnapshotError as exc:
        return Check("cuda plugin", False, f"cannot check without criu: {exc.cause}",
                     required=False, fix=fix)
    problem = plugin.problem(version)
    if problem is not None:
        return Check("cuda plugin", False, problem, required=False, fix=fix)
    return Check("cuda plugin", True, f"{plugin.plugin_dir / 'cuda_plugin.so'} (criu {version}),"
                 f" {plugin.shim_dir / 'cuda-checkpoint'}", required=False)


def run_checks(
    criu: CriuRunner,
    store: SnapshotStore,
    extra: list[Callable[[], list[Check]]] | None = None,
    plugin: PluginInstall | None = None,
) -> list[Check]:
    checks = [
        *check_criu(criu),
        *([check_criu_fill(criu, plugin.plugin_dir),
           check_cuda_plugin(criu, plugin)] if plugin is not None else []),
        check_privileges(),
        check_pid_namespaces(),
        check_kernel_features(),
        *check_store(store),
        *check_gpu(),
    ]
    for more in extra or []:
        checks.extend(more())
    return checks


def check_this_node(settings: GPUSnapshot) -> list[Check]:
    """What ``jupyter gpu-snapshot check`` reports for a process that runs criu itself: the
    engine's criu, store and CUDA plugin as ``settings`` make them."""
    engine = make_engine(settings)
    return run_checks(engine.criu, engine.store, plugin=PluginInstall(Path(settings.libdir)))
