"""Every GPU framework a notebook uses survives a keep-running save, or is refused before
its kernel is hurt: scenarios as data, run for real on the GPU machine.

Each row's kernel builds some state and a ``step()`` that computes on the GPU and returns a
digest of the results (exact bytes, hex floats). The scenario, for every row:

1. save, keep running (the engine as the server and CLI make it);
2. the original answers and continues: ``step()`` twice (the reference continuation);
3. the original is killed; the snapshot is restored into a fresh namespace;
4. the restored kernel continues: ``step()`` twice must equal the reference, bit for bit.

A row with ``refused`` expects the save to fail with that message, and the kernel to go on
computing with the state it had. Figures (pause, image, GPU bytes moved, host RSS and the
live device bytes the row reports) go to the results file (``JGS_GPU_RESULTS``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from jupyter_gpu_snapshot.config import GPUSnapshot
from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.errors import SnapshotError
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.gpu.driver import LibcudaDriver, ProcessState
from jupyter_gpu_snapshot.node.local_engine import make_engine

from ..conftest import KernelHandle, RestoredTrees, execute, run, start_kernel, stop_kernel
from .conftest import DETERMINISTIC_TORCH

pytestmark = pytest.mark.gpu


@dataclass(frozen=True)
class Framework:
    id: str
    setup: str  # defines step() -> str, and live_bytes() -> int (device bytes of its state)
    env: dict[str, str] = field(default_factory=dict)
    refused: str | None = None  # a pattern the refusal's message matches


DIGEST = """
import hashlib, json
def digest(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(bytes(memoryview(a).cast("B")))
    return h.hexdigest()[:16]
"""

TORCH_TRAINING = DIGEST + DETERMINISTIC_TORCH + """
model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Dropout(0.1),
                      nn.Linear(4096, 1024)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
def step():
    x = torch.randn(256, 1024, device="cuda")
    loss = model(x).square().mean()
    opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    return loss.item().hex()
def live_bytes():
    return torch.cuda.memory_allocated()
"""

TORCH_COMPILE = DIGEST + """
import torch
torch.manual_seed(0)
w = torch.randn(2048, 2048, device="cuda")
@torch.compile
def f(x):
    return torch.nn.functional.gelu(x @ w).softmax(-1)
x = torch.randn(512, 2048, device="cuda")
f(x)
import torch._dynamo.utils as _u
compiles = _u.counters["stats"]["unique_graphs"]
def step():
    global x
    x = f(x) * 7
    assert _u.counters["stats"]["unique_graphs"] == compiles, "recompiled"
    return digest(x.cpu().numpy())
def live_bytes():
    return torch.cuda.memory_allocated()
"""

TORCH_CUDA_GRAPHS = DIGEST + """
import torch
torch.manual_seed(0)
w = torch.randn(1024, 1024, device="cuda")
static_x = torch.randn(256, 1024, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        static_y = torch.tanh(static_x @ w)
torch.cuda.current_stream().wait_stream(s)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    static_y = torch.tanh(static_x @ w)
def step():
    graph.replay()
    static_x.copy_(static_y * 3)
    torch.cuda.synchronize()
    return digest(static_y.cpu().numpy())
def live_bytes():
    return torch.cuda.memory_allocated()
"""

TORCH_DATALOADER = DIGEST + """
import torch
from torch.utils.data import DataLoader, Dataset
class Squares(Dataset):
    def __len__(self): return 10_000
    def __getitem__(self, i): return torch.full((64,), float(i * i))
loader = DataLoader(Squares(), batch_size=32, num_workers=2, persistent_workers=True)
batches = iter(loader)
acc = torch.zeros(64, device="cuda")
def step():
    global acc
    for _ in range(5):
        acc = acc + next(batches).cuda().sum(0)
    return digest(acc.cpu().numpy())
def live_bytes():
    return torch.cuda.memory_allocated()
"""

JAX = DIGEST + """
import jax, jax.numpy as jnp, numpy as np
key = jax.random.PRNGKey(0)
w = jax.random.normal(key, (2048, 2048))
x = jax.random.normal(jax.random.PRNGKey(1), (512, 2048))
@jax.jit
def f(x, w):
    return jnp.tanh(x @ w) * 3
x = f(x, w); x.block_until_ready()
def step():
    global x, key
    key, sub = jax.random.split(key)
    x = f(x, w) + jax.random.normal(sub, x.shape) * 1e-3
    return digest(np.asarray(x))
def live_bytes():
    return sum(a.nbytes for a in jax.live_arrays())
def describe():
    return {"devices": [str(d) for d in jax.devices()],
            "memory_stats": jax.devices()[0].memory_stats()}
"""

CUPY = DIGEST + """
import cupy as cp
rng = cp.random.default_rng(0)
a = rng.standard_normal((2048, 2048), dtype=cp.float32)
square = cp.ElementwiseKernel("float32 x", "float32 y", "y = x * x - 0.5f", "square")
def step():
    global a
    a = square(a @ a.T / 2048)
    return digest(cp.asnumpy(a))
def live_bytes():
    return cp.get_default_memory_pool().used_bytes()
"""

CUPY_MANAGED = DIGEST + """
import cupy as cp
cp.cuda.set_allocator(cp.cuda.MemoryPool(cp.cuda.malloc_managed).malloc)
a = cp.arange(1 << 20, dtype=cp.float32)
def step():
    global a
    a = a * 2 + 1
    return digest(cp.asnumpy(a))
def live_bytes():
    return int(a.nbytes)
"""

NUMBA = DIGEST + """
import numpy as np
from numba import cuda
@cuda.jit
def axpy(out, x, y, a):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a * x[i] + y[i]
x = cuda.to_device(np.linspace(0, 1, 1 << 20, dtype=np.float32))
y = cuda.to_device(np.ones(1 << 20, dtype=np.float32))
out = cuda.device_array_like(x)
def step():
    global x
    axpy[(out.size + 255) // 256, 256](out, x, y, np.float32(0.5))
    x, _ = out, x
    return digest(out.copy_to_host())
def live_bytes():
    return 3 * (1 << 22)
"""

TRITON = DIGEST + """
import torch, triton, triton.language as tl
@triton.jit
def fma_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * 1.5 + y, mask=mask)
torch.manual_seed(0)
x = torch.rand(1 << 22, device="cuda")
y = torch.rand(1 << 22, device="cuda")
def step():
    global x
    out = torch.empty_like(x)
    fma_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, out, x.numel(), BLOCK=1024)
    x = out / out.max()
    return digest(x.cpu().numpy())
def live_bytes():
    return torch.cuda.memory_allocated()
"""

TRANSFORMERS = DIGEST + """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config).cuda().eval()
ids = torch.tensor([[1, 17, 42, 99, 7]], device="cuda")
def step():
    global ids
    with torch.no_grad():
        ids = model.generate(ids, max_new_tokens=8, do_sample=False)[:, -5:]
    return json.dumps(ids.tolist())
def live_bytes():
    return torch.cuda.memory_allocated()
"""

LIGHTNING = DIGEST + """
import logging, warnings
warnings.filterwarnings("ignore")
logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
import torch, lightning as L
from torch.utils.data import DataLoader, TensorDataset
L.seed_everything(0, verbose=False)
class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(64, 1)
    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
data = TensorDataset(torch.randn(512, 64), torch.randn(512, 1))
module = Tiny()
def fit(steps):
    trainer = L.Trainer(max_steps=steps, accelerator="gpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True)
    trainer.fit(module, DataLoader(data, batch_size=32, shuffle=False))
fit(3)
def step():
    fit(3)
    return digest(module.net.weight.detach().cpu().numpy())
def live_bytes():
    return torch.cuda.memory_allocated()
def describe():
    import sys
    return sorted(m for m in sys.modules if any(
        w in m.lower() for w in ("opencl", "pocl", "cv2", "tensorflow", "vulkan")))
"""

NVML = DIGEST + """
import pynvml, torch
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
name = pynvml.nvmlDeviceGetName(handle)
t = torch.arange(1 << 20, device="cuda", dtype=torch.float64)
def step():
    global t
    pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
    t = t * 1.0001 + 1
    return f"{name} {digest(t.cpu().numpy())}"
def live_bytes():
    return torch.cuda.memory_allocated()
"""

FRAMEWORKS = [
    Framework("torch-eager-training", TORCH_TRAINING),
    Framework("torch-compile", TORCH_COMPILE),
    Framework("torch-cuda-graphs", TORCH_CUDA_GRAPHS),
    Framework("torch-dataloader-workers", TORCH_DATALOADER),
    # Snapshot-ready kernels' default: JAX allocates as arrays need it.
    Framework("jax", JAX),
    # JAX's own default, preallocation, bounded so the image fits the machine's disk.
    Framework("jax-preallocated", JAX, env={"XLA_PYTHON_CLIENT_PREALLOCATE": "true",
                                            "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.05"}),
    Framework("cupy", CUPY),
    Framework("cupy-managed-memory", CUPY_MANAGED, refused=r"managed \(UVM\) memory"),
    Framework("numba-cuda", NUMBA),
    Framework("triton-kernel", TRITON),
    Framework("transformers-generate", TRANSFORMERS),
    # Something Lightning loads scans OpenCL platforms; NVIDIA's OpenCL driver then maps
    # /dev/nvidia0 outside CUDA, and CRIU cannot dump that mapping (seen on the H200).
    Framework("lightning-fit", LIGHTNING, refused=r"maps a device file that CRIU cannot dump"),
    Framework("nvml", NVML),
]


def criu_errors(err: SnapshotError) -> list[str]:
    """The error lines of the criu log a failed save kept, and what came right before."""
    if err.log_path is None:
        return []
    lines = err.log_path.read_text(errors="replace").splitlines()
    benign = ("RLIMIT_NOFILE", "retrieve restore tid")
    wanted = [i for i, line in enumerate(lines)
              if "Error (" in line and not any(b in line for b in benign)]
    return [lines[j] for i in wanted[:5] for j in range(max(0, i - 6), i + 1)]


def device_mappings(pid: int) -> list[str]:
    """The kernel's mappings of device files (/dev/nvidia*), as /proc/PID/maps lists them."""
    with open(f"/proc/{pid}/maps") as f:
        return sorted({line.split(None, 5)[-1].strip() for line in f if " /dev/" in line})


def described(k: KernelHandle) -> Any:
    """What a row's optional describe() says of its kernel (e.g. JAX's devices and pool)."""
    out = k.execute("print(json.dumps(describe() if 'describe' in globals() else None))")
    return json.loads(out.strip().splitlines()[-1])


def measure(call: Any) -> dict[str, Any]:
    out = call("print(json.dumps([live_bytes(), step(), step()]))")
    live, *steps = json.loads(out.strip().splitlines()[-1])
    return {"live_bytes": live, "steps": steps}


@pytest.mark.parametrize("fw", FRAMEWORKS, ids=[f.id for f in FRAMEWORKS])
def test_framework_survives_a_save_and_continues_bitwise_after_restore(
        fw: Framework, store: SnapshotStore, restored: RestoredTrees, figures: dict[str, Any]):
    engine = make_engine(GPUSnapshot(store_dir=str(store.root)))
    k = start_kernel(env=fw.env)
    try:
        k.execute(fw.setup, timeout=600)
        k.execute("step()", timeout=300)  # warm: first calls compile and allocate
        target = SaveTarget(pid=k.root_pid, connection_info=k.km.get_connection_info())
        rss = procfs.tree_rss(k.root_pid)
        figures["kernel"] = described(k)
        figures["device_mappings"] = device_mappings(k.kernel_pid)
        if fw.refused is not None:
            with pytest.raises(SnapshotError) as err:
                run(engine.save(target, name=fw.id))
            assert re.search(fw.refused, err.value.message), err.value.message
            assert store.list() == []
            # Refused, not hurt: the kernel computes on with its state.
            assert LibcudaDriver().state(k.kernel_pid) == ProcessState.RUNNING
            k.execute("step()", timeout=300)
            figures.update(refused=err.value.message)
            return
        try:
            snapshot = run(engine.save(target, name=fw.id))
        except SnapshotError as err:
            figures["criu_errors"] = criu_errors(err)
            raise
        assert not snapshot.manifest.get("warnings"), snapshot.manifest["warnings"]
        # The row really used the GPU: the driver moved its device memory.
        assert snapshot.manifest["gpu"]["moved_bytes"] > 0
        # Its pages went into the store's packs, so the restore assembles them.
        assert any("chunks" in f for f in snapshot.manifest["files"].values())
        assert LibcudaDriver().state(k.kernel_pid) == ProcessState.RUNNING
        reference = measure(k.execute)
    finally:
        stop_kernel(k)

    back = run(engine.restore(snapshot.id))
    client = restored.connect(back.connection_info, back.pid)
    continued = measure(lambda code: execute(client, code, timeout=300))
    assert continued["steps"] == reference["steps"]
    gpu = snapshot.manifest["gpu"]
    figures.update(
        pause_s=snapshot.manifest["timings"]["pause"],
        save_total_s=snapshot.manifest["timings"]["total"],
        cuda_timings=gpu["timings"],
        image_bytes=snapshot.size_bytes,
        stored=snapshot.manifest["stored"],
        moved_bytes=gpu["moved_bytes"],
        host_rss_bytes=rss,
        live_device_bytes=reference["live_bytes"],
        image_over_live_plus_rss=round(snapshot.size_bytes / (reference["live_bytes"] + rss), 3),
        restore_timings=back.timings,
        steps=continued["steps"],
    )
