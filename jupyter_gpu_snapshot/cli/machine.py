"""The commands about this machine: what it lacks for snapshots (``check``), the
snapshot-ready kernelspec (``kernelspec install``) and the node agent (``agent``, as root)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from .._constants import KERNEL_NAME, format_bytes
from ..config import GPUSnapshot
from ..core.errors import InvalidRequest, SnapshotError
from .output import console, print_json, say, warn
from .settings import settings


def _agent_report(settings: GPUSnapshot) -> tuple[bool, list[str]]:
    """Whether the node agent answers this user, and what it allows them, in lines."""
    from ..agent_client.client import AgentClient

    client = AgentClient(settings.agent_socket)
    try:
        hello = client.call_sync("hello")
    except SnapshotError as exc:
        return False, [f"MISSING\tnode agent\t{exc.message}"]
    user, limits = hello["user"], hello["limits"]
    quota = limits["disk_quota_bytes"]
    return True, [
        f"ok\tnode agent\t{client.socket_path} answers (version {hello['agent_version']})",
        f"ok\tyou\t{user['name']} (uid {user['uid']}, gid {user['gid']}), as the kernel "
        "says of this process",
        f"ok\tyour store\t{hello['store']} (root's; only you can list, restore, rename or "
        "delete its snapshots)",
        f"ok\tyour kernel logs\t{hello['log_dir']}",
        f"ok\tyou may\t{', '.join(hello['operations'])}",
        f"ok\tlimits\t{limits['max_operations']} operations at once (saves, restores, GPU "
        "releases and wakes); disk "
        + (f"{format_bytes(limits['used_bytes'])} used of {format_bytes(quota)}" if quota
           else f"{format_bytes(limits['used_bytes'])} used, no quota"),
    ]


def cmd_check(args: argparse.Namespace) -> int:
    chosen = settings(args)
    if chosen.through_agent() or (os.geteuid() != 0 and chosen.use_agent != "never"):
        reachable, lines = _agent_report(chosen)
        if args.json:
            print_json({"agent": reachable, "lines": lines})
        else:
            for line in lines:
                say(line)
            if not reachable:
                say("Without root, snapshots need the node agent (docs/cluster.md).")
        return 0 if reachable else 1
    from ..node.checks import check_this_node

    checks = check_this_node(chosen)
    if args.json:
        print_json([c.__dict__ for c in checks])
    elif not console().is_terminal:
        for c in checks:
            mark = "ok" if c.ok else "MISSING" if c.required else "--"
            say(f"{mark}\t{c.name}\t{c.detail}" + (f" ({c.fix})" if c.fix else ""))
    else:
        from rich.table import Table

        table = Table(show_header=False, box=None)
        for c in checks:
            missing = "[red]MISSING[/]" if c.required else "[yellow]--[/]"
            mark = "[green]ok[/]" if c.ok else missing
            table.add_row(mark, c.name, c.detail + (f"  [dim]({c.fix})[/]" if c.fix else ""))
        console().print(table)
    failed = [c for c in checks if c.required and not c.ok]
    if failed and not args.json:
        names = ", ".join(c.name for c in failed)
        warn(f"[red]{len(failed)} requirement(s) missing:[/] {names}")
    return 1 if failed else 0


def cmd_kernelspec(args: argparse.Namespace) -> int:
    from ..launch.kernelspec import install

    dest = install(user=args.user, prefix=args.prefix)
    say(f"installed kernelspec {KERNEL_NAME} in {dest}")
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from traitlets.config import Config
    from traitlets.config.loader import ConfigFileNotFound, PyFileConfigLoader

    from ..agent.pods.identity import DEFAULT_BUNDLES
    from ..agent.server import NodeAgent
    from ..agent.server import run as serve_agent

    if os.geteuid() != 0:
        raise InvalidRequest("agent", "the node agent runs as root",
                             hint="start it with systemd or by hand as root (docs/cluster.md)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # The realms' settings are built from this config, not from the GPUSnapshot object:
    # --criu goes into it too.
    config = Config()
    if args.config:
        path = Path(args.config).absolute()
        try:
            config = PyFileConfigLoader(path.name, str(path.parent)).load_config()
        except ConfigFileNotFound as exc:
            raise InvalidRequest("agent", f"no config file {path}") from exc
    if args.criu:
        config.GPUSnapshot.criu_path = args.criu
    agent = NodeAgent(
        socket_path=Path(args.socket), state_dir=Path(args.state_dir),
        run_dir=Path(args.run_dir), socket_mode=args.socket_mode,
        socket_group=args.socket_group, max_operations=args.max_operations,
        disk_quota_bytes=args.disk_quota, settings=GPUSnapshot(config=config),
        max_connections=args.max_connections, request_timeout=args.request_timeout,
        pods=args.pods, container_bundles=tuple(args.container_bundles or DEFAULT_BUNDLES),
    )
    # Not asyncio.run: a step hung on a user's behalf must not hold the agent's stop.
    serve_agent(agent)
    return 0
