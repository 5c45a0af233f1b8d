"""A node agent that SIGKILLs itself at a chosen moment of a save or a restore it serves: the
agent's part of the fault suite, the way systemd's restart, the OOM killer or a rolling
update of the DaemonSet ends it.

Run as ``python -m testkit.fault_agent MOMENT [--after-bytes N] -- AGENT-OPTIONS``; it serves
as ``jupyter gpu-snapshot agent AGENT-OPTIONS`` does, until:

- MOMENT is a phase a save or a restore reports (``preflight``, ``suspend``, ``dump``,
  ``resume``, ``commit``, ``restore``): the first report of it with at least N bytes done;
- MOMENT is a point of ``testkit/fault_points.py`` (``renamed``, ``pack-written``...): there.

The product's code carries no test hook: the engine's two sequences are wrapped, in this
process only, as ``fault_saver`` does for a saving process.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from jupyter_gpu_snapshot.cli.main import main as cli_main
from jupyter_gpu_snapshot.core import engine, restore, save
from jupyter_gpu_snapshot.core.hooks import Progress, ProgressCallback
from testkit import fault_points


def _dying(sequence: Callable[..., Awaitable[Any]], report_at: int, phase: str,
           after_bytes: int) -> Callable[..., Awaitable[Any]]:
    """``sequence`` (the engine's save or restore) whose progress callback, its argument
    ``report_at``, kills this process at the first report of ``phase`` with enough done."""
    @functools.wraps(sequence)
    async def wrapped(*args: Any) -> Any:
        report: ProgressCallback = args[report_at]

        def dying(p: Progress) -> None:
            report(p)
            if p.phase == phase and p.done >= after_bytes:
                os.kill(os.getpid(), signal.SIGKILL)

        return await sequence(*args[:report_at], dying, *args[report_at + 1:])
    return wrapped


def arm(moment: str, after_bytes: int) -> None:
    if moment in fault_points.POINTS:
        fault_points.arm(moment)
        return
    # save_kernel(engine, target, name, stop, report); restore_snapshot(engine, snapshot,
    # report, gpus): wrapped in their modules, whence the engine imports each when it runs
    # it, and in the engine's own module where it holds them from its import (as a release
    # before the lazy imports did), so that the kill comes in either.
    saving = _dying(save.save_kernel, 4, moment, after_bytes)
    restoring = _dying(restore.restore_snapshot, 2, moment, after_bytes)
    for module in (save, engine):
        if hasattr(module, "save_kernel"):
            module.save_kernel = saving  # type: ignore[attr-defined]
    for module in (restore, engine):
        if hasattr(module, "restore_snapshot"):
            module.restore_snapshot = restoring  # type: ignore[attr-defined]


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("moment")
    parser.add_argument("--after-bytes", type=int, default=0)
    args = parser.parse_args(argv[:split])
    arm(args.moment, args.after_bytes)
    raise SystemExit(cli_main(["agent", *argv[split + 1:]]))


if __name__ == "__main__":
    main()
