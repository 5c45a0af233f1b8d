"""The fault suite's stopping-save rows with a PyTorch kernel on the GPU.

The saver (``testkit/fault_saver.py``, with the real CUDA hook) is SIGKILLed at each phase of
a ``stop`` save; recovery then runs as a server start runs it (waking CUDA too). Each row
checks that the kernel computes on the GPU with its weights intact, or that its recovered
snapshot restores them and training goes on.
"""

from __future__ import annotations

import pytest

from jupyter_gpu_snapshot.config import GPUSnapshot
from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.recovery import recover_store
from jupyter_gpu_snapshot.node.local_engine import make_engine, wake_kernel
from tests.core.test_faults import (
    FAULTS,
    assert_nothing_partial,
    kill_saver_at,
    tree_digest,
    wait_for_criu_to_finish,
)

from ..conftest import RestoredTrees, execute, run, start_kernel, stop_kernel
from .test_gpu_kernels import TRAINING

pytestmark = pytest.mark.gpu

STOP_FAULTS = [f for f in FAULTS if f.stop]
WEIGHTS = "print(repr(float(model[0].weight.detach().double().sum())))"


@pytest.mark.parametrize("fault", STOP_FAULTS, ids=[f.id for f in STOP_FAULTS])
def test_gpu_saver_killed(fault, store, tmp_path, restored: RestoredTrees, figures):
    engine = make_engine(GPUSnapshot(store_dir=str(store.root)))
    kernel = start_kernel()
    try:
        kernel.execute(TRAINING, timeout=300)
        kernel.execute("train(5)", timeout=300)
        weights = kernel.execute(WEIGHTS).strip()
        earlier = run(engine.save(SaveTarget(pid=kernel.root_pid), name="earlier"))
        before = tree_digest(earlier.path)

        died = kill_saver_at(store, kernel.kernel_pid, fault, tmp_path)
        assert died.returncode == -9, died.stderr
        wait_for_criu_to_finish(store)
        report = recover_store(store, wake=wake_kernel)

        assert report.kept == []
        assert_nothing_partial(store)
        assert tree_digest(earlier.path) == before
        later = [s for s in store.list() if s.id != earlier.id]
        assert len(later) == (1 if fault.snapshot_kept else 0)
        assert procfs.tree_alive(kernel.root_pid) == fault.kernel_lives
        if fault.kernel_lives:
            # CUDA is running again: the kernel trains on, its weights as they were.
            assert kernel.execute(WEIGHTS).strip() == weights
            kernel.execute("train(2)", timeout=300)
    finally:
        stop_kernel(kernel)
    figures[fault.id] = {"recovered": [s.id for s in report.committed],
                         "woken": report.woken}
    if fault.snapshot_kept:
        back = run(engine.restore(later[0]))
        client = restored.connect(back.connection_info, back.pid)
        assert execute(client, WEIGHTS).strip() == weights
        execute(client, "train(2)", timeout=300)
