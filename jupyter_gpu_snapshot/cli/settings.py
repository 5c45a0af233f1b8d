"""What a command acts on: the ``c.GPUSnapshot`` settings with ``--store`` and ``--criu``
over them, and this node's snapshots through the engine those settings give this process
(its own as root, else the node agent's)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ..config import GPUSnapshot

if TYPE_CHECKING:
    from ..node.engine import NodeEngine
    from ..node.snapshots import NodeSnapshots


def settings(args: argparse.Namespace) -> GPUSnapshot:
    kwargs: dict[str, Any] = {}
    if args.store:
        kwargs["store_dir"] = args.store
    if args.criu:
        kwargs["criu_path"] = args.criu
    return GPUSnapshot(**kwargs)


def node_snapshots(args: argparse.Namespace) -> NodeSnapshots:
    # Not root: the node agent saves and restores for this user (docs/cluster.md).
    from ..node.snapshots import NodeSnapshots

    return NodeSnapshots.from_settings(settings(args))


def engine(args: argparse.Namespace) -> NodeEngine:
    return node_snapshots(args).engine
