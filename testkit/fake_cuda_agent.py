"""A node agent whose users' engines have a CUDA hook over the scripted driver
(``testkit/fake_driver.py``), one 80 GiB GPU: a process of its own, for a test that watches
the agent and everything it starts from outside (``testkit/root_file_calls.py``).

Run as root: ``python -m testkit.fake_cuda_agent --socket S --state-dir D --run-dir R``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import Any

from jupyter_gpu_snapshot.agent import realms, server
from jupyter_gpu_snapshot.config import GPUSnapshot
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.gpu.hook import CudaCheckpointHook
from jupyter_gpu_snapshot.node.local_engine import default_hooks, make_engine
from testkit.fake_driver import FORCE_CUDA_PLUGIN, GIB, FakeCudaDriver, FakeGpus


def main() -> None:
    parser = argparse.ArgumentParser()
    for option in ("--socket", "--state-dir", "--run-dir"):
        parser.add_argument(option, required=True)
    args = parser.parse_args()
    driver = FakeCudaDriver()
    gpus = FakeGpus(driver)

    def engine_with_fake_cuda(settings: GPUSnapshot, **options: Any) -> SnapshotEngine:
        cuda = CudaCheckpointHook(driver=driver.status, inventory=gpus, lock_timeout=1.0,
                                  drop_caches=False, memory_available=lambda: 64 * GIB,
                                  criu_env=FORCE_CUDA_PLUGIN)
        return make_engine(settings, hooks=[*default_hooks(settings)[:-1], cuda], **options)

    realms.make_engine = engine_with_fake_cuda  # type: ignore[assignment]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    node = server.NodeAgent(socket_path=Path(args.socket), state_dir=Path(args.state_dir),
                            run_dir=Path(args.run_dir))
    asyncio.run(node.serve_forever())


if __name__ == "__main__":
    main()
