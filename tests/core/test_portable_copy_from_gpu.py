"""A portable copy written on the GPU machine comes back on a machine without PyTorch, JAX,
CuPy or a GPU: what can be loaded there is bit for bit what the GPU held, and the report
says why the rest is not back.

``data/portable-from-gpu/`` holds the files of a real copy: a snapshot-ready kernel on an
NVIDIA GPU, saved with ``jupyter gpu-snapshot save --portable``, the files then taken from
the snapshot as a fallback hands them to a kernel (checked against their signed digests),
by ``tests/gpu/test_portable_gpu.py::test_a_small_copy_of_every_framework_for_the_cpu_machine``
with ``JGS_PORTABLE_COPY_OUT``. Its ``digests.json`` holds, for each array, the sha256 of
its bytes, its dtype, shape and device, taken inside that kernel on the GPU.

PyTorch, JAX and CuPy are hidden from the loader here (they are absent on the CPU machines
anyway), so the test checks the same thing wherever it runs. bfloat16 arrays come back
only where ml_dtypes is installed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jupyter_gpu_snapshot.kernel.portable import load_portable, read_report

pytestmark = pytest.mark.timeout(60)

DATA = Path(__file__).parent / "data" / "portable-from-gpu"
HIDDEN = ("torch", "jax", "jaxlib", "cupy")
BFLOAT16 = "bfloat16 arrays need PyTorch or ml_dtypes, and neither is installed here"


@pytest.fixture
def without_gpu_frameworks(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a CPU machine: importing any of them fails."""
    for name in list(sys.modules):
        if name.split(".")[0] in HIDDEN:
            monkeypatch.delitem(sys.modules, name)
    for name in HIDDEN:
        monkeypatch.setitem(sys.modules, name, None)


def leaf(namespace: dict[str, Any], path: str) -> Any:
    """``batch.inputs`` is ``namespace["batch"]["inputs"]``; ``layer.weight`` an attribute."""
    root, _, key = path.partition(".")
    value = namespace[root]
    if key:
        value = value[key] if isinstance(value, dict) else getattr(value, key)
    return value


def described(value: Any) -> list[Any]:
    array = np.ascontiguousarray(value)
    return [hashlib.sha256(array.tobytes()).hexdigest(), array.dtype.name, list(array.shape)]


def test_a_copy_from_the_gpu_loads_here_bit_for_bit_and_says_what_it_cannot(
    without_gpu_frameworks: None,
) -> None:
    on_gpu: dict[str, list[Any]] = json.loads((DATA / "digests.json").read_text())["leaves"]
    # The copy really came from the GPU: CUDA tensors, CuPy and JAX arrays on the device.
    assert on_gpu["weights"][3] == "cuda:0" and on_gpu["weights"][4] == "torch"
    assert on_gpu["grid"][3] == "cuda:0" and on_gpu["noise"][3] == "gpu:0"
    assert on_gpu["half"][1] == "bfloat16"

    namespace: dict[str, Any] = {}
    result = load_portable(namespace, DATA, read_report(DATA))
    bfloat16_here = importlib.util.find_spec("ml_dtypes") is not None

    reasons = {entry["name"]: entry["reason"] for entry in result["not_loaded"]}
    assert reasons.pop("log") == "not carried: an open file"
    assert "torch" in reasons.pop("layer")  # a module of PyTorch needs PyTorch
    for name, module in (("torch", "torch"), ("cp", "cupy"), ("jax", "jax"), ("jnp", "jax")):
        assert module in reasons.pop(name), name
    if not bfloat16_here:
        assert reasons.pop("half") == BFLOAT16
        assert reasons.pop("ramp") == BFLOAT16
    assert reasons == {}, reasons

    # Everything else is back, on the CPU, as NumPy arrays, bit for bit.
    back = {entry["name"]: entry["device"] for entry in result["loaded"]}
    assert {"weights", "f16", "ids", "mask", "batch", "grid", "noise", "host", "note",
            "leaves", "np", "os"} <= set(back), back
    assert set(back.values()) == {"cpu"}
    compared = [path for path in on_gpu if path.partition(".")[0] in namespace]
    assert len(compared) == len(on_gpu) - 2 - (0 if bfloat16_here else 2)  # layer.*, bf16
    for path in compared:
        value = leaf(namespace, path)
        assert isinstance(value, np.ndarray), (path, type(value))
        assert described(value) == on_gpu[path][:3], path
    assert namespace["batch"]["label"] == "first"
    assert namespace["note"] == "written on the GPU"

    notes = result["notes"]
    assert any(note.startswith("PyTorch is not installed here: tensors came back as NumPy "
                               "arrays, on the CPU") and "weights" in note for note in notes)
    assert any(note.startswith("JAX is not installed here") and "noise" in note
               for note in notes), notes
    assert any(note.startswith("CuPy or a GPU is missing here") and "grid" in note
               for note in notes), notes
