"""Facts a kernel knows about its own process: which incarnation it is, which kernel slot of
the server it belongs to, its ports, and how much memory a snapshot of it would hold.

A kernel restored from a snapshot is the same process memory in a new process: its
environment names the kernel slot it was saved from until the server, having adopted it
into a new slot, updates ``os.environ`` there (``server/kernel_slots.py`` does,
with a silent execute request, so only once the cell running at the restore has finished).
``KernelIdentity`` notices the new incarnation (the start time changes; CRIU cannot keep
it) and takes the new kernel id from the environment once the server has set it.

Only the standard library is imported: this module is loaded into every snapshot-ready
kernel.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .._constants import ENV_KERNEL_ID


class IdentityUnknown(Exception):
    """A restored copy whose new kernel id the server has not yet written into it."""


def _read_small(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def incarnation() -> str:
    """A value that differs between a process and any restored copy of it.

    The boot id and the process's start time (clock ticks after boot): CRIU restores
    memory, pids and namespaces, not the kernel's record of when a process was created.
    The pid alone would not do: a restored copy has the same pid in its own namespace.
    """
    boot = _read_small("/proc/sys/kernel/random/boot_id").strip()
    stat = _read_small("/proc/self/stat")
    # Fields after the parenthesised command name; starttime is field 22 overall.
    fields = stat.rsplit(")", 1)[-1].split()
    start = fields[19] if len(fields) > 19 else ""
    return f"{boot}:{os.getpid()}:{start}"


# The incarnation in which the server last told this process its slot (``slot_told``). A
# kernel woken from hibernation is a restored copy that keeps its kernel id, so the id in
# the environment alone cannot say whether the server has told it yet.
_told_in: str | None = None


def slot_told() -> None:
    """Called by the server's message that tells a restored kernel its slot."""
    global _told_in
    _told_in = incarnation()


class KernelIdentity:
    """Which kernel slot of the server this process is, across restores.

    Recorded when the extension loads. In a restored copy (a new incarnation) the kernel id
    in the environment is trusted only once the server has replaced the recorded one.
    """

    def __init__(self, kernel_id: str) -> None:
        self.kernel_id = kernel_id
        self.incarnation = incarnation()
        # Set once this process has found out it is a restored copy of that kernel.
        self.restored_from_kernel: str | None = None

    def changed(self) -> bool:
        return incarnation() != self.incarnation

    def current(self, environ: Mapping[str, str] | None = None) -> str:
        env = os.environ if environ is None else environ
        told = env.get(ENV_KERNEL_ID, "").strip()
        if not self.changed():
            return self.kernel_id
        if told and told == self.kernel_id and _told_in == incarnation():
            self.incarnation = _told_in  # woken in its own slot, and told so
            return told
        if not told or told == self.kernel_id:
            raise IdentityUnknown(
                "this kernel was restored from a snapshot, and the server has not yet told "
                "it which kernel it is now"
            )
        self.restored_from_kernel = self.kernel_id
        self.kernel_id = told
        self.incarnation = incarnation()
        return told


_PORT_KEYS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


def own_ports() -> dict[str, int] | None:
    """The ports this kernel listens on, from the running ipykernel application."""
    try:
        from ipykernel.kernelapp import IPKernelApp
    except ImportError:
        return None
    if not IPKernelApp.initialized():
        return None
    app = IPKernelApp.instance()
    return {key: int(getattr(app, key, 0) or 0) for key in _PORT_KEYS}


def holds_ports_of(summary: Mapping[str, Any]) -> bool:
    """Whether this kernel listens on the ports a restore of ``summary`` would need.

    Every snapshot of a kernel, and every restore of one, listens on that kernel's ports,
    so a snapshot of this kernel's lineage cannot be restored while this kernel runs.
    """
    mine = own_ports()
    theirs = (summary.get("kernel") or {}).get("connection_info") or {}
    if not mine or not theirs:
        return False
    return any(mine[key] and mine[key] == int(theirs.get(key) or 0) for key in _PORT_KEYS)


def namespace_rss_bytes() -> int | None:
    """Resident memory of every process of this kernel's PID namespace, or None.

    That is what CRIU writes for the host side of a snapshot. A snapshot-ready kernel's
    namespace has a /proc of its own (its init mounts one), so /proc lists exactly the
    tree that is dumped. Elsewhere /proc is the host's, and the sum would mean nothing.
    """
    if "nsinit" not in _read_small("/proc/1/cmdline"):
        return None
    total = 0
    # Not core.procfs.status_fields, the reader of /proc/PID/status everywhere else: this
    # runs in the user's kernel, which imports the standard library only (kernel/'s contract).
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        for line in _read_small(f"/proc/{entry}/status").splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
                break
    return total
