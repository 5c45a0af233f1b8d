"""The credentials criu runs with when the node agent saves or restores a user's kernel.

- **Restore**: as root, but with only the caller's groups. CRIU restores each process's
  groups from the image only when the image lists some; otherwise the process keeps criu's
  own, and root's group would be handed to the user.
- **Dump**: as root where root may read any process's resource limits (CAP_SYS_RESOURCE,
  which criu's dump needs for another user's process). Some container sandboxes withhold
  that one capability from root; there criu dumps as the caller (their uids, gids and
  groups, as the kernel's limit check wants), keeping root's other capabilities as ambient
  ones, in criu's ``--unprivileged`` mode. A real uid other than the effective one is no
  way out: the nftables library criu probes with exits when they differ.
"""

from __future__ import annotations

import shutil

from ...core import procfs
from .ownership import Caller

CAP_SYS_RESOURCE = 24
# capability(7)'s names, by number, as setpriv takes them.
_CAPABILITY_NAMES = (
    "chown", "dac_override", "dac_read_search", "fowner", "fsetid", "kill", "setgid", "setuid",
    "setpcap", "linux_immutable", "net_bind_service", "net_broadcast", "net_admin", "net_raw",
    "ipc_lock", "ipc_owner", "sys_module", "sys_rawio", "sys_chroot", "sys_ptrace", "sys_pacct",
    "sys_admin", "sys_boot", "sys_nice", "sys_resource", "sys_time", "sys_tty_config", "mknod",
    "lease", "audit_write", "audit_control", "setfcap", "mac_override", "mac_admin", "syslog",
    "wake_alarm", "block_suspend", "audit_read", "perfmon", "bpf", "checkpoint_restore",
)


def own_capabilities() -> int:
    """This process's permitted capabilities, as a bit mask."""
    return int(procfs.status_fields().get("CapPrm", "0"), 16)


def _setpriv() -> str:
    return shutil.which("setpriv") or "setpriv"


def restore_command(caller: Caller) -> list[str]:
    groups = ",".join(str(g) for g in sorted(caller.groups | {caller.gid}))
    return [_setpriv(), f"--groups={groups}", "--"]


def dump_command(caller: Caller, capabilities: int | None = None) -> list[str]:
    """The prefix ``criu dump`` runs under for ``caller``'s kernel; empty: plain root."""
    capabilities = own_capabilities() if capabilities is None else capabilities
    if capabilities >> CAP_SYS_RESOURCE & 1:
        return []
    names = ",".join(
        f"+{name}" for bit, name in enumerate(_CAPABILITY_NAMES) if capabilities >> bit & 1)
    groups = ",".join(str(g) for g in sorted(caller.groups | {caller.gid}))
    return [
        _setpriv(), f"--reuid={caller.uid}", f"--regid={caller.gid}", f"--groups={groups}",
        f"--inh-caps={names}", f"--ambient-caps={names}", "--",
    ]
