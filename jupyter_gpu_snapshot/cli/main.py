"""``jupyter gpu-snapshot``: check the machine; save, list, restore and delete snapshots; list
a kernel's timeline and rewind it.

It works without a running server: ``save`` takes a kernel's pid or id, ``restore`` brings
a kernel back standalone and prints a connection file for ``jupyter console --existing``.

This module is the command table: each command's help, its arguments, and the function that
runs it. A command's module is imported only once it is chosen, and only the chosen
command's arguments are built, so that ``--help`` and ``list`` answer at once
(docs/performance.md).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

from .._constants import FALLBACK_MODES, KERNEL_NAME
from ..core.errors import SnapshotError
from .interrupts import Interrupted
from .output import warn


def parse_bytes(text: str) -> int:
    """``200G``, ``512M``, ``1T`` or plain bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _json_flag(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--json", action="store_true", help=help)


def _server_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="the Jupyter server's URL (default: every running server "
                   "of this user, from the Jupyter runtime directory)")
    p.add_argument("--token", help="the server's token, with --url")


def _snapshot_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("snapshot", help="snapshot name or id")


def _check(p: argparse.ArgumentParser) -> None:
    _json_flag(p, "print the checks as a JSON list instead of lines")


def _agent(p: argparse.ArgumentParser) -> None:
    # The agent's defaults live with the agent; only `agent` and a full table import them.
    from ..agent.server import (
        DEFAULT_MAX_CONNECTIONS,
        DEFAULT_REQUEST_TIMEOUT,
        DEFAULT_RUN_DIR,
        DEFAULT_STATE_DIR,
    )
    from ..agent_client.protocol import DEFAULT_SOCKET

    p.add_argument("--socket", default=str(DEFAULT_SOCKET), help="Unix socket to listen on")
    p.add_argument("--socket-mode", default="0666", type=lambda v: int(v, 8),
                   help="the socket's mode, octal (default 0666: every local user)")
    p.add_argument("--socket-group", help="the socket's group (with --socket-mode 0660)")
    p.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR),
                   help="where each user's store and signing key live (root's alone)")
    p.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR),
                   help="where each user's kernel logs live")
    p.add_argument("--max-operations", type=int, default=2,
                   help="saves and restores one user may have under way at once")
    p.add_argument("--disk-quota", default="0", type=parse_bytes,
                   help="bytes of snapshots per user before saves are refused (e.g. 200G; "
                   "0: none)")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="connections one user may hold open at once; more are refused "
                   f"(default {DEFAULT_MAX_CONNECTIONS})")
    p.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT,
                   help="seconds a client has to send its request once connected "
                   f"(default {DEFAULT_REQUEST_TIMEOUT:g})")
    p.add_argument("--pods", action="store_true",
                   help="serve users' pods from the node's namespaces (a Kubernetes DaemonSet "
                   "with hostPID): callers are told apart by pod, as the container runtime "
                   "reports it, and kernels are launched, saved and restored inside their "
                   "container (docs/cluster.md)")
    p.add_argument("--container-bundles", action="append", metavar="TEMPLATE",
                   help="with --pods: where the container runtime keeps each container's OCI "
                   "bundle, {id} for the container's id; repeatable (default: containerd's "
                   "and CRI-O's)")
    p.add_argument("--config", help="a Jupyter config file (Python) with the c.GPUSnapshot "
                   "settings for every user's saves and restores, e.g. "
                   "/etc/jupyter/jupyter_gpu_snapshot_agent_config.py; root runs it, so "
                   "only root may be able to change it")


def _kernelspec(p: argparse.ArgumentParser) -> None:
    ks = p.add_subparsers(dest="action", required=True)
    pi = ks.add_parser("install", help="install the 'Python 3 (snapshots)' kernelspec")
    where = pi.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for this user only")
    where.add_argument("--sys-prefix", dest="prefix", action="store_const", const=sys.prefix,
                       help="install into this Python environment (default)")
    where.add_argument("--prefix", help="install under this prefix")


def _list(p: argparse.ArgumentParser) -> None:
    p.add_argument("--notebook", help="only the snapshots of this notebook path")
    p.add_argument(
        "--latest", action="store_true",
        help="only the newest snapshot of each notebook (autosave, shutdown or user)",
    )
    _json_flag(p, "print the snapshots' summaries as a JSON list (with 'location': local, "
               "remote or both)")


def _du(p: argparse.ArgumentParser) -> None:
    _json_flag(p, "print the store's disk_bytes and chunks_bytes, and each snapshot's "
               "size_bytes, new_bytes, own_bytes, sole_page_bytes and frees_bytes, as JSON")


def _save(p: argparse.ArgumentParser) -> None:
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--pid", type=int, help="process id of the kernel")
    target.add_argument("--kernel-id", help="Jupyter kernel id (from the server's /api/kernels)")
    p.add_argument("--name", help="snapshot name (letters, digits, '.', '_', '-')")
    p.add_argument("--stop", action="store_true", help="end the kernel after the snapshot")
    p.add_argument("--portable", action="store_true",
                   help="also write a portable copy of the namespace (with --kernel-id), "
                   "for 'restore --fallback' where the image cannot come back")
    _json_flag(p, "print the new snapshot's summary as JSON (no progress bar)")


def _restore(p: argparse.ArgumentParser) -> None:
    _snapshot_argument(p)
    p.add_argument("--gpus", metavar="LIST",
                   help="GPUs of this node for the process's devices, cuda:0 first, by index "
                   "or UUID (e.g. 1,0); default: the same GPUs if they have room, else GPUs "
                   "of the same model with room")
    p.add_argument("--fallback", choices=FALLBACK_MODES,
                   help="do not restore the image: start a fresh kernel and load the "
                   "portable copy (portable), re-run the recorded cells (replay), or both")
    _json_flag(p, "print pid, kernel pid, connection file, timings and the GPU remap as JSON")


def _trust(p: argparse.ArgumentParser) -> None:
    p.add_argument("snapshot", help="snapshot id")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def _rm(p: argparse.ArgumentParser) -> None:
    # Where a snapshot lives, in the words of the listings (node/remotes.py).
    from ..node.remotes import BOTH, LOCAL, REMOTE

    _snapshot_argument(p)
    p.add_argument(
        "--where", choices=(LOCAL, REMOTE, BOTH), default=BOTH,
        help="which copies to delete when a remote store is set (default: both)",
    )


def _rename(p: argparse.ArgumentParser) -> None:
    _snapshot_argument(p)
    p.add_argument("name", help="the new name: 1-64 letters, digits, '.', '_' or '-'")


def _resume(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pid", type=int, required=True, help="process id of the kernel")
    p.add_argument("--force", action="store_true",
                   help="wake the process tree even if it is not a snapshot-ready kernel")


def _hibernation(p: argparse.ArgumentParser) -> None:
    _server_options(p)
    _json_flag(p, "print them as JSON")


def _hibernate(p: argparse.ArgumentParser) -> None:
    p.add_argument("kernel_id", help="the kernel's id (GET /api/kernels)")
    p.add_argument("--tier", choices=("gpu", "process"), default="process",
                   help="gpu: release its GPU and keep its process (wakes in seconds); "
                   "process: save it and end its process (frees host memory too)")
    _server_options(p)


def _wake(p: argparse.ArgumentParser) -> None:
    p.add_argument("kernel_id", help="the kernel's id (jupyter gpu-snapshot hibernation)")
    _server_options(p)


def _status(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pid", type=int, required=True, help="process id of the kernel")
    _json_flag(p, "print readiness, problems and connection file as JSON")


def _cell_count(text: str) -> int:
    count = int(text)
    if count < 1:
        raise argparse.ArgumentTypeError(f"there is no cell [{count}]: counts start at 1")
    return count


def _kernel_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("kernel", metavar="KERNEL",
                   help="the kernel's id (its connection file kernel-ID.json is in the "
                   "Jupyter runtime directory) or the path of its connection file")


def _timeline(p: argparse.ArgumentParser) -> None:
    _kernel_argument(p)
    _json_flag(p, "print the timeline as JSON, as GET kernels/{id}/timeline answers it")


def _rewind(p: argparse.ArgumentParser) -> None:
    _kernel_argument(p)
    p.add_argument("--before", type=_cell_count, required=True, metavar="N",
                   help="the execution count of the cell to go back to before (the N of "
                   "its [N]): the kernel becomes as it was before that cell ran")
    _json_flag(p, 'print {"report": ...} as JSON, as POST kernels/{id}/rewind answers it')


def _no_arguments(p: argparse.ArgumentParser) -> None:
    pass


class Command(NamedTuple):
    """One subcommand: its help, its arguments, and where the function that runs it lives
    (``module:function`` in this package, imported once the command is chosen)."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    runs: str


COMMANDS = (
    Command("check", "check criu, privileges, kernel features and the GPU driver", _check,
            "machine:cmd_check"),
    Command("agent", "run the node agent (as root): snapshots for users without root", _agent,
            "machine:cmd_agent"),
    Command("kernelspec", f"manage the {KERNEL_NAME} kernelspec", _kernelspec,
            "machine:cmd_kernelspec"),
    Command("list", "list snapshots", _list, "snapshots:cmd_list"),
    Command("du", "the local store's bytes on disk, and what deleting each snapshot frees",
            _du, "snapshots:cmd_du"),
    Command("save", "snapshot a running kernel", _save, "sequences:cmd_save"),
    Command("restore", "restore a snapshot as a standalone kernel (a remote-only one is "
            "downloaded first)", _restore, "sequences:cmd_restore"),
    Command("trust", "sign an unsigned snapshot with this node's key (after a warning)",
            _trust, "snapshots:cmd_trust"),
    Command("rm", "delete a snapshot (by id also when unsigned or damaged)", _rm,
            "snapshots:cmd_rm"),
    Command("upload", "upload a local snapshot to the remote store", _snapshot_argument,
            "snapshots:cmd_upload"),
    Command("download", "fetch a remote snapshot into the local store (checked as it "
            "streams)", _snapshot_argument, "snapshots:cmd_download"),
    Command("rename", "give a snapshot another name (its manifest is re-signed)", _rename,
            "snapshots:cmd_rename"),
    Command("resume", "wake a kernel that an interrupted save left stopped or with CUDA "
            "locked", _resume, "kernels:cmd_resume"),
    Command("recover", "commit complete images that killed saves left, and remove stale "
            "work (as a server start does)", _no_arguments, "snapshots:cmd_recover"),
    Command("hibernation", "list the hibernated kernels of the running servers",
            _hibernation, "servers:cmd_hibernation"),
    Command("hibernate", "hibernate a server's kernel (once its cell ends)", _hibernate,
            "servers:cmd_hibernate"),
    Command("wake", "wake a hibernated kernel of a server", _wake, "servers:cmd_wake"),
    Command("status", "say whether a kernel process is snapshot-ready", _status,
            "kernels:cmd_status"),
    Command("timeline", "list a kernel's timeline: a point after each cell, what it "
            "changed", _timeline, "timeline:cmd_timeline"),
    Command("rewind", "put a kernel back to how it was before one of its cells, and say "
            "what came back", _rewind, "timeline:cmd_rewind"),
)
_NAMED = {command.name: command for command in COMMANDS}
# The options before the command that take a value.
_GLOBAL_VALUES = ("--store", "--criu")


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``chosen``, only that command's arguments are built
    (the others keep their name and help): main's parser for the command it runs."""
    parser = argparse.ArgumentParser(
        prog="jupyter gpu-snapshot",
        description="Snapshot live Jupyter kernels (CUDA state included) and restore them.",
        # Exact option names only, so that chosen_command reads the command line as
        # argparse does.
        allow_abbrev=False,
    )
    parser.add_argument("--store", help="snapshot store directory (default: the configured one)")
    parser.add_argument("--criu", help="criu executable to use")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help)
        p.set_defaults(runs=command.runs)
        if chosen is None or chosen == command.name:
            command.arguments(p)
    return parser


def chosen_command(argv: Sequence[str]) -> str:
    """The command ``argv`` names: its first word that is not an option or an option's
    value; "" when it names none (``--help``, or a word argparse will refuse)."""
    words = iter(argv)
    for word in words:
        if word in _GLOBAL_VALUES:
            next(words, None)
        elif not word.startswith("-"):
            return word if word in _NAMED else ""
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(chosen_command(words)).parse_args(words)
    module, function = args.runs.split(":")
    run: Callable[[argparse.Namespace], int] = getattr(
        importlib.import_module(f"{__package__}.{module}"), function)
    try:
        return run(args)
    except SnapshotError as exc:
        warn(f"[red]error:[/] {exc.message}")
        return 2
    except (KeyboardInterrupt, Interrupted):
        warn("interrupted: stopped at a safe point and rolled back; the kernel keeps running")
        return 130
