"""The portable copy of a namespace, written and loaded in this process: NumPy, pandas and
plain objects here; PyTorch (CPU, and CUDA where there is a GPU), JAX and CuPy where they are
installed. Real files in the test's directory; the tensor file read back with safetensors.

The copy asked of a real kernel and loaded by another is in ``test_cell_record.py``.
"""

from __future__ import annotations

import contextlib
import json
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from jupyter_gpu_snapshot.core.store import SnapshotStore, packs
from jupyter_gpu_snapshot.core.store.snapshot import new_snapshot_id
from jupyter_gpu_snapshot.kernel import portable
from jupyter_gpu_snapshot.kernel.portable import (
    FILE_NAME,
    METADATA_KEY,
    REPORT_FILE,
    TENSOR_FILE,
    PortableLoad,
    is_padding,
    load_portable,
    read_report,
    tensor_file,
    write_portable,
)
from testkit.manifests import kernel_section

pytestmark = pytest.mark.timeout(60)


def round_trip(namespace: dict[str, Any], directory: Path,
               device: str = "auto") -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    report = write_portable(namespace, directory)
    loaded: dict[str, Any] = {}
    result = load_portable(loaded, directory, read_report(directory), device)
    return report, loaded, result


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes())


def tensor_keys(path: Path) -> list[str]:
    """The copy's tensors in its tensor file, without the padding between them."""
    with safe_open(str(path), framework="numpy") as handle:
        return [key for key in list(handle.keys()) if not is_padding(key)]


def checked_layout(path: Path) -> dict[str, Any]:
    """The tensor file's header, once its layout is checked: a whole number of pages, the
    data of every tensor of at least ALIGNED_MIN_BYTES on a page of the file, the rest
    covered by padding of zeros that is the only gap filler."""
    page = portable.PAGE_BYTES
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    start = 8 + length
    assert start % page == 0 and len(data) % page == 0
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    for key, entry in entries.items():
        begin, end = entry["data_offsets"]
        if is_padding(key):
            assert entry["dtype"] == "U8" and 0 < end - begin < page
            assert data[start + begin:start + end] == bytes(end - begin)
        elif end - begin >= portable.ALIGNED_MIN_BYTES:
            assert (start + begin) % page == 0, key
    assert not any(is_padding(k) for k in json.loads(header["__metadata__"][METADATA_KEY]))
    return header


class Unpicklable:
    def __reduce__(self) -> Any:
        raise ValueError("refuses to be pickled")


def test_arrays_of_every_plain_dtype_come_back_bit_for_bit(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    base = rng.standard_normal((6, 5))
    arrays = {
        "f32": base.astype(np.float32),
        "f16": base.astype(np.float16),
        "f64_with_nan": np.array([np.nan, -0.0, np.inf, 1.5]),
        "i8": np.arange(-4, 4, dtype=np.int8),
        "u64": np.array([2**64 - 1, 0], dtype=np.uint64),
        "flags": base > 0,
        "big_endian": np.arange(6, dtype=">i4").reshape(2, 3),
        "fortran": np.asfortranarray(base),
        "strided": base[::2, 1::2],
        "scalar": np.array(7.25),
        "empty": np.zeros((0, 4), dtype=np.int32),
        "c64": (base + 1j).astype(np.complex64),
        "c128": base + 2j,
        "when": np.array(["2024-01-01T00:00:01", "NaT"], dtype="datetime64[ns]"),
        "delta": np.array([1, -2], dtype="timedelta64[ms]"),
        "text": np.array(["a", "bcd"]),
        "objects": np.array([{"k": 1}, None], dtype=object),
    }
    report, loaded, result = round_trip(dict(arrays), tmp_path)
    assert report["not_carried"] == [] and result["not_loaded"] == []
    for name, array in arrays.items():
        back = loaded[name]
        assert isinstance(back, np.ndarray), name
        if array.dtype == object:
            assert back.tolist() == array.tolist()
        else:
            assert same_bits(array, back), name
        assert back.flags.writeable, name
    # Plain dtypes are in the tensor file, a standard one: safetensors reads every entry.
    keys = tensor_keys(tmp_path / TENSOR_FILE)
    with safe_open(str(tmp_path / TENSOR_FILE), framework="numpy") as handle:
        stored = {key: handle.get_tensor(key) for key in keys}
        described = json.loads(handle.metadata()[METADATA_KEY])
    checked_layout(tmp_path / TENSOR_FILE)
    assert len(keys) == len(arrays) - 2  # the strings and the objects went through pickle
    assert set(described) == set(keys)
    assert {described[k]["framework"] for k in keys} == {"numpy"}
    assert any(a.dtype == np.float16 and a.shape == (6, 5) for a in stored.values())


def test_pandas_frames_and_series_come_back_equal(tmp_path: Path) -> None:
    frame = pd.DataFrame({
        "x": np.linspace(0, 1, 7),
        "n": np.arange(7, dtype=np.int32),
        "label": list("abcdefg"),
        "kind": pd.Categorical(list("xyxyxyx")),
        "t": pd.date_range("2024-01-01", periods=7, freq="h", tz="UTC"),
    }).set_index("label")
    series = pd.Series([1.5, None, 3.0], index=["p", "q", "r"], name="s")
    report, loaded, _ = round_trip({"frame": frame, "series": series}, tmp_path)
    assert [e["kind"] for e in report["carried"]] == ["pandas.DataFrame", "pandas.Series"]
    assert report["carried"][0]["devices"] == ["cpu"]
    pd.testing.assert_frame_equal(loaded["frame"], frame)
    pd.testing.assert_series_equal(loaded["series"], series)
    loaded["frame"].loc["a", "x"] = 42.0  # its arrays are the loader's own, writable


def test_one_bad_name_spoils_nothing_and_every_tensor_is_written_once(tmp_path: Path) -> None:
    shared = np.arange(100, dtype=np.float64)
    namespace: dict[str, Any] = {
        "shared": shared,
        "pair": [shared, shared[::2]],
        "bad": Unpicklable(),
        "holder": {"inner": [Unpicklable()]},
        "log": open(tmp_path / "log.txt", "w"),  # noqa: SIM115
        "numbers": (i for i in range(3)),
        "alias": None,
        "_private": np.zeros(3),
        "In": [],
        "ünïcode": np.ones(2, dtype=np.int16),
        "x" * 200: 1,
    }
    namespace["alias"] = namespace["pair"]
    namespace["frozen"] = (namespace["pair"],)  # a tuple: its own, holding the shared list
    try:
        report = write_portable(namespace, tmp_path / ".." / tmp_path.name)
    finally:
        namespace["log"].close()
    reasons = {entry["name"]: entry["reason"] for entry in report["not_carried"]}
    assert reasons == {"bad": "ValueError: refuses to be pickled",
                       "holder": "ValueError: refuses to be pickled",
                       "log": "an open file", "numbers": "a generator"}
    carried = [entry["name"] for entry in report["carried"]]
    assert carried == ["shared", "pair", "alias", "ünïcode", "x" * 200, "frozen"]
    assert all(FILE_NAME.match(name) and name.startswith("portable.")
               for name in report["files"])
    assert sorted(report["files"]) == sorted(p.name for p in tmp_path.glob("portable.*"))
    assert len(tensor_keys(tmp_path / TENSOR_FILE)) == 3  # shared, its view, the int16 one
    # A name's bytes count the tensors it brought first: the shared one counts once.
    sizes = {entry["name"]: entry["bytes"] for entry in report["carried"]}
    assert sizes["shared"] >= 800 and sizes["pair"] < 800 and sizes["alias"] < 100

    loaded: dict[str, Any] = {}
    result = load_portable(loaded, tmp_path, report)
    assert loaded["pair"][0] is loaded["shared"] and loaded["alias"] is loaded["pair"]
    assert loaded["frozen"][0] is loaded["pair"]
    assert loaded["pair"][1].tolist() == shared[::2].tolist()
    assert loaded["ünïcode"].dtype == np.int16 and loaded["x" * 200] == 1
    assert {item["name"]: item["reason"] for item in result["not_loaded"]} == {
        name: f"not carried: {reason}" for name, reason in reasons.items()}


def test_large_tensors_start_on_pages_at_little_cost(tmp_path: Path) -> None:
    assert portable.PAGE_BYTES == packs.PAGE
    rng = np.random.default_rng(5)
    # Sizes off the page, small and large ones mixed as in a model's weights and biases.
    arrays = {}
    for layer in range(6):
        arrays[f"w{layer}"] = rng.integers(0, 255, 65536 + 4096 * layer + 7 * layer + 1,
                                           dtype=np.uint8)
        arrays[f"b{layer}"] = rng.standard_normal(17 + layer).astype(np.float32)
    arrays["tiny"] = np.zeros((0, 3), dtype=np.float32)
    arrays["big_even"] = rng.standard_normal(1 << 18).astype(np.float32)  # exactly pages
    _, loaded, result = round_trip(dict(arrays), tmp_path)
    assert result["not_loaded"] == [] and sorted(loaded) == sorted(arrays)
    for name, array in arrays.items():
        assert same_bits(array, loaded[name]), name
    path = tmp_path / TENSOR_FILE
    header = checked_layout(path)
    length = struct.unpack("<Q", path.read_bytes()[:8])[0]
    padding = sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items()
                  if is_padding(k))
    payload = sum(a.nbytes for a in arrays.values())
    aligned = sum(1 for a in arrays.values() if a.nbytes >= portable.ALIGNED_MIN_BYTES)
    # At most a page less a byte before each aligned tensor and after the data; the small
    # ones are packed together before them, so little of that is used.
    assert padding <= (aligned + 1) * (portable.PAGE_BYTES - 1)
    assert path.stat().st_size == 8 + length + payload + padding
    # Every tool reading safetensors takes it; the padding is there, and only there.
    plain = load_file(str(path))
    assert sorted(k for k in plain if not is_padding(k)) == sorted(
        json.loads(header["__metadata__"][METADATA_KEY]))
    assert all(not plain[k].any() for k in plain if is_padding(k))


def test_unchanged_tensors_add_no_pages_to_the_store(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store")
    weights = np.random.default_rng(7).standard_normal(8 << 20).astype(np.float32)  # 32 MiB
    namespace: dict[str, Any] = {
        "weights": weights, "bias": np.arange(1000, dtype=np.float32), "step": 1,
        "scores": np.zeros(50, dtype=np.float64),
    }
    commits = []
    for step in (1, 2):
        namespace["step"] = step
        namespace["scores"] = np.full(50, float(step))  # a small array changes too
        snapshot_id = new_snapshot_id()
        partial = store.begin(snapshot_id)
        report = write_portable(namespace, partial)
        header = checked_layout(partial / TENSOR_FILE)
        size = (partial / TENSOR_FILE).stat().st_size
        with safe_open(str(partial / TENSOR_FILE), framework="numpy") as handle:
            described = json.loads(handle.metadata()[METADATA_KEY])
            stored = {k: handle.get_tensor(k) for k in list(handle.keys()) if not is_padding(k)}
        assert set(stored) == set(described)
        assert any(same_bits(weights, a) for a in stored.values())
        assert any(k for k in header if is_padding(k))
        snapshot = store.commit(partial, {
            "id": snapshot_id, "name": f"copy-{step}", "created": time.time(),
            "reason": "user", "kernel": kernel_section(), "portable": report})
        commits.append((snapshot.manifest, size))

    (first, size), (second, _) = commits
    assert "chunks" in first["files"][TENSOR_FILE] and "chunks" in second["files"][TENSOR_FILE]
    assert first["files"][TENSOR_FILE]["size"] == size
    assert first["stored"]["new_page_bytes"] >= weights.nbytes
    # Only the pages of what changed are new: those of the small arrays, packed together.
    assert second["stored"]["new_page_bytes"] < 1 << 20
    assert second["stored"]["new_page_bytes"] <= 2 * portable.PAGE_BYTES
    # The header, its padding and the gap before the weights: under three pages in all.
    payload = weights.nbytes + 4000 + 400
    assert size - payload < 3 * portable.PAGE_BYTES

    # Assembled from its pages, as a fallback reads it, the copy loads the names, and no
    # padding comes with them.
    loaded: dict[str, Any] = {}
    with store.portable_files(store.get(second["id"])) as directory:
        checked_layout(directory / TENSOR_FILE)
        result = load_portable(loaded, directory, second["portable"])
    assert result["not_loaded"] == [] and sorted(loaded) == sorted(namespace)
    assert same_bits(weights, loaded["weights"]) and loaded["step"] == 2
    assert loaded["scores"].tolist() == [2.0] * 50


class HostStandIn:
    """Just enough of a torch uint8 tensor and of torch.cuda for the staged write path to
    run without a GPU: copies happen at once, so what is checked is the order of the bytes
    and of the padding in the file, not the overlap of copies and writes."""

    uint8 = "uint8"

    def __init__(self, array: np.ndarray | None = None, device: str = "cuda:0") -> None:
        self.array = array if array is not None else np.zeros(0, np.uint8)
        self.device = device
        self.cuda = self

    # torch
    def empty(self, size: int, dtype: Any = None, pin_memory: bool = False) -> HostStandIn:
        return HostStandIn(np.full(size, 0xAB, np.uint8), "cpu")  # garbage unless written

    # torch.cuda
    def Stream(self, device: Any = None) -> HostStandIn:
        return self

    def Event(self) -> HostStandIn:
        return self

    def current_stream(self, device: Any = None) -> HostStandIn:
        return self

    def stream(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def wait_stream(self, other: Any) -> None: ...
    def record(self, stream: Any = None) -> None: ...
    def synchronize(self) -> None: ...

    # a tensor
    def record_stream(self, stream: Any) -> None: ...

    def numel(self) -> int:
        return int(self.array.size)

    def numpy(self) -> np.ndarray:
        return self.array

    def __getitem__(self, part: slice) -> HostStandIn:
        return HostStandIn(self.array[part], self.device)

    def copy_(self, source: HostStandIn, non_blocking: bool = False) -> None:
        self.array[...] = source.array


@pytest.mark.parametrize("chunk", [4096 + 3, 1 << 16, 64 << 20])
def test_staged_device_tensors_and_their_padding_land_in_order(
    chunk: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in = HostStandIn()
    monkeypatch.setitem(sys.modules, "torch", stand_in)
    monkeypatch.setattr(tensor_file, "STAGING_CHUNK_BYTES", chunk)
    monkeypatch.setattr(tensor_file, "_cuda_source", lambda tensor, failed: HostStandIn(
        tensor.value, tensor.device) if tensor.device.startswith("cuda") else None)
    rng = np.random.default_rng(11)
    sizes = [(70_001, "cuda:0"), (13, "cuda:0"), (65_536, "cuda:0"), (200_003, "cuda:1"),
             (5, "cuda:1"), (90_000, "cpu"), (7, "cpu"), (0, "cuda:1"), (131_072, "cuda:1")]
    tensors = []
    for index, (size, device) in enumerate(sizes):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        tensors.append(tensor_file.TensorEntry(f"t{index}", data, "torch" if device != "cpu"
                                        else "numpy", "U8", [size], size, device,
                                        {"framework": "numpy", "dtype": "uint8"}))
    path = tmp_path / TENSOR_FILE
    assert tensor_file.write_tensor_file(path, list(tensors), lambda: False) == {}
    checked_layout(path)
    with safe_open(str(path), framework="numpy") as handle:
        for tensor in tensors:
            assert handle.get_tensor(tensor.key).tobytes() == tensor.value.tobytes()


def test_a_nested_object_refused_names_what_it_holds(tmp_path: Path) -> None:
    import threading

    worker = threading.Thread(target=lambda: None)
    report = write_portable({"jobs": {"worker": worker}, "worker": worker}, tmp_path)
    assert {e["name"]: e["reason"] for e in report["not_carried"]} == {
        "jobs": "it holds a thread", "worker": "a thread"}


def test_loading_never_raises_for_one_name(tmp_path: Path) -> None:
    namespace = {"kept": np.arange(3), "lost": [1, 2], "later": {"x": 1}, "refers": None}
    namespace["refers"] = [namespace["lost"]]
    report = write_portable(namespace, tmp_path)
    lost = next(e for e in report["carried"] if e["name"] == "lost")
    (tmp_path / lost["file"]).write_bytes(b"not a pickle")
    loaded: dict[str, Any] = {}
    result = load_portable(loaded, tmp_path, report)
    assert sorted(loaded) == ["kept", "later"]
    reasons = {item["name"]: item["reason"] for item in result["not_loaded"]}
    assert set(reasons) == {"lost", "refers"}
    assert reasons["refers"] == "it refers to 'lost', which was not loaded"


def test_the_load_result_shows_as_json() -> None:
    formatters = pytest.importorskip("IPython.core.formatters")
    result = PortableLoad({"loaded": [{"name": "x", "kind": "int", "device": "cpu"}],
                           "not_loaded": [], "notes": []})
    data, _ = formatters.DisplayFormatter().format(result)
    assert data["application/json"] == dict(result)
    assert json.loads(data["text/plain"]) == dict(result)


def test_a_stop_request_removes_what_was_written(tmp_path: Path) -> None:
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 2

    namespace = {f"n{i}": np.arange(i + 1) for i in range(5)}
    with pytest.raises(portable.PortableCopyAbandoned):
        write_portable(namespace, tmp_path, should_stop=stop)
    assert list(tmp_path.iterdir()) == []
    assert not (tmp_path / REPORT_FILE).exists()


# -- PyTorch, JAX and CuPy: where they are installed ---------------------------------------

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def torch_or_skip(device: str) -> Any:
    torch = pytest.importorskip("torch")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here")
    return torch


def torch_bits(torch: Any, tensor: Any) -> bytes:
    plain = tensor.detach().resolve_conj().cpu().contiguous().reshape(-1)
    return bytes(plain.view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("device", DEVICES)
def test_a_torch_model_and_its_optimizer_come_back_sharing_their_tensors(
    device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = torch_or_skip(device)
    # Small, odd staging chunks: tensors cross chunk boundaries and share chunks.
    monkeypatch.setattr(tensor_file, "STAGING_CHUNK_BYTES", 4096 + 3)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 4)).to(device=device, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16, device=device, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    optimizer.step()
    big = torch.randn(250_001, device=device)
    tensors = {
        "x": x, "big": big, "every_third": big[::3],
        "transposed": torch.randn(33, 17, device=device).t(),
        "c128": torch.randn(5, dtype=torch.complex128, device=device),
        "f8": torch.randn(7, device=device).to(torch.float8_e4m3fn),
        "ints": torch.arange(11, device=device, dtype=torch.int16),
        "flags": torch.rand(9, device=device) > 0.5,
        "scalar": torch.tensor(2.5, device=device),
        "empty": torch.empty(0, 3, device=device),
        "nonleaf": torch.randn(4, device=device, requires_grad=True) * 2,
        "conj": torch.randn(4, dtype=torch.complex64, device=device).conj(),
    }
    namespace = {"model": model, "optimizer": optimizer, **tensors,
                 "parts": {"weight": model[0].weight, "big": big}}
    report, loaded, result = round_trip(namespace, tmp_path)
    assert report["not_carried"] == [] and result["not_loaded"] == []
    where = f"{device}:0" if device == "cuda" else "cpu"
    carried = {e["name"]: e for e in report["carried"]}
    assert carried["model"]["devices"] == [where]
    assert carried["model"]["kind"] == "torch.nn.modules.container.Sequential"
    assert result["notes"] == []

    for name, tensor in tensors.items():
        back = loaded[name]
        assert back.device.type == device and back.dtype == tensor.dtype, name
        assert back.shape == tensor.shape and torch_bits(torch, back) == torch_bits(torch, tensor)
    assert loaded["nonleaf"].requires_grad
    restored, restored_optimizer = loaded["model"], loaded["optimizer"]
    for key, value in model.state_dict().items():
        assert torch_bits(torch, restored.state_dict()[key]) == torch_bits(torch, value), key
    params = list(restored.parameters())
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in params)
    # The optimizer holds the model's own parameters, and its state is keyed by them.
    assert all(a is b for a, b in zip(restored_optimizer.param_groups[0]["params"], params,
                                      strict=True))
    assert {id(p) for p in restored_optimizer.state} == {id(p) for p in params}
    assert loaded["parts"]["weight"] is restored[0].weight and loaded["parts"]["big"] is loaded[
        "big"]
    state, state_back = optimizer.state_dict()["state"], restored_optimizer.state_dict()["state"]
    for index, values in state.items():
        for key, value in values.items():
            assert torch_bits(torch, state_back[index][key]) == torch_bits(torch, value)
    restored_optimizer.zero_grad()
    restored(loaded["x"]).float().sum().backward()
    restored_optimizer.step()  # training goes on

    on_cpu: dict[str, Any] = {}
    asked = load_portable(on_cpu, tmp_path, report, device="cpu")
    assert all(p.device.type == "cpu" for p in on_cpu["model"].parameters())
    if device == "cuda":
        assert any("cuda:0 tensors were loaded on the CPU, as asked" in n for n in asked["notes"])


def test_without_torch_its_tensors_come_back_as_numpy(tmp_path: Path) -> None:
    torch = torch_or_skip("cpu")
    namespace = {
        "weights": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "half": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "layer": torch.nn.Linear(2, 2),
    }
    write_portable(namespace, tmp_path)
    script = textwrap.dedent(f"""
        import json, sys
        sys.modules["torch"] = None  # as if PyTorch were not installed
        from pathlib import Path
        from jupyter_gpu_snapshot.kernel.portable import load_portable, read_report
        directory = Path({str(tmp_path)!r})
        loaded = {{}}
        result = load_portable(loaded, directory, read_report(directory))
        print(json.dumps({{
            "result": result,
            "weights": [type(loaded["weights"]).__name__, loaded["weights"].tolist()],
            "half": [str(loaded["half"].dtype), loaded["half"].astype("float32").tolist()]
                    if "half" in loaded else None,
        }}))
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True, timeout=60)
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["weights"] == ["ndarray", [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]]
    reasons = {item["name"]: item["reason"] for item in seen["result"]["not_loaded"]}
    assert "torch" in reasons.pop("layer")
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        assert reasons == {"half": "bfloat16 arrays need PyTorch or ml_dtypes, and neither "
                                   "is installed here"}
    else:
        assert reasons == {} and seen["half"] == ["bfloat16", [1.5, -2.0]]
    assert any(note.startswith("PyTorch is not installed here") and "weights" in note
               for note in seen["result"]["notes"])


def test_jax_arrays_come_back_on_their_kind_of_device(tmp_path: Path) -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    arrays = {"a": jnp.arange(12, dtype=jnp.float32).reshape(3, 4),
              "half": jnp.ones(5, dtype=jnp.bfloat16)}
    report, loaded, result = round_trip({**arrays, "both": list(arrays.values())}, tmp_path)
    assert report["not_carried"] == [] and result["not_loaded"] == []
    for name, array in arrays.items():
        back = loaded[name]
        assert isinstance(back, jax.Array) and back.dtype == array.dtype
        assert same_bits(np.asarray(array), np.asarray(back))
        assert {d.platform for d in back.devices()} == {d.platform for d in array.devices()}
    assert loaded["both"][0] is loaded["a"]


def test_cupy_arrays_come_back_on_the_gpu(tmp_path: Path) -> None:
    cupy = pytest.importorskip("cupy")
    try:
        assert cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        pytest.skip("no CUDA GPU for CuPy here")
    array = cupy.arange(10, dtype=cupy.float64) * 1.5
    report, loaded, _ = round_trip({"array": array}, tmp_path)
    assert report["carried"][0]["devices"] == [f"cuda:{array.device.id}"]
    assert isinstance(loaded["array"], cupy.ndarray)
    assert same_bits(array.get(), loaded["array"].get())
