"""The commands over the store: list, du, rm, rename, trust, upload, download and recover.

Each reaches the snapshots through ``node.snapshots.NodeSnapshots``, local and remote alike.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from typing import TYPE_CHECKING

from .._constants import format_bytes, table
from ..core.hooks import Progress
from .output import ProgressBar, console, print_json, say, stderr_is_terminal, warn
from .settings import engine, node_snapshots

if TYPE_CHECKING:
    from ..core.store import Snapshot
    from ..node.snapshots import NodeSnapshots


def cmd_list(args: argparse.Namespace) -> int:
    node = node_snapshots(args)
    # --latest: what a restart offers back, the newest trusted snapshot of each notebook.
    summaries = node.summaries(node.remote_snapshots(), args.notebook, latest=args.latest)
    if args.json:
        print_json(summaries)
        return 0
    if not summaries:
        say("no snapshots")
        return 0
    rows = [["NAME", "ID", "CREATED", "REASON", "SIZE", "NEW", "NOTEBOOK", "LOCATION",
             "STATUS"]]
    for s in summaries:
        created = datetime.fromtimestamp(s["created"]).strftime("%Y-%m-%d %H:%M:%S")
        status = "ok" if s["status"] == "ok" else f"{s['status']}: {s['problem']}"
        rows.append([
            s["name"], s["id"], created, s["reason"], format_bytes(s["size_bytes"]),
            format_bytes(s["new_bytes"]), s["notebook_path"] or "-", s["location"], status,
        ])
    say(table(rows))
    return 0


def cmd_du(args: argparse.Namespace) -> int:
    """What the local store takes on disk, and what deleting each snapshot would free."""
    found = engine(args).store_usage()
    if args.json:
        print_json(found.to_dict())
        return 0
    rows = [["NAME", "ID", "SIZE", "NEW", "FREES"]]
    for s in found.snapshots:
        rows.append([s.name, s.id, format_bytes(s.size_bytes), format_bytes(s.new_bytes),
                     format_bytes(s.frees_bytes)])
    if len(rows) > 1:
        say(table(rows))
    say(f"{format_bytes(found.disk_bytes)} on disk in {found.path} "
        f"({format_bytes(found.chunks_bytes)} of it in page packs)")
    return 0


TRUST_WARNING = """Snapshot {id} is unsigned: this node did not write it, or wrote it before
snapshots were signed. Restoring a snapshot runs its memory and registers as the user that
restores it (root, for criu), so an altered snapshot runs whatever code was put into it.
Trust it only if you know where it came from and that nobody else could change it."""


def cmd_trust(args: argparse.Namespace) -> int:
    """Sign an unsigned snapshot with this node's key, after a warning."""
    node_engine = engine(args)
    snapshot = node_engine.get(args.snapshot)
    if snapshot.status != "unsigned":
        snapshot.require_trusted("trust")
        console().print(f"{snapshot.name} ({snapshot.id}) is signed by this node already")
        return 0
    console(stderr=True).print(TRUST_WARNING.format(id=snapshot.id), highlight=False)
    if not args.yes:
        if not sys.stdin.isatty():
            warn("[red]not trusted:[/] confirm with --yes when not on a terminal")
            return 1
        if input("Trust and sign it? [y/N] ").strip().lower() not in ("y", "yes"):
            warn("not trusted")
            return 1
    trusted = node_engine.trust(snapshot.id)
    console().print(f"trusted {trusted.name} ({trusted.id}): signed with this node's key")
    return 0


def fetch(node: NodeSnapshots, ref: str, bar: ProgressBar) -> Snapshot:
    """The local snapshot ``ref`` names; a remote-only one is downloaded into the store
    first, as the server does: judged by this node's signing key and checked against this
    node's host before anything of it is fetched, every digest checked while it streams.
    Raises NotFound when neither side has it."""
    found = node.find(ref)
    if found.local:
        return found.snapshot
    if found.snapshot.trusted:
        import asyncio

        asyncio.run(node.engine.check_compatibility(found.snapshot, bar, {}))
    bar(Progress("downloading", 0, found.snapshot.size_bytes))
    return node.download(
        found.snapshot, lambda done, total: bar(Progress("downloading", done, total)))


def cmd_download(args: argparse.Namespace) -> int:
    """Fetch a remote snapshot into the local store (what a restore of one does first)."""
    node = node_snapshots(args)
    node.require_remote("download")
    with ProgressBar(stderr_is_terminal()) as bar:
        snapshot = fetch(node, args.snapshot, bar)
    say(f"{snapshot.name} ({snapshot.id}) is in {node.engine.location}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    """Delete the local copy, the remote copy or both (--where)."""
    node = node_snapshots(args)
    deleted = node.delete(node.find(args.snapshot), args.where)
    if deleted.remote:
        say(f"deleted {deleted.snapshot.id} from {node.remote_url}")
    if deleted.local:
        say(f"deleted {deleted.snapshot.name} ({deleted.snapshot.id})")
    return 0


def cmd_upload(args: argparse.Namespace) -> int:
    """Upload a local snapshot to the remote store (what a save does by itself)."""
    node = node_snapshots(args)
    node.require_remote("upload")
    snapshot = node.engine.get(args.snapshot)
    with ProgressBar(stderr_is_terminal()) as bar:
        uploaded = node.upload(
            snapshot, lambda done, total: bar(Progress("uploading", done, total)))
    say(f"uploaded {snapshot.name} ({snapshot.id}) to {uploaded.url}")
    return 0


def cmd_rename(args: argparse.Namespace) -> int:
    """Rename the local snapshot, then its remote copy (its re-signed manifest goes up).

    A remote-only snapshot is refused: it is renamed where a copy is. A remote that fails
    leaves the local rename done and says that the remote copy keeps its old name (exit 1).
    """
    node = node_snapshots(args)
    found = node.find(args.snapshot)
    node.check_rename(found, args.name)
    snapshot, remote = node.rename(found, args.name)
    say(f"renamed {args.snapshot} to {snapshot.name} ({snapshot.id})")
    if remote is None or remote["status"] == "none":
        return 0
    if remote["status"] == "failed":
        warn(
            f"[yellow]warning:[/] {remote['error']['message']}. Run 'jupyter gpu-snapshot "
            f"rename {snapshot.id} {snapshot.name}' again once the remote store answers."
        )
        return 1
    say(f"renamed its copy in {node.remote_url}")
    return 0


def cmd_recover(args: argparse.Namespace) -> int:
    """What a server start does: commit complete images of killed saves, clean the rest."""
    report = engine(args).recover()
    if report is None:
        say("the node agent recovers its store itself, at its start")
        return 0
    for snapshot in report.committed:
        say(f"committed {snapshot.name} ({snapshot.id}), left by a save that was killed")
    for path, why in report.kept:
        console(stderr=True).print(
            f"kept {path}: {why}; look at it, then delete it by hand",
            highlight=False, soft_wrap=True,
        )
    removed = report.removed
    say(f"removed {len(removed)} stale working director{'y' if len(removed) == 1 else 'ies'}")
    return 1 if report.kept else 0
