"""The GPU layer's sequencing, rollback and refusals, with real kernels and real CRIU.

Only the CUDA driver is a stand-in here (``testkit/fake_driver.py``): on a machine without
a GPU it plays the driver's state machine and fails any step on request. Each scenario then
checks what the real kernel process is left with: alive, answering, its (fake) CUDA state
running, nothing partial in the store, earlier snapshots intact. The same scenarios run for
real on a GPU in ``tests/gpu``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.compatibility import NodeCompatibility
from jupyter_gpu_snapshot.core.criu import CriuRunner
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.errors import Incompatible, InvalidRequest, NotReady, SnapshotError
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.gpu import hook as gpu_hook
from jupyter_gpu_snapshot.gpu.driver import (
    CUDA_ERROR_NOT_READY,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_ERROR_UNKNOWN,
    CudaError,
    DriverStatus,
    ProcessState,
)
from jupyter_gpu_snapshot.gpu.hook import CudaCheckpointHook
from testkit.criu_wrappers import (
    dies_after_the_dump_completed,
    fails_writing_pages,
    install,
    kill_while_writing_pages,
)
from testkit.fake_driver import (
    FORCE_CUDA_PLUGIN,
    GIB,
    RESTORE_THREAD_CODE,
    FakeCudaDriver,
    FakeGpus,
    fake_cuda_env,
)
from tests.conftest import (
    KernelHandle,
    RestoredTrees,
    execute,
    reply_to,
    run,
    start_kernel,
    stop_kernel,
    wait_for_output,
)

TWO_GIB = 2 * GIB


@pytest.fixture
def fake() -> FakeCudaDriver:
    return FakeCudaDriver()


@pytest.fixture
def gpus(fake: FakeCudaDriver) -> FakeGpus:
    return FakeGpus(fake)


@pytest.fixture
def gpu_kernel() -> Iterator[KernelHandle]:
    """A real snapshot-ready kernel that the fake driver sees holding 2 GiB on the GPU."""
    handle = start_kernel(env=fake_cuda_env(TWO_GIB))
    handle.execute("import numpy as np; counter = 0; data = np.arange(5_000_000)")
    handle.execute(RESTORE_THREAD_CODE)
    try:
        yield handle
    finally:
        stop_kernel(handle)


def make_engine(store: SnapshotStore, fake: FakeCudaDriver, gpus: FakeGpus,
                criu: CriuRunner | None = None, **hook: Any) -> SnapshotEngine:
    settings: dict[str, Any] = {"lock_timeout": 0.5, "memory_available": lambda: 64 * GIB,
                                "criu_env": FORCE_CUDA_PLUGIN}
    settings.update(hook)
    cuda = CudaCheckpointHook(driver=fake.status, inventory=gpus, **settings)
    return SnapshotEngine(store, criu, [cuda], NodeCompatibility(gpus=cuda.node_gpus))


def target(kernel: KernelHandle) -> SaveTarget:
    return SaveTarget(pid=kernel.root_pid, connection_info=kernel.km.get_connection_info())


def assert_contract(kernel: KernelHandle, fake: FakeCudaDriver, store: SnapshotStore,
                    listed_before: list[str]) -> None:
    """The failure contract, as the real process and the (fake) driver see it."""
    assert procfs.tree_alive(kernel.root_pid)
    assert kernel.execute("counter += 1; print(counter, int(data.sum()))").split()[1] == str(
        sum(range(5_000_000)))
    assert fake.states[kernel.kernel_pid] == ProcessState.RUNNING
    assert [s.id for s in store.list()] == listed_before
    store.ensure()
    assert not any(p.name.startswith(".partial-") for p in store.root.iterdir())
    for snapshot in store.list():
        store.verify(snapshot)


def criu_wrapper(tmp_path: Path, body: str) -> CriuRunner:
    return CriuRunner(install(tmp_path, body))


# -- the happy paths ----------------------------------------------------------------------------
def test_keep_running_save_suspends_then_resumes_cuda(store, fake, gpus, gpu_kernel):
    engine = make_engine(store, fake, gpus)
    snapshot = run(engine.save(target(gpu_kernel), name="kept"))
    pid = gpu_kernel.kernel_pid
    assert fake.ops(pid) == ["lock", "checkpoint", "restore", "unlock"]
    # nsinit, the namespace's PID 1, holds no CUDA state and is never touched.
    assert fake.ops(gpu_kernel.root_pid) == []
    gpu = snapshot.manifest["gpu"]
    assert gpu["driver_version"] == "580.159.04"
    assert gpu["devices"][0]["name"] == "NVIDIA Fake H100 80GB HBM3"
    assert gpu["processes"] == [{"pid": pid, "ns_pid": procfs.ns_pid(pid), "gpu_bytes": TWO_GIB,
                                 "devices": {gpus.devices[0][1]: TWO_GIB},
                                 "visible": [gpus.devices[0][1]]}]
    assert gpu["visible"] == [gpus.devices[0][1]]
    assert gpu["moved_bytes"] == TWO_GIB
    assert set(gpu["timings"]) == {"lock", "checkpoint", "restore", "unlock"}
    assert gpu["protocol"] == "criu-cuda-plugin"
    # criu held every other thread of the kernel from the checkpoint to the unlock.
    assert fake.protocol_breaches() == []
    assert [s.id for s in store.list()] == [snapshot.id]
    assert_contract(gpu_kernel, fake, store, [snapshot.id])


def test_stop_save_then_restore_resumes_cuda_in_the_restored_process(
        store, fake, gpus, gpu_kernel, restored: RestoredTrees):
    engine = make_engine(store, fake, gpus)
    gpu_kernel.execute("marker = 'before the snapshot'")
    old_pid = gpu_kernel.kernel_pid
    old_ns_pid = procfs.ns_pid(old_pid)
    snapshot = run(engine.save(target(gpu_kernel), name="stopped", stop=True))
    assert fake.ops(old_pid) == ["lock", "checkpoint"]  # the image holds it checkpointed
    assert not procfs.tree_alive(gpu_kernel.root_pid)
    gpu_kernel.client.stop_channels()

    back = run(engine.restore(snapshot.id))
    client = restored.connect(back.connection_info, back.pid)
    new_pid = back.kernel_pid
    assert new_pid != old_pid
    assert fake.ops(new_pid) == ["restore", "unlock"]
    assert fake.states[new_pid] == ProcessState.RUNNING
    assert fake.protocol_breaches() == []
    # Same pid inside its namespace, same variables.
    assert execute(client, "import os; print(os.getpid(), marker)").split(maxsplit=1) == [
        str(old_ns_pid), "before the snapshot\n"]


def test_kernel_without_cuda_passes_through(store, fake, gpus, kernel):
    engine = make_engine(store, fake, gpus)
    snapshot = run(engine.save(target(kernel), name="cpu-only"))
    assert fake.ops() == []
    assert "gpu" not in snapshot.manifest
    assert kernel.execute("print('alive')").strip() == "alive"


def test_kernel_namespace_has_its_own_proc(kernel):
    # libcuda reads /proc/self/task/<gettid()>/comm at cuInit; with the host's /proc that
    # path does not exist inside a PID namespace and CUDA fails to initialise.
    out = kernel.execute(
        "import os, threading\n"
        "print(os.getpid(), open(f'/proc/self/task/{threading.get_native_id()}/comm').read())"
    )
    assert out.split()[0] == str(procfs.ns_pid(kernel.kernel_pid))


# -- failures at each CUDA step, as data ---------------------------------------------------------
FAILURES = [
    # (step that fails, CUresult, times, message part, calls the kernel sees)
    # A lock that timed out answers NOT_READY on driver 580 (measured on the H100).
    ("lock", CUDA_ERROR_NOT_READY, 1, "timed out after 0.5 s", ["lock"]),
    # criu's plugin then restores what it locked (only locked: nothing to do) and unlocks.
    ("checkpoint", CUDA_ERROR_NOT_SUPPORTED, 1, "managed (UVM) memory",
     ["lock", "checkpoint", "unlock"]),
    # Three tries inside criu, while the tree is frozen, then three more after it.
    ("restore", CUDA_ERROR_OUT_OF_MEMORY, 6, "still checkpointed in host memory",
     ["lock", "checkpoint", *["restore"] * 6]),
    ("unlock", CUDA_ERROR_UNKNOWN, 6, "still locked",
     ["lock", "checkpoint", "restore", *["unlock"] * 6]),
]


@pytest.mark.parametrize(("step", "code", "times", "says", "calls"), FAILURES,
                         ids=[f[0] for f in FAILURES])
def test_cuda_step_failure(store, fake, gpus, gpu_kernel, step, code, times, says, calls):
    engine = make_engine(store, fake, gpus)
    earlier = run(engine.save(target(gpu_kernel), name="earlier"))
    fake.calls.clear()
    fake.fail(step, code, times)
    with pytest.raises(CudaError) as err:
        run(engine.save(target(gpu_kernel), name="doomed"))
    assert says in err.value.message and str(gpu_kernel.kernel_pid) in err.value.message
    assert fake.ops(gpu_kernel.kernel_pid) == calls
    if step in ("lock", "checkpoint"):
        assert err.value.step == "suspend"
        assert_contract(gpu_kernel, fake, store, [earlier.id])
    else:
        # The driver kept refusing: the loud error says so, and the state is honest.
        assert err.value.step == "resume"
        stuck = fake.states[gpu_kernel.kernel_pid]
        assert stuck == (ProcessState.CHECKPOINTED if step == "restore" else ProcessState.LOCKED)
        assert [s.id for s in store.list()] == [earlier.id]
        fake.fail(step, code, 0)  # the driver recovers; the kernel can be brought back
        from jupyter_gpu_snapshot.gpu.checkpoint import CudaCheckpoint, CudaProcess

        CudaCheckpoint(fake).resume(CudaProcess(gpu_kernel.kernel_pid, stuck))
        assert_contract(gpu_kernel, fake, store, [earlier.id])


@pytest.mark.parametrize("step", ["restore", "unlock"])
def test_transient_resume_failure_is_retried(store, fake, gpus, gpu_kernel, step):
    engine = make_engine(store, fake, gpus)
    fake.fail(step, CUDA_ERROR_OUT_OF_MEMORY, times=2)
    snapshot = run(engine.save(target(gpu_kernel), name="retried"))
    assert fake.ops(gpu_kernel.kernel_pid).count(step) == 3
    assert_contract(gpu_kernel, fake, store, [snapshot.id])


def test_failed_state_is_refused_before_anything_is_locked(store, fake, gpus, gpu_kernel):
    engine = make_engine(store, fake, gpus)
    fake.states[gpu_kernel.kernel_pid] = ProcessState.FAILED
    with pytest.raises(CudaError) as err:
        run(engine.save(target(gpu_kernel)))
    assert err.value.step == "preflight" and "failed" in err.value.message
    assert fake.ops() == []
    assert procfs.tree_alive(gpu_kernel.root_pid)
    store.ensure()
    assert store.list() == []


def test_state_locked_by_someone_else_is_refused(store, fake, gpus, gpu_kernel):
    engine = make_engine(store, fake, gpus)
    fake.states[gpu_kernel.kernel_pid] = ProcessState.LOCKED
    with pytest.raises(CudaError, match="is locked, not running"):
        run(engine.save(target(gpu_kernel)))
    assert fake.ops() == []


def test_failure_that_leaves_the_driver_failed_is_loud(store, fake, gpus, gpu_kernel):
    engine = make_engine(store, fake, gpus)
    fake.fail("checkpoint", CUDA_ERROR_UNKNOWN, leaves=ProcessState.FAILED)
    with pytest.raises(CudaError) as err:
        run(engine.save(target(gpu_kernel)))
    assert "reports the CUDA state" in err.value.message and "failed" in err.value.message
    assert procfs.tree_alive(gpu_kernel.root_pid)  # CPU side still answers
    assert gpu_kernel.execute("print(counter)").strip() == "0"


# -- criu failing while CUDA is suspended --------------------------------------------------------
def test_criu_error_before_it_ran_leaves_cuda_untouched(store, fake, gpus, gpu_kernel, tmp_path):
    real = shutil.which("criu")
    failing = criu_wrapper(
        tmp_path,
        'case "$1" in dump) while [ "$1" != "-W" ]; do shift; done; '
        'echo "(00.012) Error (criu/cr-dump.c:1): injected failure" > "$2/dump.log"; exit 1;; '
        f'*) exec "{real}" "$@";; esac\n',
    )
    earlier = run(make_engine(store, fake, gpus).save(target(gpu_kernel), name="earlier"))
    fake.calls.clear()
    with pytest.raises(SnapshotError) as err:
        run(make_engine(store, fake, gpus, failing).save(target(gpu_kernel)))
    assert err.value.step == "dump" and "injected failure" in err.value.message
    assert fake.ops(gpu_kernel.kernel_pid) == []
    assert_contract(gpu_kernel, fake, store, [earlier.id])


def test_criu_error_after_the_checkpoint_resumes_cuda_before_the_threads_run(
        store, fake, gpus, gpu_kernel, tmp_path):
    gpu_kernel.execute("big = np.ones(10_000_000)")  # the kernel's pages pass the limit
    earlier = run(make_engine(store, fake, gpus).save(target(gpu_kernel), name="earlier"))
    fake.calls.clear()
    failing = criu_wrapper(tmp_path, fails_writing_pages())
    with pytest.raises(SnapshotError) as err:
        run(make_engine(store, fake, gpus, failing).save(target(gpu_kernel)))
    assert err.value.step == "dump" and "File too large" in err.value.message
    assert fake.ops(gpu_kernel.kernel_pid) == ["lock", "checkpoint", "restore", "unlock"]
    # criu's plugin restored and unlocked CUDA while criu still held every other thread.
    assert fake.protocol_breaches() == []
    assert_contract(gpu_kernel, fake, store, [earlier.id])


def test_criu_killed_mid_dump_resumes_cuda(store, fake, gpus, gpu_kernel, tmp_path):
    gpu_kernel.execute("big = np.ones(40_000_000)")  # a dump that lasts long enough to kill
    pid = gpu_kernel.kernel_pid
    killer = criu_wrapper(tmp_path, kill_while_writing_pages())
    try:
        snapshot = run(make_engine(store, fake, gpus, killer).save(target(gpu_kernel), stop=True))
    except SnapshotError as err:
        assert err.step == "dump"
        assert fake.ops(pid) == ["lock", "checkpoint", "restore", "unlock"]
        assert_contract(gpu_kernel, fake, store, [])
        return
    # On a loaded machine the kill can come once criu has completed the dump and ended the
    # kernel: then the image, all that is left of it, is committed (the next test's case).
    assert not procfs.tree_alive(gpu_kernel.root_pid)
    assert [s.id for s in store.list()] == [snapshot.id]
    assert fake.ops(pid) == ["lock", "checkpoint"]


def test_criu_dying_after_its_dump_completed_keeps_the_snapshot(
        store, fake, gpus, gpu_kernel, tmp_path, restored: RestoredTrees):
    gpu_kernel.execute("marker = 'before the snapshot'")
    old_pid = gpu_kernel.kernel_pid
    late = criu_wrapper(tmp_path, dies_after_the_dump_completed())
    snapshot = run(make_engine(store, fake, gpus, late).save(target(gpu_kernel), stop=True))
    # criu ended the kernel before it died: the image is kept, whole, and says what happened.
    assert not procfs.tree_alive(gpu_kernel.root_pid)
    assert fake.ops(old_pid) == ["lock", "checkpoint"]
    assert snapshot.manifest["warnings"] == [
        "criu was killed by signal 9 after its dump completed"]
    assert [s.id for s in store.list()] == [snapshot.id]
    store.verify(snapshot)
    gpu_kernel.client.stop_channels()

    back = run(make_engine(store, fake, gpus).restore(snapshot.id))
    client = restored.connect(back.connection_info, back.pid)
    assert fake.ops(back.kernel_pid) == ["restore", "unlock"]
    assert execute(client, "print(marker)").strip() == "before the snapshot"


def test_cancelled_save_waits_for_the_checkpoint_then_rolls_back(store, fake, gpus, gpu_kernel):
    fake.delays["checkpoint"] = 1.0
    engine = make_engine(store, fake, gpus)

    checkpointing = threading.Event()
    fake.on_call = lambda op, _pid: checkpointing.set() if op == "checkpoint" else None

    async def cancel_mid_checkpoint() -> None:
        task = asyncio.ensure_future(engine.save(target(gpu_kernel), name="cancelled"))
        await asyncio.to_thread(checkpointing.wait, 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(cancel_mid_checkpoint())
    # The cancellation surfaced only once criu's plugin had undone the checkpoint in flight.
    assert fake.ops(gpu_kernel.kernel_pid) == ["lock", "checkpoint", "restore", "unlock"]
    assert fake.protocol_breaches() == []
    assert_contract(gpu_kernel, fake, store, [])


# -- preflight refusals ---------------------------------------------------------------------------
def test_host_memory_short_is_refused(store, fake, gpus, gpu_kernel):
    engine = make_engine(store, fake, gpus, memory_available=lambda: 2 * GIB)
    with pytest.raises(NotReady, match=r"not enough free host memory .* 2\.0 GiB to move"):
        run(engine.save(target(gpu_kernel)))
    assert fake.ops() == []
    assert_contract(gpu_kernel, fake, store, [])


def test_disk_check_counts_the_gpu_bytes(store, fake, gpus):
    store.ensure()
    free = shutil.disk_usage(store.root).free
    handle = start_kernel(env=fake_cuda_env(free + GIB))
    try:
        handle.execute("import numpy as np; counter = 0; data = np.arange(5_000_000)")
        engine = make_engine(store, fake, gpus, memory_available=lambda: 4 * free)
        with pytest.raises(SnapshotError, match="not enough free disk"):
            run(engine.save(target(handle)))
        assert fake.ops() == []
        assert_contract(handle, fake, store, [])
    finally:
        stop_kernel(handle)


@pytest.mark.parametrize(("setting", "says"), [("mig", "MIG mode"), ("mps", "MPS")])
def test_mig_and_mps_are_refused(store, fake, gpus, gpu_kernel, setting, says):
    setattr(gpus, setting, True)
    with pytest.raises(NotReady, match=says):
        run(make_engine(store, fake, gpus).save(target(gpu_kernel)))
    assert fake.ops() == []
    assert_contract(gpu_kernel, fake, store, [])


def test_gpu_use_without_a_checkpoint_api_is_refused(store, kernel, tmp_path, monkeypatch):
    device = tmp_path / "nvidia0"
    device.write_text("")
    kernel.execute(f"gpu_device = open({str(device)!r})")
    monkeypatch.setattr(gpu_hook, "GPU_DEVICE_PREFIX", str(tmp_path / "nvidia"))
    no_api = DriverStatus(None, "driver 535.1 has no CUDA checkpoint API")
    engine = SnapshotEngine(store, None, [CudaCheckpointHook(driver=lambda: no_api)])
    with pytest.raises(NotReady, match=r"uses the GPU, but driver 535\.1 has no CUDA"):
        run(engine.save(target(kernel)))
    assert kernel.execute("print('alive')").strip() == "alive"


# -- restore refusals ----------------------------------------------------------------------------
def test_restore_refuses_other_gpus_drivers_and_short_memory(
        store, fake, gpus, gpu_kernel, restored: RestoredTrees):
    engine = make_engine(store, fake, gpus)
    snapshot = run(engine.save(target(gpu_kernel), name="moved", stop=True))
    gpu_kernel.client.stop_channels()
    info = snapshot.connection_info
    original = list(gpus.devices)
    # Another count, model or driver branch is the node check's refusal; room, the hook's.
    refusals: list[tuple[type[SnapshotError], str, Any]] = [
        (Incompatible, "had 1 GPU\\(s\\) .*, the restore has 2",
         lambda: gpus.devices.append(("NVIDIA Fake H100 80GB HBM3", "GPU-1", 80 * GIB))),
        (Incompatible, "GPU 0 is a NVIDIA Fake A100, it was a NVIDIA Fake H100",
         lambda: gpus.devices.__setitem__(0, ("NVIDIA Fake A100", original[0][1], 80 * GIB))),
        (NotReady, "its process needs cuda:0 2.0 GiB", lambda: setattr(gpus, "free", GIB)),
        (Incompatible, "the NVIDIA driver is 590.1.2 \\(branch 590\\)",
         lambda: setattr(fake, "version", "590.1.2")),
    ]
    for error, says, change in refusals:
        gpus.devices[:] = original
        gpus.free, fake.version = None, "580.159.04"
        change()
        with pytest.raises(error, match=says):
            run(make_engine(store, fake, gpus).restore(snapshot.id))
        assert procfs.ports_in_use(info) == []  # nothing was started
    # Same model, other UUID: restored onto it, with the pair handed to the driver.
    gpus.devices[:] = [(original[0][0], "GPU-99999999-1111-2222-3333-444444444444", 80 * GIB)]
    gpus.free, fake.version = None, "580.159.04"
    back = run(make_engine(store, fake, gpus).restore(snapshot.id))
    restored.connect(back.connection_info, back.pid)
    assert fake.restore_pairs[-1] == [(original[0][1], gpus.devices[0][1])]
    assert fake.states[back.kernel_pid] == ProcessState.RUNNING
    assert back.notes["gpu_remap"]["remapped"] is True
    assert [s.id for s in store.list()] == [snapshot.id]


# -- restoring onto other GPUs -------------------------------------------------------------------
H100 = "NVIDIA Fake H100 80GB HBM3"
UUID1 = "GPU-11111111-1111-2222-3333-444444444444"


@pytest.fixture
def two_gpus(fake: FakeCudaDriver) -> FakeGpus:
    return FakeGpus(fake, devices=[(H100, "GPU-00000000-1111-2222-3333-444444444444", 80 * GIB),
                                   (H100, UUID1, 80 * GIB)])


def saved_on_gpu0(store: SnapshotStore, fake: FakeCudaDriver, gpus: FakeGpus,
                  kernel: KernelHandle) -> Any:
    snapshot = run(make_engine(store, fake, gpus).save(target(kernel), name="gpu0", stop=True))
    kernel.client.stop_channels()
    uuid0 = gpus.devices[0][1]
    assert snapshot.manifest["gpu"]["visible"] == [uuid0, UUID1]
    assert snapshot.manifest["gpu"]["processes"][0]["devices"] == {uuid0: TWO_GIB}
    return snapshot


def test_a_full_gpu_sends_the_restore_onto_the_other_with_the_full_permutation(
        store, fake, two_gpus, gpu_kernel, restored: RestoredTrees):
    gpus = two_gpus
    snapshot = saved_on_gpu0(store, fake, gpus, gpu_kernel)
    uuid0 = gpus.devices[0][1]
    gpus.free_on[uuid0] = GIB  # another process filled GPU 0
    messages: list[str] = []
    back = run(make_engine(store, fake, gpus).restore(
        snapshot.id, lambda p: messages.append(p.message)))
    client = restored.connect(back.connection_info, back.pid)
    # The driver rejects anything short of a pair for every GPU the process sees.
    assert fake.restore_pairs[-1] == [(uuid0, UUID1), (UUID1, uuid0)]
    assert gpus().process_memory[back.kernel_pid] == {UUID1: TWO_GIB}
    remap = back.notes["gpu_remap"]
    assert remap["remapped"] and not remap["chosen"]
    assert [(d["device"], d["from"]["index"], d["to"]["index"]) for d in remap["devices"]] == [
        ("cuda:0", 0, 1), ("cuda:1", 1, 0)]
    assert "bringing GPU memory back onto other GPUs: cuda:0 onto GPU 1, cuda:1 onto GPU 0" \
        in messages
    assert execute(client, "print(int(data.sum()))").strip() == str(sum(range(5_000_000)))


def test_gpus_chosen_by_the_user_swap_the_gpus(store, fake, two_gpus, gpu_kernel,
                                               restored: RestoredTrees):
    snapshot = saved_on_gpu0(store, fake, two_gpus, gpu_kernel)
    back = run(make_engine(store, fake, two_gpus).restore(snapshot.id, gpus=["1", "0"]))
    restored.connect(back.connection_info, back.pid)
    uuid0 = two_gpus.devices[0][1]
    assert fake.restore_pairs[-1] == [(uuid0, UUID1), (UUID1, uuid0)]
    assert back.notes["gpu_remap"]["chosen"] is True
    assert two_gpus().process_memory[back.kernel_pid] == {UUID1: TWO_GIB}


def test_same_gpus_chosen_or_found_restore_without_pairs(store, fake, two_gpus, gpu_kernel,
                                                         restored: RestoredTrees):
    snapshot = saved_on_gpu0(store, fake, two_gpus, gpu_kernel)
    back = run(make_engine(store, fake, two_gpus).restore(snapshot.id, gpus=["0", "1"]))
    restored.connect(back.connection_info, back.pid)
    assert fake.restore_pairs[-1] == []
    assert back.notes["gpu_remap"]["remapped"] is False


@pytest.mark.parametrize("gpus,error,says", [
    (["1"], InvalidRequest, "gpus names 1 GPU"),
    (["1", "1"], InvalidRequest, "must be a permutation"),
    (["0", "5"], InvalidRequest, "'5' for cuda:1, which is no GPU of this node"),
    (["0", "1"], NotReady, "GPU 0 chosen for cuda:0 has 1.0 GiB free"),
])
def test_a_chosen_gpu_that_cannot_take_the_kernel_is_refused_before_criu(
        store, fake, two_gpus, gpu_kernel, gpus, error, says):
    snapshot = saved_on_gpu0(store, fake, two_gpus, gpu_kernel)
    two_gpus.free_on[two_gpus.devices[0][1]] = GIB
    calls = len(fake.calls)
    with pytest.raises(error, match=says):
        run(make_engine(store, fake, two_gpus).restore(snapshot.id, gpus=gpus))
    assert procfs.ports_in_use(snapshot.connection_info) == []  # nothing was started
    assert [op for op, _ in fake.calls[calls:] if op != "state"] == []


def test_gpus_for_a_snapshot_without_cuda_state_is_refused(store, fake, gpus, kernel):
    snapshot = run(make_engine(store, fake, gpus).save(target(kernel), name="cpu", stop=True))
    kernel.client.stop_channels()
    with pytest.raises(InvalidRequest, match="holds no CUDA state"):
        run(make_engine(store, fake, gpus).restore(snapshot.id, gpus=["0"]))


# -- allocator caches ----------------------------------------------------------------------------
# A stand-in for torch.cuda inside the real kernel: 3 GiB reserved, 1 GiB of it live.
FAKE_TORCH = """
import sys, types
torch = types.ModuleType("torch"); cuda = types.ModuleType("torch.cuda"); torch.cuda = cuda
cuda.reserved, cuda.emptied = 3 << 30, 0
cuda.is_initialized = lambda: True
cuda.device_count = lambda: 1
cuda.synchronize = lambda: None
cuda.memory_reserved = lambda d: cuda.reserved
cuda.memory_allocated = lambda d: 1 << 30
def empty_cache():
    cuda.emptied += 1; cuda.reserved = 1 << 30
cuda.empty_cache = empty_cache
sys.modules["torch"] = torch; sys.modules["torch.cuda"] = cuda
"""


def _kernel_names(kernel: KernelHandle) -> set[str]:
    names = json.loads(kernel.execute("import json; print(json.dumps(sorted(globals())))"))
    # IPython adds _i<N> for each cell run; the release must add nothing of its own.
    return {n for n in names if not n.startswith("_i")}


def test_idle_kernel_releases_allocator_caches_silently(store, fake, gpus, gpu_kernel):
    gpu_kernel.execute(FAKE_TORCH)
    names = _kernel_names(gpu_kernel)
    count = gpu_kernel.execute("print(get_ipython().execution_count)")
    snapshot = run(make_engine(store, fake, gpus).save(target(gpu_kernel)))
    caches = snapshot.manifest["gpu"]["allocator_caches"]
    assert caches["released"] and caches["frameworks"] == ["torch"]
    assert caches["freed_bytes"] == 2 << 30 and caches["live_bytes"] == 1 << 30
    assert snapshot.manifest["gpu"]["live_bytes"] == 1 << 30
    assert gpu_kernel.execute("print(torch.cuda.emptied)").strip() == "1"
    # Silent: no execution count, no new names in the user's namespace.
    after = gpu_kernel.execute("print(get_ipython().execution_count)")
    assert int(after) == int(count) + 2  # the two cells above, nothing else
    assert _kernel_names(gpu_kernel) == names


def test_busy_kernel_keeps_its_caches_and_is_not_disturbed(
        store, fake, gpus, gpu_kernel, tmp_path):
    gpu_kernel.execute(FAKE_TORCH)
    may_end = tmp_path / "cell-may-end"
    msg_id = gpu_kernel.client.execute(
        f"import os, time; print('started', flush=True)\n"
        f"while not os.path.exists({str(may_end)!r}): time.sleep(0.02)\n"
        "counter += 1"
    )
    wait_for_output(gpu_kernel.client, msg_id, "started")
    snapshot = run(make_engine(store, fake, gpus).save(target(gpu_kernel)))
    caches = snapshot.manifest["gpu"]["allocator_caches"]
    assert not caches["released"] and "busy" in caches["reason"]
    may_end.touch()
    assert reply_to(gpu_kernel.client, msg_id)["content"]["status"] == "ok"
    time.sleep(0.5)
    # Nothing was queued behind the cell: the caches are still untouched after it ended.
    assert gpu_kernel.execute("print(torch.cuda.emptied, counter)").split() == ["0", "1"]


def test_cache_release_can_be_turned_off(store, fake, gpus, gpu_kernel):
    gpu_kernel.execute(FAKE_TORCH)
    snapshot = run(make_engine(store, fake, gpus, drop_caches=False).save(target(gpu_kernel)))
    assert "turned off" in snapshot.manifest["gpu"]["allocator_caches"]["reason"]
    assert gpu_kernel.execute("print(torch.cuda.emptied)").strip() == "0"


# -- a kernel asleep in the gpu tier: saved as it sleeps, its GPU untouched ----------------------
def release_gpu(engine: SnapshotEngine, kernel: KernelHandle) -> Any:
    hook = next(h for h in engine.hooks if isinstance(h, CudaCheckpointHook))
    sleep = hook.gpu_sleep()
    sleep.release(kernel.root_pid, {"kernel_id": "k"})
    return sleep


def asleep_as_before(kernel: KernelHandle, fake: FakeCudaDriver, sleep: Any) -> bool:
    """Held by a holder again, its CUDA checkpointed, every thread but the restore one held."""
    restore_tid = fake.restore_thread_id(kernel.kernel_pid)
    held = all(state == "t" for proc in procfs.tree(kernel.root_pid)
               for tid, state in procfs.thread_states(proc.pid).items() if tid != restore_tid)
    status = sleep.asleep(kernel.root_pid)
    return (status is not None and status.get("kernel_id") == "k" and held
            and fake.states[kernel.kernel_pid] == ProcessState.CHECKPOINTED)


@pytest.mark.parametrize("full_gpu0", [False, True], ids=["same-gpu", "onto-the-other-gpu"])
def test_a_sleeping_kernel_is_dumped_as_it_sleeps_and_restored_held_then_woken(
        store, fake, two_gpus, gpu_kernel, restored: RestoredTrees, full_gpu0):
    gpus = two_gpus
    engine = make_engine(store, fake, gpus)
    gpu_kernel.execute("marker = 'asleep'")
    old_pid, old_ns_pid = gpu_kernel.kernel_pid, procfs.ns_pid(gpu_kernel.kernel_pid)
    release_gpu(engine, gpu_kernel)
    snapshot = run(engine.save(target(gpu_kernel), name="moved", stop=True))
    # The dump touched no CUDA state: what the release did is all the driver saw.
    assert fake.ops(old_pid) == ["lock", "checkpoint"]
    assert not procfs.tree_alive(gpu_kernel.root_pid)
    gpu_kernel.client.stop_channels()
    gpu = snapshot.manifest["gpu"]
    assert gpu["dumped_state"] == "checkpointed"
    uuid0 = gpus.devices[0][1]
    assert gpu["processes"][0]["devices"] == {uuid0: TWO_GIB}
    assert gpu["moved_bytes"] == TWO_GIB

    if full_gpu0:
        gpus.free_on[uuid0] = GIB  # another process filled GPU 0
    back = run(make_engine(store, fake, gpus).restore(snapshot.id))
    client = restored.connect(back.connection_info, back.pid)
    new_pid = back.kernel_pid
    assert fake.ops(new_pid) == ["restore", "unlock"]
    assert fake.states[new_pid] == ProcessState.RUNNING
    # Held from the moment it continued until its CUDA state ran again.
    assert fake.protocol_breaches() == []
    if full_gpu0:
        assert fake.restore_pairs[-1] == [(uuid0, UUID1), (UUID1, uuid0)]
        assert gpus().process_memory[new_pid] == {UUID1: TWO_GIB}
    assert execute(client, "import os; print(os.getpid(), marker)").split(maxsplit=1) == [
        str(old_ns_pid), "asleep\n"]
    assert all(state != "t" for proc in procfs.tree(back.pid)
               for state in procfs.thread_states(proc.pid).values())


def test_a_failed_dump_of_a_sleeping_kernel_leaves_it_asleep(
        store, fake, gpus, gpu_kernel, tmp_path):
    gpu_kernel.execute("big = np.ones(10_000_000)")  # the kernel's pages pass the limit
    engine = make_engine(store, fake, gpus)
    earlier = run(engine.save(target(gpu_kernel), name="earlier"))
    sleep = release_gpu(engine, gpu_kernel)
    fake.calls.clear()
    failing = criu_wrapper(tmp_path, fails_writing_pages())
    with pytest.raises(SnapshotError) as err:
        run(make_engine(store, fake, gpus, failing).save(target(gpu_kernel), stop=True))
    assert err.value.step == "dump" and "File too large" in err.value.message
    assert fake.ops(gpu_kernel.kernel_pid) == []
    assert asleep_as_before(gpu_kernel, fake, sleep)
    sleep.wake(gpu_kernel.root_pid)
    assert fake.protocol_breaches() == []
    assert_contract(gpu_kernel, fake, store, [earlier.id])


def test_a_sleeping_kernel_is_not_saved_kept_running(store, fake, gpus, gpu_kernel):
    engine = make_engine(store, fake, gpus)
    sleep = release_gpu(engine, gpu_kernel)
    with pytest.raises(NotReady, match="sleeps with its GPU released") as refused:
        run(engine.save(target(gpu_kernel)))
    assert "wake it first" in (refused.value.hint or "")
    assert asleep_as_before(gpu_kernel, fake, sleep)
    sleep.wake(gpu_kernel.root_pid)
    assert_contract(gpu_kernel, fake, store, [])
