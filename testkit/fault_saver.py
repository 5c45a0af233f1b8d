"""A saving process that SIGKILLs itself at a chosen phase of a save: the fault suite's victim.

Run as ``python -m testkit.fault_saver STORE PID PHASE [--stop] [--after-bytes N]``. It saves
like ``jupyter gpu-snapshot save`` (``make_engine`` with the settings' hooks, the GPU hook
included) and dies, with no chance to roll back, when the engine first reports PHASE with at
least N bytes done: the way a server dies under ``kill -9`` or a stop timeout. With
``--die-at POINT`` it dies at that point of the commit's work on the page packs instead
(``testkit/fault_points.py``; PHASE is then one the save never reports, such as "none").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

from jupyter_gpu_snapshot.config import GPUSnapshot
from jupyter_gpu_snapshot.core.hooks import Progress, SaveTarget
from jupyter_gpu_snapshot.node.local_engine import make_engine
from testkit import fault_points


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("pid", type=int)
    parser.add_argument("phase")
    parser.add_argument("--stop", action="store_true")
    parser.add_argument("--after-bytes", type=int, default=0)
    parser.add_argument("--name")
    parser.add_argument("--criu", default="criu")
    parser.add_argument("--die-at", choices=sorted(fault_points.POINTS))
    args = parser.parse_args()
    if args.die_at:
        fault_points.arm(args.die_at)
    engine = make_engine(GPUSnapshot(store_dir=args.store, criu_path=args.criu))

    def progress(p: Progress) -> None:
        if p.phase == args.phase and p.done >= args.after_bytes:
            os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(engine.save(SaveTarget(pid=args.pid), name=args.name, stop=args.stop,
                            progress=progress))
    raise SystemExit(f"the save finished without reaching phase {args.phase!r}")


if __name__ == "__main__":
    main()
